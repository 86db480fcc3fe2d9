"""The decode engine: one compiled step (DDTree, DFlash chain, AR), prefill hand-over, generation."""

from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.generate import GenerationResult, cache_capacity, generate, prefill
from ddtree_jax.engine.host_loop import generate_host_loop
from ddtree_jax.engine.step import METHODS, DecodeState, decode_step, root_only_tree

__all__ = ["DFlashDrafter", "GenerationResult", "generate", "generate_host_loop", "prefill", "cache_capacity", "METHODS", "DecodeState",
           "decode_step", "root_only_tree"]
