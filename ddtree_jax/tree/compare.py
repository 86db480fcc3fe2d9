"""Comparing a built tree with the reference heap, up to swaps of float32 near-ties (|delta logw| < 1e-5).

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
    """'exact' (same nodes, order, parents), 'near-tie' (an allowed swap of near-tied nodes, see
    `near_tie_swap_only`), or 'mismatch'."""
    n = ref.num_nodes
    row = {name: np.asarray(getattr(tree, name)[b]) for name in ("tokens", "parents", "depths", "ranks", "logw")}
    same_count = int(tree.num_nodes[b]) == n
    if (
        same_count
        and all((row[name][:n] == getattr(ref, name)).all() for name in ("tokens", "parents", "depths", "ranks"))
        and np.allclose(row["logw"][:n], ref.logw, rtol=1e-6, atol=tol)
    ):
        return "exact"
    if same_count and near_tie_swap_only(row, ref, tol) is None:
        return "near-tie"
    return "mismatch"


def token_paths(tokens: np.ndarray, parents: np.ndarray, num_nodes: int) -> list[tuple[int, ...]] | None:
    """The token path from the root (root's token excluded) of each of the first num_nodes slots; None if a
    parent is not an earlier slot (then the slots do not form a tree in slot order)."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, num_nodes):
        p = int(parents[i])
        if not 0 <= p < i:
            return None
        paths.append(paths[p] + (int(tokens[i]),))
    return paths


def rank_swap_allowed(ref: ReferenceTree, depth: int, rank: int, ref_rank: int, tol: float = NEAR_TIE) -> bool:
    """Whether a built node may carry `rank` where the reference has `ref_rank` at `depth`: the same rank,
    or two top-K entries with different logits whose log-probabilities are within tol (equal logits
    have one order: lower token id first)."""
    if rank == ref_rank:
        return True
    k = ref.top_log_probs.shape[1]
    if not (0 <= rank < k and 0 <= ref_rank < k):
        return False
    d = depth - 1
    return bool(
        ref.top_logits[d, rank] != ref.top_logits[d, ref_rank]
        and abs(np.float64(ref.top_log_probs[d, rank]) - ref.top_log_probs[d, ref_rank]) <= tol
    )


def near_tie_swap_only(row: dict, ref: ReferenceTree, tol: float = NEAR_TIE) -> str | None:
    """None when a built row (arrays tokens, parents, depths, ranks, logw; num_nodes = ref's) differs from
    the reference only by swaps of float32 near-tied nodes; otherwise the first difference, in words.

    Nodes are matched by their token path from the root. Allowed:
      * matched nodes with the reference's log-weight (within rtol 1e-6, atol 4 tol), depth = path
        length, and the reference's rank, or a rank allowed by `rank_swap_allowed` (a near-tied pair
        of top-K tokens with different logits, swapped at that depth);
      * matched nodes in another slot order only where the two swapped nodes' log-weights are within tol;
      * unmatched nodes on either side (same number, as the node counts agree) only at the selection
        boundary: every unmatched node's log-weight (the reference's, or for a built-only node its
        path's log-weight recomputed from the reference's top-K log-probabilities, which must also
        match the built logw) lies within tol of the reference's weakest selected node, ref.logw[-1].
    Anything else (another token, another parent, a node off the top-K) is a mismatch.
    """
    n = ref.num_nodes
    if int(row["tokens"][0]) != int(ref.tokens[0]) or int(row["parents"][0]) != -1:
        return f"root: token {row['tokens'][0]}, parent {row['parents'][0]} (the reference's: {ref.tokens[0]}, -1)"
    built = token_paths(row["tokens"], row["parents"], n)
    if built is None:
        return "a parent is not an earlier slot"
    if len(set(built)) != n:
        return "two built nodes have the same token path"
    reference = token_paths(ref.tokens, ref.parents, n)
    ref_slot = {path: i for i, path in enumerate(reference)}
    built_slot = {path: i for i, path in enumerate(built)}
    lp, ids = ref.top_log_probs.astype(np.float32), ref.top_ids
    rank_of = [{int(t): r for r, t in enumerate(ids[d])} for d in range(len(ids))]
    boundary = np.float64(ref.logw[-1])
    matched = []  # (built slot, reference slot)
    for i, path in enumerate(built[1:], start=1):
        if int(row["depths"][i]) != len(path):
            return f"slot {i}: depth {row['depths'][i]} != its path length {len(path)}"
        j = ref_slot.get(path)
        if j is not None:
            r, ref_r = int(row["ranks"][i]), int(ref.ranks[j])
            if not rank_swap_allowed(ref, len(path), r, ref_r, tol):
                return f"slot {i}: rank {r}, the reference's {ref_r} (no near-tie of different logits in the top-K)"
            if not np.isclose(row["logw"][i], ref.logw[j], rtol=1e-6, atol=4 * tol):
                return f"slot {i}: logw {row['logw'][i]} != the reference's {ref.logw[j]}"
            matched.append((i, j))
            continue
        logw = np.float32(0.0)  # a built-only node: its path must lie in the top-K at each depth
        for d, tok in enumerate(path):
            if tok not in rank_of[d]:
                return f"slot {i}: token {tok} at depth {d + 1} is not in the reference's top-K"
            logw = np.float32(logw + lp[d, rank_of[d][tok]])
        r, top_r = int(row["ranks"][i]), rank_of[len(path) - 1][path[-1]]
        if not rank_swap_allowed(ref, len(path), r, top_r, tol):
            return f"slot {i}: rank {r}, but token {path[-1]} has rank {top_r} in the top-K (no near-tie)"
        if not np.isclose(row["logw"][i], logw, rtol=1e-6, atol=4 * tol):
            return f"slot {i}: logw {row['logw'][i]} != its path's {logw}"
        if abs(np.float64(logw) - boundary) > tol:
            return (
                f"slot {i}: path {path} is not in the reference tree and not at the cut (logw {logw}, cut {boundary})"
            )
    for j, path in enumerate(reference[1:], start=1):
        if path not in built_slot and abs(np.float64(ref.logw[j]) - boundary) > tol:
            return f"reference slot {j}: path {path} is missing and not at the cut (logw {ref.logw[j]}, cut {boundary})"
    if matched:
        order = np.array([j for _, j in matched])  # reference slots, in built slot order
        w = ref.logw[order].astype(np.float64)
        swapped = order[:, None] > order[None, :]
        swapped &= np.triu(np.ones_like(swapped), 1)  # pairs (a < b in built order) that the reference orders b, a
        far = swapped & (np.abs(w[:, None] - w[None, :]) > tol)
        if far.any():
            a, c = np.argwhere(far)[0]
            return f"reference slots {order[a]} and {order[c]} are swapped without a near-tie ({w[a]} vs {w[c]})"
    return None
