"""Checkpoints: HF configs and safetensors (single or sharded), Orbax."""

from ddtree_jax.checkpoint.hf_config import parse_config, read_config, to_hf_dict
from ddtree_jax.checkpoint.load import load_hf, restore_orbax, save_hf, save_orbax

__all__ = ["load_hf", "save_hf", "save_orbax", "restore_orbax", "parse_config", "read_config", "to_hf_dict"]
