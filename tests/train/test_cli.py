"""`python -m ddtree_jax.train all --config configs/train_tiny.json`: loadable HF dirs and provenance.json; then
the `child_head` stage on that pair."""

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from ddtree_jax.checkpoint import load_hf, load_tokenizer
from ddtree_jax.checkpoint.child_head import load_child_head
from ddtree_jax.config import DFlashConfig, Qwen3Config
from ddtree_jax.engine.run import load_pair
from ddtree_jax.train.__main__ import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_all_on_the_tiny_recipe_writes_loadable_hf_dirs_and_provenance(tmp_path, capsys):
    out = str(tmp_path / "run")
    config = os.path.join(REPO, "configs", "train_tiny.json")
    assert (
        main(
            [
                "all",
                "--config",
                config,
                "--out",
                out,
                "--commit",
                "0123abc",
                "--no-progress",
                "--set",
                "drafter.train.steps=12",
                "--set",
                "export_dtype=bfloat16",
            ]
        )
        == 0
    )
    brief = json.loads(capsys.readouterr().out)
    assert brief["commit"] == "0123abc" and brief["drafter"]["steps"] == 12

    assert sorted(os.listdir(os.path.join(out, "target"))) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(os.listdir(os.path.join(out, "drafter"))) == ["config.json", "model.safetensors"]
    for part in ("target", "drafter"):  # exported as bfloat16 (--set export_dtype=bfloat16)
        with safe_open(os.path.join(out, part, "model.safetensors"), framework="numpy") as f:
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
        with open(os.path.join(out, part, "config.json")) as f:
            assert json.load(f)["torch_dtype"] == "bfloat16"
    # the child_head stage (not part of `all`) trains the path-conditioned head on this pair and exports it; as for
    # a pair trained elsewhere, without the run's tokenizer and manifest (it takes the pair's own tokenizer)
    shutil.rmtree(os.path.join(out, "work", "tokenizer"))
    shutil.rmtree(os.path.join(out, "work", "corpus"))
    assert main(["child_head", "--config", config, "--out", out, "--commit", "4567def", "--no-progress"]) == 0
    head_brief = json.loads(capsys.readouterr().out)["child_head"]
    assert head_brief["steps"] == 8 and np.isfinite(head_brief["heldout_loss"])
    assert np.isfinite(head_brief["heldout_marginal_loss"])
    assert sorted(os.listdir(os.path.join(out, "child_head"))) == ["config.json", "model.safetensors"]
    head_config, head_params = load_child_head(os.path.join(out, "child_head"))
    assert head_config.inner_size == 64 and head_params["out_proj"].shape == (head_config.hidden_size, 64)
    assert np.abs(np.asarray(head_params["out_proj"])).max() > 0  # trained away from the zero (marginal) start
    with open(os.path.join(out, "provenance.json")) as f:
        prov = json.load(f)
    assert prov["child_head"]["frozen"] == ["target", "drafter"]
    # the pair's header is the pair's; the head's own run is recorded in its section
    assert prov["commit"] == "0123abc" and prov["child_head"]["run"]["commit"] == "4567def"
    target_config, target_params = load_hf(os.path.join(out, "target"), jnp.float32)
    drafter_config, drafter_params = load_hf(os.path.join(out, "drafter"), jnp.float32)
    assert isinstance(target_config, Qwen3Config) and isinstance(drafter_config, DFlashConfig)
    tok = load_tokenizer(os.path.join(out, "target"))
    assert tok.eos_token_id == 0 and tok.token_to_id("<|mask|>") == drafter_config.mask_token_id
    assert drafter_config.block_size == 16 and drafter_config.target_layers == (0, 1)
    assert drafter_config.hidden_size == target_config.hidden_size and tok.vocab_size <= target_config.vocab_size

    pair = load_pair(os.path.join(out, "target"), os.path.join(out, "drafter"))
    assert pair.tokenizer is not None and pair.target_config.tapped_layers == (0, 1)
    assert pair.drafter.max_block_size == 16 and pair.drafter.embed.shape == (
        target_config.vocab_size,
        target_config.hidden_size,
    )

    with open(os.path.join(out, "provenance.json")) as f:
        prov = json.load(f)
    assert prov["commit"] == "0123abc" and prov["seed"] == 0 and prov["python_version"].count(".") == 2
    corpus = prov["corpus"]
    assert corpus["python_version"] == prov["python_version"] and len(corpus["file_list_hash"]) == 64
    assert corpus["num_files"]["train"] > 0 and corpus["num_files"]["heldout"] > 0
    assert prov["data"]["train_tokens"] > prov["data"]["heldout_tokens"] > 0
    for part in ("target", "drafter"):
        r = prov[part]
        assert r["steps"] > 0 and np.isfinite(r["final_train_loss"]) and np.isfinite(r["heldout_loss"])
        assert r["params"] > 0 and r["size_mb"] > 0
    assert prov["target"]["heldout_ppl"] == np.exp(prov["target"]["heldout_loss"])
    assert prov["target"]["params"] == sum(int(np.prod(x.shape)) for x in _leaves(target_params))
    assert prov["drafter"]["params"] == sum(int(np.prod(x.shape)) for x in _leaves(drafter_params))
    assert prov["drafter"]["gamma"] == 7.0 and prov["total_size_mb"] > 0
    assert {"tokenizer", "target", "drafter"} <= set(prov["wall_s"]) and prov["device"]["platform"] == "cpu"
    work = os.path.join(out, "work")
    assert os.path.exists(os.path.join(work, "corpus", "manifest.json"))
    assert os.listdir(os.path.join(work, "orbax", "target")) and os.listdir(os.path.join(work, "orbax", "drafter"))

    # `all --resume` on a finished run trains nothing: the target is the same model, so the drafter, its
    # checkpoints and the child head stay (only a target that trained steps makes them stale)
    capsys.readouterr()
    same = ["--set", "drafter.train.steps=12", "--set", "export_dtype=bfloat16", "--resume"]
    assert main(["all", "--config", config, "--out", out, "--no-progress", *same]) == 0
    assert "removed the stale" not in capsys.readouterr().out
    assert os.listdir(os.path.join(work, "orbax", "drafter")) and os.path.exists(os.path.join(out, "child_head"))
    # WORK's corpus / tokenizer were built from this recipe's sections: another recipe's are refused, not ignored
    changed = ["--set", "tokenizer.vocab_size=1024"]
    assert main(["target", "--config", config, "--out", out, "--no-progress", *changed]) == 2
    assert "was built from another corpus / tokenizer recipe" in capsys.readouterr().err
    # a retrained target makes the drafter and child head trained on the old one stale: both are removed (exports,
    # Orbax checkpoints a --resume would restore, provenance sections)
    assert main(["target", "--config", config, "--out", out, "--no-progress", "--set", "target.train.steps=3"]) == 0
    assert "removed the stale drafter" in capsys.readouterr().out
    for part in ("drafter", "child_head"):
        assert not os.path.exists(os.path.join(out, part)) and not os.path.exists(os.path.join(work, "orbax", part))
    with open(os.path.join(out, "provenance.json")) as f:
        prov = json.load(f)
    assert prov["target"]["steps"] == 3 and not {"drafter", "child_head", "total_size_mb"} & set(prov)


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.parametrize(
    "override, message",
    [
        ("export_dtype=float16", "export_dtype .* 'float16'"),
        # were a ZeroDivisionError at the first step, a TypeError, and an untrained export recorded as -5 steps
        ("target.train.log_every=0", "target.train: log_every must be an integer >= 1, got 0"),
        ("target.train.steps=3e1", "target.train: steps must be an integer >= 1, got 30.0"),
        ("target.train.steps=-5", "target.train: steps must be an integer >= 1, got -5"),
        ("target.train.lr=0", "target.train: lr must be > 0"),
        # a misspelt key silently trained the default
        ("tokenizer.vocab=1024", r"unknown keys \['vocab'\] in tokenizer"),
        ("corpus.held_out_frac=0.5", r"unknown keys \['held_out_frac'\] in corpus"),
        ("sed=3", r"unknown keys \['sed'\] in the recipe"),
        # an `all` run's drafter settings, found only after the target had trained
        (
            "drafter.train.num_anchors=100",
            r"drafter.train.num_anchors must be in \[1, data.seq_len - block_size = 48\]",
        ),
        ("drafter.train.dtype=float16", "drafter.train: dtype must be one of"),
        ("drafter.model.target_layers=[5]", r"drafter target_layers \[5\] are outside"),
    ],
)
def test_bad_recipe_values_are_one_error_line_before_anything_runs(override, message, tmp_path, capsys):
    config = os.path.join(REPO, "configs", "train_tiny.json")
    out = tmp_path / "run"
    assert main(["all", "--config", config, "--out", str(out), "--no-progress", "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists()  # nothing ran: no tokenizer, no corpus
    assert main(["all", "--config", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "missing.json" in capsys.readouterr().err
