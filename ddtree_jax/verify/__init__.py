"""Tree verification: the exact target-only walk, the greedy walk, sample-then-walk, and verify_step."""

from ddtree_jax.verify.greedy import verify_greedy, verify_sample_then_walk
from ddtree_jax.verify.result import VerifyResult
from ddtree_jax.verify.sampling import check_tree_lists, verify_sampling
from ddtree_jax.verify.step import METHODS, verify_step

__all__ = [
    "VerifyResult",
    "verify_sampling",
    "verify_greedy",
    "verify_sample_then_walk",
    "verify_step",
    "check_tree_lists",
    "METHODS",
]
