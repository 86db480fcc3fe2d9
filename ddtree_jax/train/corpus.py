"""The training corpus: the .py files of the running interpreter's standard library.

Every file is assigned to "train" or "heldout" by a hash of its relative path alone (sha256 of the
POSIX path, first 8 bytes as a fraction of 2^64 below `held_out_fraction` -> held out), so the split of
a file never depends on which other files exist: two Python patch releases (3.12.1 here, 3.12.3 on the
GPU machine) split their common files identically. `build_manifest` records the split with every
file's size and sha256, the Python version and two hashes: `file_list_hash` (the sorted relative
paths) and `content_hash` (paths and contents), which provenance files quote.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig

ALWAYS_EXCLUDED = ("site-packages/", "dist-packages/", "__pycache__/")


def stdlib_root() -> str:
    """The standard library directory of the running interpreter (sysconfig's "stdlib")."""
    return sysconfig.get_paths()["stdlib"]


def split_of(relpath: str, held_out_fraction: float) -> str:
    """ "heldout" or "train" from the path alone (deterministic, independent of the other files)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2.0**64 < held_out_fraction else "train"


def list_files(
    root: str, include: list[str] | tuple[str, ...] = (), exclude: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """Sorted POSIX relative paths of the .py files under root; `include` / `exclude` are path prefixes
    (a file is kept when it matches some include prefix, or include is empty, and no exclude prefix);
    site-packages, dist-packages and __pycache__ are always excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            padded = "/" + rel
            if any(f"/{p}" in padded for p in ALWAYS_EXCLUDED):
                continue
            if include and not any(rel.startswith(p) for p in include):
                continue
            if any(rel.startswith(p) for p in exclude):
                continue
            out.append(rel)
    return sorted(out)


def build_manifest(
    root: str | None = None,
    *,
    include=(),
    exclude=(),
    held_out_fraction: float = 0.05,
    max_files: int | None = None,
    source: str | None = None,
) -> dict:
    """The corpus manifest: every kept file with its split, size and sha256. Files that are not valid
    UTF-8 (the standard library's tests keep a few on purpose) are listed under `skipped`.
    `max_files` keeps the first files in path order (for quick test configs). `python_version` is the
    running interpreter's when root is its standard library (the default) and None for another root,
    which `source` then describes (e.g. "CPython 3.12.1 standard library")."""
    own_stdlib = root is None or os.path.abspath(root) == os.path.abspath(stdlib_root())
    root = os.path.abspath(root or stdlib_root())
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    paths = list_files(root, include, exclude)
    if max_files is not None:
        paths = paths[:max_files]
    files, skipped = [], []
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        files.append(
            {
                "path": rel,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "split": split_of(rel, held_out_fraction),
            }
        )
    counts = {s: sum(f["split"] == s for f in files) for s in ("train", "heldout")}
    if not counts["train"] or not counts["heldout"]:
        raise ValueError(
            f"the split of {len(files)} files under {root} leaves a side empty ({counts}); "
            "widen the corpus or change held_out_fraction"
        )
    return {
        "root": root,
        "source": source or ("the running interpreter's standard library" if own_stdlib else None),
        "python_version": platform.python_version() if own_stdlib else None,
        "python_implementation": sys.implementation.name,
        "include": list(include),
        "exclude": list(exclude),
        "held_out_fraction": held_out_fraction,
        "max_files": max_files,
        "num_files": counts,
        "num_bytes": {s: sum(f["bytes"] for f in files if f["split"] == s) for s in counts},
        "file_list_hash": hashlib.sha256("\n".join(f["path"] for f in files).encode()).hexdigest(),
        "content_hash": hashlib.sha256("\n".join(f"{f['path']} {f['sha256']}" for f in files).encode()).hexdigest(),
        "skipped": skipped,
        "files": files,
    }


def manifest_from_config(corpus_cfg: dict) -> dict:
    return build_manifest(
        corpus_cfg.get("root"),
        include=tuple(corpus_cfg.get("include", ())),
        exclude=tuple(corpus_cfg.get("exclude", ())),
        held_out_fraction=float(corpus_cfg.get("held_out_fraction", 0.05)),
        max_files=corpus_cfg.get("max_files"),
        source=corpus_cfg.get("source"),
    )


def write_manifest(manifest: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


def read_manifest(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_texts(manifest: dict, split: str) -> list[str]:
    """The texts of one split's files, in path order; a file changed since the manifest raises."""
    texts = []
    for entry in manifest["files"]:
        if entry["split"] != split:
            continue
        with open(os.path.join(manifest["root"], entry["path"]), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{entry['path']} changed since the manifest was written; rebuild it")
        texts.append(data.decode("utf-8"))
    return texts


def summary(manifest: dict) -> dict:
    """The manifest without its file list (for provenance)."""
    return {k: v for k, v in manifest.items() if k not in ("files",)} | {"num_skipped": len(manifest["skipped"])}
