"""Comparing a built tree with the reference heap, up to the float32 near-ties the spec allows.

Used by the tests and by the benchmark (which reports exactness on the device it runs on).
"""

from __future__ import annotations

import numpy as np

from ddtree_jax.tree.draft_tree import DraftTree
from ddtree_jax.tree.reference import ReferenceTree

NEAR_TIE = 1e-5  # |delta logw| below which the jit builder and the heap may order two nodes differently


def reference_has_near_tie(ref: ReferenceTree, tol: float = NEAR_TIE) -> bool:
    """True when two consecutive keys of the reference order (or the cut) lie within `tol`, or two
    different per-depth log-probabilities of the top-K do.

    Exact ties between different paths count too: a tie the heap sees exactly (a + b + c against
    c + b + a) can be a 1-ulp difference for a builder whose log-softmax rounds differently.
    """
    ext = np.concatenate([ref.logw[1:], [ref.frontier_logw]]).astype(np.float64)
    gaps = -np.diff(ext[np.isfinite(ext)])
    rank_gaps = -np.diff(ref.top_log_probs.astype(np.float64), axis=1)
    return bool((gaps < tol).any()) or bool(((rank_gaps > 0) & (rank_gaps < tol)).any())


def compare_to_reference(tree: DraftTree, b: int, ref: ReferenceTree, tol: float = NEAR_TIE) -> str:
    """'exact' (same nodes, order, parents), 'near-tie' (differs only as a swap of near-tied nodes:
    same count, sorted log-weights within tolerance, and the reference has a near-tie), or 'mismatch'."""
    n = ref.num_nodes
    row = {name: np.asarray(getattr(tree, name)[b]) for name in ("tokens", "parents", "depths", "ranks", "logw")}
    same_count = int(tree.num_nodes[b]) == n
    if (
        same_count
        and all((row[name][:n] == getattr(ref, name)).all() for name in ("tokens", "parents", "depths", "ranks"))
        and np.allclose(row["logw"][:n], ref.logw, rtol=1e-6, atol=tol)
    ):
        return "exact"
    if (
        same_count
        and reference_has_near_tie(ref, tol)
        and np.allclose(np.sort(row["logw"][:n]), np.sort(ref.logw), rtol=0, atol=4 * tol)
    ):
        return "near-tie"
    return "mismatch"
