"""Deterministic held-out prompts for the studies: code prefixes from files the pair never trained on.

The training corpus (`ddtree_jax/train/corpus.py`) splits the standard library's .py files into train /
held-out by a hash of each file's relative path alone. The held-out files are read from, in order:

1. `--manifest FILE`, else the run's own manifest `PAIR/work/corpus/manifest.json` when present;
2. else the manifest rebuilt from the recipe recorded in `PAIR/provenance.json` (its `config.corpus`:
   include / exclude prefixes, held_out_fraction) over this interpreter's standard library. The split
   depends on the path alone, so every file held out here was held out (or absent) in training, even on
   another Python patch release; a different file list is reported (`file_list_hash`), not fatal.

A prompt is the first `length` tokens (the pair's tokenizer) of a file's text from the start of a
non-blank line on. Files are visited in a seeded permutation of their sorted paths, one prompt per
file per round (distinct files first), each at a seeded random line with at least
`length + min_continuation` tokens of text from there on. Same manifest, tokenizer, n, length and
seed -> the same prompts.

  python -m experiments.held_out_prompts --pair checkpoints/embedded --n 8 --length 64 [--json prompts.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings

import numpy as np

from ddtree_jax.train import corpus as corpus_mod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PAIR_DIR = os.path.join(REPO, "checkpoints", "embedded")
PAIR_ENV = "DDTREE_PAIR_DIR"


def pair_root(explicit: str | None = None) -> str:
    """The pair's directory: `explicit` (a caller's --pair) if given, else $DDTREE_PAIR_DIR, else
    checkpoints/embedded."""
    return explicit or os.environ.get(PAIR_ENV) or DEFAULT_PAIR_DIR


def find_manifest(pair_dir: str, manifest_path: str | None = None) -> dict:
    """The corpus manifest of the run that trained the pair in `pair_dir` (module docstring)."""
    if manifest_path:
        return corpus_mod.read_manifest(manifest_path)
    own = os.path.join(pair_dir, "work", "corpus", "manifest.json")
    if os.path.exists(own):
        manifest = corpus_mod.read_manifest(own)
        if os.path.isdir(manifest["root"]):
            return manifest
        warnings.warn(
            f"{own} lists files under {manifest['root']!r}, which is not here; rebuilding the split "
            f"over this interpreter's standard library",
            stacklevel=2,
        )
    prov_path = os.path.join(pair_dir, "provenance.json")
    if not os.path.exists(prov_path):
        raise FileNotFoundError(
            f"no corpus manifest for {pair_dir!r}: neither work/corpus/manifest.json nor "
            f"provenance.json is there (pass --manifest)"
        )
    with open(prov_path) as f:
        prov = json.load(f)
    corpus_cfg = dict((prov.get("config") or {}).get("corpus") or {})
    if not corpus_cfg:
        summary = prov.get("corpus") or {}
        corpus_cfg = {k: summary[k] for k in ("include", "exclude", "held_out_fraction", "max_files") if k in summary}
    if not corpus_cfg:
        raise ValueError(f"{prov_path} records no corpus recipe")
    if corpus_cfg.get("root") and not os.path.isdir(corpus_cfg["root"]):
        corpus_cfg.pop("root")
    manifest = corpus_mod.manifest_from_config(corpus_cfg)
    recorded = (prov.get("corpus") or {}).get("file_list_hash")
    if recorded and recorded != manifest["file_list_hash"]:
        warnings.warn(
            f"the rebuilt file list differs from training's (Python {manifest['python_version']} here, "
            f"{(prov.get('corpus') or {}).get('python_version')} there); held-out files stay held out "
            f"(the split is by path)",
            stacklevel=2,
        )
    return manifest


def held_out_files(manifest: dict) -> list[str]:
    """Sorted relative paths of the manifest's held-out files."""
    return sorted(f["path"] for f in manifest["files"] if f["split"] == "heldout")


def _line_starts(text: str) -> list[int]:
    starts, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            starts.append(pos)
        pos += len(line)
    return starts


def held_out_prompts(
    tokenizer, manifest: dict, *, n: int, length: int, seed: int = 0, min_continuation: int = 0
) -> list[dict]:
    """`n` prompts of exactly `length` token ids from the held-out files (module docstring).

    Returns dicts: ids (list[int]), text (the decoded prompt), path (relative to the corpus root), char
    (offset of the prompt's first character), sha256 (of the file as read). ValueError when the held-out
    files cannot supply `n` prompts."""
    if n < 1 or length < 1 or min_continuation < 0:
        raise ValueError(f"need n >= 1, length >= 1, min_continuation >= 0; got {n}, {length}, {min_continuation}")
    paths = held_out_files(manifest)
    if not paths:
        raise ValueError("the manifest has no held-out files")
    rng = np.random.default_rng(seed)
    order = [paths[i] for i in rng.permutation(len(paths))]
    need = length + min_continuation
    texts: dict[str, tuple[str, str]] = {}
    sizes: dict[str, int] = {}  # tokens in the whole file
    used: dict[str, set[int]] = {p: set() for p in order}
    prompts: list[dict] = []
    exhausted: set[str] = set()
    while len(prompts) < n and len(exhausted) < len(order):
        for path in order:
            if len(prompts) == n:
                break
            if path in exhausted:
                continue
            if path not in texts:
                with open(os.path.join(manifest["root"], path), "rb") as f:
                    data = f.read()
                texts[path] = (data.decode("utf-8", errors="replace"), hashlib.sha256(data).hexdigest())
            text, sha = texts[path]
            if path not in sizes:
                sizes[path] = len(tokenizer.encode(text))
            if sizes[path] < need:  # the whole file is too short
                exhausted.add(path)
                continue
            starts = [s for s in _line_starts(text) if s not in used[path]]
            found = None
            for start in (starts[i] for i in rng.permutation(len(starts))):
                used[path].add(start)
                ids = tokenizer.encode(text[start : start + 16 * need])  # byte-level BPE: <= 1 token per byte
                if len(ids) >= need:
                    found = (start, ids[:length])
                    break
            if found is None:
                exhausted.add(path)
                continue
            start, ids = found
            prompts.append(
                {
                    "ids": [int(t) for t in ids],
                    "text": tokenizer.decode(ids),
                    "path": path,
                    "char": start,
                    "sha256": sha,
                }
            )
    if len(prompts) < n:
        raise ValueError(
            f"the {len(paths)} held-out files give only {len(prompts)} prompts of {length} tokens "
            f"(+ {min_continuation} to follow); ask for fewer or shorter prompts"
        )
    return prompts


def load_prompts(
    pair_dir: str,
    tokenizer,
    *,
    n: int,
    length: int,
    seed: int = 0,
    min_continuation: int = 0,
    manifest_path: str | None = None,
) -> list[dict]:
    """`held_out_prompts` for the pair trained into `pair_dir` (target/, drafter/, provenance.json)."""
    return held_out_prompts(
        tokenizer,
        find_manifest(pair_dir, manifest_path),
        n=n,
        length=length,
        seed=seed,
        min_continuation=min_continuation,
    )


def trained_seq_len(pair_dir: str) -> int | None:
    """The training sequence length recorded in provenance.json (positions past it were never trained)."""
    path = os.path.join(pair_dir, "provenance.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        prov = json.load(f)
    return (prov.get("data") or {}).get("seq_len") or ((prov.get("config") or {}).get("data") or {}).get("seq_len")


def check_span(pair_dir: str, length: int, max_new: int) -> None:
    """Warns when prompt + generation runs past the positions the target was trained on."""
    seq_len = trained_seq_len(pair_dir)
    if seq_len and length + max_new > seq_len:
        warnings.warn(
            f"prompt {length} + max_new {max_new} tokens exceeds the training sequence length {seq_len}: "
            f"the target never saw those positions",
            stacklevel=2,
        )


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pair", default=None, help="the pair's directory (default $DDTREE_PAIR_DIR or checkpoints/embedded)"
    )
    parser.add_argument("--manifest", default=None, help="a corpus manifest.json (default: found from the pair)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--min-continuation", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the prompts here")
    args = parser.parse_args(argv)
    root = pair_root(args.pair)
    tokenizer = load_tokenizer(os.path.join(root, "target"))
    if tokenizer is None:
        raise SystemExit(f"error: no tokenizer in {os.path.join(root, 'target')}")
    prompts = load_prompts(
        root,
        tokenizer,
        n=args.n,
        length=args.length,
        seed=args.seed,
        min_continuation=args.min_continuation,
        manifest_path=args.manifest,
    )
    for i, p in enumerate(prompts):
        print(f"--- prompt {i}: {p['path']} @ char {p['char']}\n{p['text']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(prompts, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
