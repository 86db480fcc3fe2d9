"""Tree verification: the exact target-only walk, the greedy walk, sample-then-walk, and verify_step."""

from ddtree_jax.options import VERIFIERS
from ddtree_jax.verify.follow import verify_greedy, verify_sample_then_walk
from ddtree_jax.verify.result import VerifyResult
from ddtree_jax.verify.sampling import check_tree_lists, verify_sampling
from ddtree_jax.verify.step import mask_invalid_rows, verify_step

__all__ = [
    "VerifyResult",
    "verify_sampling",
    "verify_greedy",
    "verify_sample_then_walk",
    "verify_step",
    "check_tree_lists",
    "VERIFIERS",
    "mask_invalid_rows",
]
