"""`load_hf` / `save_hf` for HF directories, and Orbax save/restore of converted params."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from ddtree_jax.checkpoint.hf_config import parse_config, read_config, to_hf_dict
from ddtree_jax.checkpoint.hf_weights import load_weights, save_weights
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config


def load_hf(path: str, dtype="auto", *, check_finite: bool = False) -> tuple[Qwen3Config | DFlashConfig, dict]:
    """(config, params) from an HF directory: config.json and single or sharded safetensors.

    dtype: "auto" (default, as transformers' dtype="auto") keeps the checkpoint's stored floating dtype;
      jnp.bfloat16 (or "bfloat16") casts to bf16. check_finite: reject tensors holding NaN/inf.
    A checkpoint that cannot be loaded raises CheckpointError (a ValueError) naming the file and the
    key, value or tensor.
    """
    config = parse_config(read_config(path))
    return config, load_weights(path, config, dtype, check_finite=check_finite)


def save_hf(
    path: str,
    config: Qwen3Config | DFlashConfig,
    params: dict,
    *,
    vocab_size: int | None = None,
    dtype=np.float32,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes config.json and safetensors that `load_hf` (and HF-style loaders) read back (Qwen3 and DFlash; a
    DeepSeek-V3 / K2 config raises NotImplementedError before anything is written)."""
    if isinstance(config, DeepSeekV3Config):  # to_hf_dict would fail after config.json was opened (emptied)
        raise NotImplementedError("save_hf for DeepSeek-V3 / Kimi K2 checkpoints is not implemented (load_hf is)")
    hf_config = to_hf_dict(config, vocab_size)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    save_weights(path, config, params, dtype, max_shard_bytes)


def save_orbax(path: str, params: dict) -> None:
    """Saves a param tree with Orbax (a converted checkpoint loads faster than safetensors + stacking)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), params, force=True)


def restore_orbax(path: str, like: dict | None = None) -> dict:
    """Restores a tree saved by `save_orbax`; `like` (arrays or ShapeDtypeStructs) fixes shapes/dtypes."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        if like is None:
            return checkpointer.restore(os.path.abspath(path))
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        return checkpointer.restore(os.path.abspath(path), target)
