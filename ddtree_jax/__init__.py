"""ddtree-jax: DDTree speculative decoding with exact temperature sampling, in JAX.

The pipeline of one decode step, in module order: tree (build the draft tree) -> sampling / verify
(exact target-only tree rejection sampling) -> models (the target's tree forward, caches, the DFlash
drafter) -> engine (the compiled step and loops; `DecodeOptions` says how it runs, `dispatch` resolves
every "auto"). Kernels live apart, in the `ddtree_kernels` package. See README.md for the map.
"""

from ddtree_jax.config import DFlashConfig, Qwen3Config
from ddtree_jax.options import DecodeOptions
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams, draw_coins, processed_probs, row_keys, sample
from ddtree_jax.tree import (
    DraftTree,
    ancestor_mask,
    build_chain,
    build_tree,
    build_tree_reference,
    positions,
    verification_order,
)
from ddtree_jax.verify import VerifyResult, verify_greedy, verify_sample_then_walk, verify_sampling, verify_step

__version__ = "0.1.0"

__all__ = [
    "DraftTree",
    "build_tree",
    "build_tree_reference",
    "build_chain",
    "positions",
    "ancestor_mask",
    "verification_order",
    "SamplingParams",
    "processed_probs",
    "sample",
    "draw_coins",
    "row_keys",
    "INVALID_TOKEN",
    "VerifyResult",
    "verify_sampling",
    "verify_greedy",
    "verify_sample_then_walk",
    "verify_step",
    "Qwen3Config",
    "DFlashConfig",
    "DecodeOptions",
]
