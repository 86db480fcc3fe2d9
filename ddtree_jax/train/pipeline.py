"""The training pipeline behind `python -m ddtree_jax.train`: corpus + tokenizer, target, drafter,
HF-format exports and provenance.json.

Layout (OUT is `--out`, WORK is `--work`, default OUT/work):

    OUT/target/        config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    OUT/drafter/       config.json (dflash_config), model.safetensors
    OUT/child_head/    config.json, model.safetensors (the `child_head` stage: the path-conditioned head, issue #23)
    OUT/provenance.json
    WORK/corpus/manifest.json     the file list with its split (reproducible), hashes
    WORK/tokenizer/               tokenizer.json + tokenizer_config.json
    WORK/data/                    packed token sequences (cache)
    WORK/orbax/{target,drafter}/step_XXXXXXXX   Orbax checkpoints (--resume continues from the newest)
    WORK/logs/{target,drafter}.jsonl            losses per logged step and evaluations

Each stage reuses what the previous stages left in WORK / OUT (a `target` run without a tokenizer
trains one first; `drafter` needs OUT/target; `child_head`, not part of `all`, needs OUT/target and OUT/drafter
and the recipe's "child_head" section).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.checkpoint import load_hf, save_hf, to_hf_dict
from ddtree_jax.checkpoint.child_head import save_child_head
from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.train import child_head as head_mod
from ddtree_jax.train import corpus as corpus_mod
from ddtree_jax.train import data as data_mod
from ddtree_jax.train import drafter as drafter_mod
from ddtree_jax.train import target as target_mod
from ddtree_jax.train import tokenizer as tok_mod
from ddtree_jax.train.common import train_settings

STAGES = ("tokenizer", "target", "drafter", "all", "child_head")
RECIPE_KEYS = (
    "name",
    "description",
    "seed",
    "corpus",
    "tokenizer",
    "data",
    "target",
    "drafter",
    "child_head",
    "export_dtype",
)
CORPUS_KEYS = ("root", "include", "exclude", "held_out_fraction", "max_files", "source")  # corpus.manifest_from_config
TOKENIZER_KEYS = ("vocab_size", "min_frequency", "special_tokens")
DATA_KEYS = ("seq_len",)
# what a stage's outputs feed: a retrained target makes the drafter and the child head trained on the old one stale
DOWNSTREAM = {"target": ("drafter", "child_head"), "drafter": ("child_head",)}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
RECIPE_FILE = "recipe.json"  # in WORK/tokenizer: the corpus and tokenizer sections that built WORK


def load_config(path: str, overrides: list[str] = ()) -> dict:
    """The JSON recipe, with `key.sub=value` overrides (value parsed as JSON, else a string)."""
    with open(path) as f:
        cfg = json.load(f)
    for item in overrides:
        key, _, raw = item.partition("=")
        if not _:
            raise ValueError(f"override {item!r} is not key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    for section in ("corpus", "tokenizer", "data", "target", "drafter"):
        if section not in cfg:
            raise ValueError(f"{path}: missing section {section!r}")
    # a misspelt key would silently train the default (the model and train sections are checked by their stages)
    for where, node, known in (
        ("the recipe", cfg, RECIPE_KEYS),
        ("corpus", cfg["corpus"], CORPUS_KEYS),
        ("tokenizer", cfg["tokenizer"], TOKENIZER_KEYS),
        ("data", cfg["data"], DATA_KEYS),
    ):
        if not isinstance(node, dict):
            raise ValueError(f"{path}: {where} must be a JSON object, got {node!r}")
        unknown = sorted(set(node) - set(known))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown} in {where}; known: {sorted(known)}")
    return cfg


class Run:
    def __init__(
        self,
        cfg: dict,
        out: str,
        work: str | None = None,
        *,
        commit: str | None = None,
        resume: bool = False,
        show_progress: bool = True,
        config_path: str | None = None,
    ):
        self.cfg = cfg
        self.out = os.path.abspath(out)
        self.work = os.path.abspath(work or os.path.join(out, "work"))
        self.commit = commit
        self._addon_stage = False  # True while an add-on stage (child_head) runs: the header stays the pair's
        self.resume = resume
        self.show_progress = show_progress
        self.config_path = config_path
        self.seed = int(cfg.get("seed", 0))
        export = cfg.get("export_dtype", "float32")
        if export not in EXPORT_DTYPES:
            raise ValueError(f"export_dtype must be one of {sorted(EXPORT_DTYPES)}, got {export!r}")
        self.export_dtype = EXPORT_DTYPES[export]  # the safetensors dtype of the exported target and drafter

    # -- paths ---------------------------------------------------------------------------------
    def path(self, *parts) -> str:
        return os.path.join(self.work, *parts)

    @property
    def target_dir(self) -> str:
        return os.path.join(self.out, "target")

    @property
    def drafter_dir(self) -> str:
        return os.path.join(self.out, "drafter")

    # -- stages --------------------------------------------------------------------------------
    def tokenizer(self) -> dict:
        began = time.perf_counter()
        manifest = corpus_mod.manifest_from_config(self.cfg["corpus"])
        corpus_mod.write_manifest(manifest, self.path("corpus", "manifest.json"))
        tcfg = self.cfg["tokenizer"]
        specials = {**tok_mod.DEFAULT_SPECIALS, **tcfg.get("special_tokens", {})}
        tok = tok_mod.train_tokenizer(
            corpus_mod.read_texts(manifest, "train"),
            int(tcfg.get("vocab_size", 8192)),
            int(tcfg.get("min_frequency", 2)),
            specials,
        )
        tok_mod.save(tok, self.path("tokenizer"), specials)
        with open(self.path("tokenizer", RECIPE_FILE), "w") as f:  # what built WORK's corpus and tokenizer
            json.dump(self._inputs_recipe(), f, indent=1, sort_keys=True)
        info = {
            "vocab_size": tok.get_vocab_size(),
            "requested_vocab_size": int(tcfg.get("vocab_size", 8192)),
            "special_tokens": {
                k: {"text": specials[k], "id": i} for k, i in tok_mod.special_ids(tok, specials).items()
            },
            "tokenizer_sha256": tok_mod.file_hash(self.path("tokenizer")),
            "trained_on": "train split",
            "kind": "byte-level BPE (tokenizers)",
        }
        self.update_provenance(
            corpus=corpus_mod.summary(manifest),
            tokenizer=info,
            wall_s={"tokenizer": round(time.perf_counter() - began, 2)},
        )
        return info

    def _inputs(self):
        """(manifest, tokenizer, special ids, train sequences, held-out sequences), building what is missing."""
        if not (
            os.path.exists(self.path("corpus", "manifest.json"))
            and os.path.exists(self.path("tokenizer", "tokenizer.json"))
        ):
            self.tokenizer()
        self._check_work_recipe()
        manifest = corpus_mod.read_manifest(self.path("corpus", "manifest.json"))
        specials = {**tok_mod.DEFAULT_SPECIALS, **self.cfg["tokenizer"].get("special_tokens", {})}
        tok = tok_mod.load(self.path("tokenizer"))
        ids = tok_mod.special_ids(tok, specials)
        tok_hash = tok_mod.file_hash(self.path("tokenizer"))
        seq_len = int(self.cfg["data"]["seq_len"])
        train, n_train = data_mod.load_or_build(self.work, "train", tok, tok_hash, manifest, ids["eos"], seq_len)
        held, n_held = data_mod.load_or_build(self.work, "heldout", tok, tok_hash, manifest, ids["eos"], seq_len)
        self.update_provenance(
            data={
                "seq_len": seq_len,
                "train_tokens": n_train,
                "heldout_tokens": n_held,
                "train_sequences": int(len(train)),
                "heldout_sequences": int(len(held)),
                "packing": "files in path order, each followed by eos, cut into seq_len chunks",
            }
        )
        return manifest, tok, ids, train, held

    def _check_work_recipe(self) -> None:
        """ValueError when WORK's corpus and tokenizer were built from other recipe sections than this run's (which
        would be silently ignored); nothing when WORK records none (not built yet, or by an earlier version)."""
        recorded = self.path("tokenizer", RECIPE_FILE)
        if not os.path.exists(recorded):
            return
        with open(recorded) as f:
            built_from = json.load(f)
        if built_from != json.loads(json.dumps(self._inputs_recipe())):
            raise ValueError(
                f"{self.work} was built from another corpus / tokenizer recipe ({recorded}: {built_from}); this "
                "recipe's would be ignored: give a fresh --work, or run the `tokenizer` stage to rebuild it"
            )

    def _inputs_recipe(self) -> dict:
        """The recipe sections WORK's corpus and tokenizer are built from."""
        return {"corpus": self.cfg["corpus"], "tokenizer": self.cfg["tokenizer"]}

    def vocab_size(self, tok) -> int:
        size = int(self.cfg["target"]["model"].get("vocab_size", 0)) or int(
            self.cfg["tokenizer"].get("vocab_size", 8192)
        )
        if tok.get_vocab_size() > size:
            raise ValueError(f"the tokenizer has {tok.get_vocab_size()} ids, more than the model's vocab_size {size}")
        return size

    def _train_stage(self, stage: str, export_dir: str, train_fn, *args) -> tuple[dict, dict]:
        """train_fn(*args) (a module's `train`) with this run's seed, resume and progress settings, its Orbax
        checkpoints in WORK/orbax/<stage> and its log in WORK/logs/<stage>.jsonl; then the stage's previous
        export, `export_dir`, is removed. Returns train_fn's (float32 params, results)."""
        params, results = train_fn(
            *args,
            seed=self.seed,
            checkpoint_dir=self.path("orbax", stage),
            log_path=self.path("logs", f"{stage}.jsonl"),
            resume=self.resume,
            show_progress=self.show_progress,
        )
        if os.path.exists(export_dir):
            shutil.rmtree(export_dir)
        return params, results

    def target(self) -> dict:
        manifest, tok, ids, train, held = self._inputs()
        model_cfg = {k: v for k, v in self.cfg["target"]["model"].items() if k != "vocab_size"}
        config = target_mod.model_config(model_cfg, self.vocab_size(tok))
        settings = train_settings(self.cfg["target"]["train"])
        params, results = self._train_stage("target", self.target_dir, target_mod.train, config, settings, train, held)
        save_hf(self.target_dir, config, params, dtype=self.export_dtype)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.path("tokenizer", name), os.path.join(self.target_dir, name))
        _patch_json(
            os.path.join(self.target_dir, "config.json"),
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            torch_dtype=self.cfg.get("export_dtype", "float32"),
        )
        results.update(config=to_hf_dict(config), size_mb=_dir_mb(self.target_dir))
        self.update_provenance(target=results, wall_s={"target": results["wall_s"]})
        self._drop_downstream("target", results)
        return results

    def drafter(self) -> dict:
        manifest, tok, ids, train, held = self._inputs()
        target_config, target_params = load_hf(self.target_dir, jnp.float32)
        config = drafter_mod.model_config(dict(self.cfg["drafter"]["model"]), target_config, ids["mask"])
        settings = train_settings(self.cfg["drafter"]["train"])
        params, results = self._train_stage(
            "drafter", self.drafter_dir, drafter_mod.train, config, target_config, target_params, settings, train, held
        )
        save_hf(self.drafter_dir, config, params, vocab_size=target_config.vocab_size, dtype=self.export_dtype)
        _patch_json(
            os.path.join(self.drafter_dir, "config.json"),
            num_target_layers=target_config.num_layers,
            torch_dtype=self.cfg.get("export_dtype", "float32"),
        )
        frozen = ["model.embed_tokens.weight"] + ([] if target_config.tie_word_embeddings else ["lm_head.weight"])
        results.update(
            config=to_hf_dict(config, target_config.vocab_size),
            size_mb=_dir_mb(self.drafter_dir),
            frozen_from_target=frozen,
        )
        self.update_provenance(drafter=results, wall_s={"drafter": results["wall_s"]})
        self._drop_downstream("drafter", results)
        return results

    @property
    def child_head_dir(self) -> str:
        return os.path.join(self.out, "child_head")

    def child_head(self) -> dict:
        if "child_head" not in self.cfg:
            raise ValueError("the recipe has no 'child_head' section (model.inner_size and train settings)")
        self._pair_tokenizer()
        _, _, _, train, held = self._inputs()
        target_config, target_params = load_hf(self.target_dir, jnp.float32)
        drafter_config, drafter_params = load_hf(self.drafter_dir, jnp.float32)
        section = self.cfg["child_head"]
        unknown = set(section.get("model", {})) - {"inner_size"}
        if unknown:
            raise ValueError(f"unknown child_head model settings {sorted(unknown)}")
        config = ChildHeadConfig(hidden_size=drafter_config.hidden_size, inner_size=int(section["model"]["inner_size"]))
        settings = train_settings(section["train"])
        params, results = self._train_stage(
            "child_head",
            self.child_head_dir,
            head_mod.train,
            config,
            drafter_config,
            drafter_params,
            target_config,
            target_params,
            settings,
            train,
            held,
        )
        save_child_head(self.child_head_dir, config, params, dtype=self.export_dtype)
        header = self._header()
        run = {k: header[k] for k in ("commit", "updated", "python_version", "device")}
        results.update(
            size_mb=_dir_mb(self.child_head_dir),
            frozen=["target", "drafter"],
            run=run | {"recipe": header["recipe"], "config": copy.deepcopy(section)},
        )
        # the pair's header (commit, device, recipe) stays the pair's: the head records its own run
        self.update_provenance(child_head=results, wall_s={"child_head": results["wall_s"]})
        return results

    def _pair_tokenizer(self) -> None:
        """A pair trained elsewhere (e.g. the committed one) has no WORK here: its own tokenizer (OUT/target's) is
        put in WORK and the corpus manifest rebuilt from the recipe, instead of training a tokenizer that could
        differ; a tokenizer whose sha256 is not the one provenance.json records is refused."""
        if os.path.exists(self.path("tokenizer", "tokenizer.json")):
            return
        os.makedirs(self.path("tokenizer"), exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(self.target_dir, name), self.path("tokenizer", name))
        prov_path = os.path.join(self.out, "provenance.json")
        if os.path.exists(prov_path):
            with open(prov_path) as f:
                want = json.load(f).get("tokenizer", {}).get("tokenizer_sha256")
            got = tok_mod.file_hash(self.path("tokenizer"))
            if want and got != want:
                raise ValueError(
                    f"{self.target_dir}/tokenizer.json has sha256 {got}, provenance.json records {want}: not this pair's"
                )
        if not os.path.exists(self.path("corpus", "manifest.json")):
            manifest = corpus_mod.manifest_from_config(self.cfg["corpus"])
            corpus_mod.write_manifest(manifest, self.path("corpus", "manifest.json"))

    def check(self, stage: str) -> None:
        """Every setting the stages of `stage` will read, checked before any runs (a bad drafter setting of an
        `all` run used to fail after the tokenizer and the target had trained): the training settings, the model
        settings (the drafter's against the recipe's target), the anchors against the sequence length."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        needs = {"drafter": (self.target_dir,), "child_head": (self.target_dir, self.drafter_dir)}.get(stage, ())
        for part in needs:  # a stage run alone trains on what an earlier run exported
            if not os.path.exists(os.path.join(part, "config.json")):
                raise FileNotFoundError(f"no trained model in {part}: run the earlier stages first (`all`)")
        if stage in ("target", "drafter"):  # they reuse WORK's corpus and tokenizer (`all` rebuilds them first)
            self._check_work_recipe()
        seq_len = self.cfg["data"].get("seq_len")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"data.seq_len must be an integer >= 2, got {seq_len!r}")
        model_cfg = {k: v for k, v in self.cfg["target"]["model"].items() if k != "vocab_size"}
        vocab = int(self.cfg["target"]["model"].get("vocab_size", 0)) or int(
            self.cfg["tokenizer"].get("vocab_size", 8192)
        )
        target = target_mod.model_config(model_cfg, vocab)
        sections = {"target": ("target",), "drafter": ("drafter",), "all": ("target", "drafter")}
        sections["child_head"] = ("child_head",)
        for name in sections.get(stage, ()):
            if name not in self.cfg:
                raise ValueError(f"the recipe has no {name!r} section")
            try:
                settings = train_settings(self.cfg[name]["train"])
            except ValueError as e:
                raise ValueError(f"{name}.train: {e}") from None
            if name == "drafter":
                config = drafter_mod.model_config(dict(self.cfg["drafter"]["model"]), target, mask_token_id=0)
                block = config.block_size
            elif name == "child_head":
                block = int(self.cfg["drafter"]["model"].get("block_size", 16))
            else:
                continue
            anchors = drafter_mod.anchor_settings(settings, block)[1]
            if not 1 <= anchors <= seq_len - block:
                raise ValueError(
                    f"{name}.train.num_anchors must be in [1, data.seq_len - block_size = {seq_len - block}], "
                    f"got {anchors}"
                )

    def run(self, stage: str) -> dict:
        self.check(stage)
        began = time.perf_counter()
        if stage in ("tokenizer", "all"):
            self.tokenizer()
        if stage in ("target", "all"):
            self.target()
        if stage in ("drafter", "all"):
            self.drafter()
        if stage == "child_head":
            self._addon_stage = True
            try:
                self.child_head()
            finally:
                self._addon_stage = False
        return self.update_provenance(
            wall_s={f"{stage}_total": round(time.perf_counter() - began, 2)}, header=stage != "child_head"
        )

    def _drop_downstream(self, stage: str, results: dict) -> None:
        """After `stage` trained and exported: the exports, Orbax checkpoints and provenance sections of what was
        trained on its previous output (`DOWNSTREAM`) are removed, so neither a stale pair nor a resume from a stale
        checkpoint (trained against the old model) survives. A stage resumed at its last step trained nothing (its
        export is the same model, e.g. `all --resume` passing a finished target): then nothing is removed."""
        if results.get("resumed_from") == results.get("steps"):
            return
        path = os.path.join(self.out, "provenance.json")
        prov = {}
        if os.path.exists(path):
            with open(path) as f:
                prov = json.load(f)
        for part in DOWNSTREAM.get(stage, ()):
            stale = [p for p in (os.path.join(self.out, part), self.path("orbax", part)) if os.path.exists(p)]
            for directory in stale:
                shutil.rmtree(directory)
            if stale or part in prov:
                print(f"{stage} retrained: removed the stale {part} ({', '.join(stale) or 'provenance'})")
            prov.pop(part, None)
            prov.get("wall_s", {}).pop(part, None)
        if prov and DOWNSTREAM.get(stage):
            if "drafter" not in prov:  # the pair's size counts a drafter
                prov.pop("total_size_mb", None)
            with open(path, "w") as f:
                json.dump(_ordered(prov), f, indent=1)

    # -- provenance ------------------------------------------------------------------------------
    def update_provenance(self, header: bool | None = None, **sections) -> dict:
        """Merge `sections` into OUT/provenance.json; the header (commit, date, recipe, device) describes the pair and
        is rewritten by the pair's stages only (default: unless an add-on stage like `child_head` is running, which
        records its own run inside its section)."""
        if header is None:
            header = not self._addon_stage
        path = os.path.join(self.out, "provenance.json")
        prov = {}
        if os.path.exists(path):
            with open(path) as f:
                prov = json.load(f)
        for key, value in sections.items():
            if isinstance(value, dict) and key == "wall_s":
                prov[key] = {**prov.get(key, {}), **value}
            else:
                prov[key] = value
        if header or "commit" not in prov:
            prov.update(self._header())
        if "target" in prov and "drafter" in prov:
            prov["total_size_mb"] = round(prov["target"]["size_mb"] + prov["drafter"]["size_mb"], 3)
        os.makedirs(self.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(_ordered(prov), f, indent=1)
        return prov

    def _header(self) -> dict:
        device = jax.devices()[0]
        return {
            "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": self.commit or _git_commit(),
            "recipe": os.path.relpath(self.config_path) if self.config_path else None,
            "config": copy.deepcopy(self.cfg),
            "seed": self.seed,
            "python_version": platform.python_version(),
            "device": {
                "platform": device.platform,
                "kind": device.device_kind,
                "count": jax.device_count(),
                "jax": jax.__version__,
            },
        }


_ORDER = (
    "commit",
    "updated",
    "recipe",
    "seed",
    "python_version",
    "device",
    "corpus",
    "tokenizer",
    "data",
    "target",
    "drafter",
    "child_head",
    "total_size_mb",
    "wall_s",
    "config",
)


def _ordered(prov: dict) -> dict:
    return {k: prov[k] for k in _ORDER if k in prov} | {k: v for k, v in prov.items() if k not in _ORDER}


def _patch_json(path: str, **fields) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _dir_mb(directory: str) -> float:
    return round(sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)) / 1e6, 3)


def _git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
