"""Checkpoints: HF configs and safetensors (single or sharded), Orbax, tokenizers and chat templates."""

from ddtree_jax.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from ddtree_jax.checkpoint.hf_config import parse_config, read_config, to_hf_dict
from ddtree_jax.checkpoint.load import load_hf, restore_orbax, save_hf, save_orbax
from ddtree_jax.checkpoint.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "load_hf",
    "save_hf",
    "save_orbax",
    "restore_orbax",
    "parse_config",
    "read_config",
    "to_hf_dict",
    "Tokenizer",
    "load_tokenizer",
]
