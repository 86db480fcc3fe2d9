"""The decode engine: one compiled step (DDTree, DFlash chain, AR), prefill hand-over, generation."""

from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.generate import (
    GenerationResult,
    cache_capacity,
    generate,
    generate_recorded,
    prefill,
    start_state,
)
from ddtree_jax.engine.host_loop import generate_host_loop
from ddtree_jax.engine.step import DecodeState, StepTrace, decode_step, root_only_tree, traced_decode_step
from ddtree_jax.options import METHODS, DecodeOptions

__all__ = [
    "DFlashDrafter",
    "DecodeOptions",
    "GenerationResult",
    "generate",
    "generate_recorded",
    "generate_host_loop",
    "prefill",
    "start_state",
    "cache_capacity",
    "METHODS",
    "DecodeState",
    "StepTrace",
    "decode_step",
    "traced_decode_step",
    "root_only_tree",
]
