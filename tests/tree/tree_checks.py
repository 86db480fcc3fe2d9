"""Shared checks for draft trees: invariants, and equality with the reference up to float32 near-ties."""

from __future__ import annotations

import itertools

import numpy as np

from ddtree_jax.tree import DraftTree, ReferenceTree
from ddtree_jax.tree.compare import NEAR_TIE, compare_to_reference, near_tie_swap_only
from ddtree_jax.tree.reference import log_softmax_f32, top_k_ranked


def row_arrays(tree: DraftTree, b: int) -> dict[str, np.ndarray]:
    return {name: np.asarray(getattr(tree, name)[b]) for name in ("tokens", "parents", "depths", "ranks", "logw")} | {
        "num_nodes": int(tree.num_nodes[b])
    }


def independent_ranking(draft_logits_row: np.ndarray) -> np.ndarray:
    """[L, V] token ids of each depth by descending logit, equal logits: lower token id first (the stated
    tie-break), by a numpy stable sort: independent of the builder's top-K."""
    x = np.asarray(draft_logits_row).astype(np.float64)
    return np.argsort(-x, axis=-1, kind="stable")


def check_invariants(tree: DraftTree, b: int, draft_logits_row: np.ndarray, k: int | None = None) -> None:
    """Structural facts every row must satisfy, with tokens and log-weights checked against an independent
    selection (`independent_ranking` and the reference's float64 log-softmax) of `draft_logits_row` [L, V].

    k: the top-K width the tree draws from (default min(budget, V), budget = slots - 1). A token at rank r
    must be the r-th of the independent ranking, except for a swap of two tokens with different logits
    whose log-probabilities are within NEAR_TIE (the builder's float32 log-softmax may round them apart);
    equal logits must follow the tie-break exactly.
    """
    row = row_arrays(tree, b)
    n, slots = row["num_nodes"], len(row["tokens"])
    x = np.asarray(draft_logits_row).astype(np.float64)
    ranking = independent_ranking(x)
    log_probs = log_softmax_f32(x)
    k = min(slots - 1, x.shape[-1]) if k is None else k
    assert 1 <= n <= slots
    assert row["parents"][0] == -1 and row["depths"][0] == 0 and row["ranks"][0] == -1 and row["logw"][0] == 0
    seen_children: dict[int, list[int]] = {}
    for i in range(1, n):
        p, d, r, tok = row["parents"][i], row["depths"][i], row["ranks"][i], int(row["tokens"][i])
        assert 0 <= p < i, f"slot {i}: parent {p} must be an earlier real slot"
        assert d == row["depths"][p] + 1 and 1 <= d <= tree.max_depth
        assert 0 <= r < k, f"slot {i}: rank {r} outside the top-{k}"
        want = int(ranking[d - 1, r])
        if tok != want:
            assert x[d - 1, tok] != x[d - 1, want], (
                f"slot {i}: token {tok} at rank {r}, but equal logits rank lower ids first: {want}"
            )
            assert abs(float(log_probs[d - 1, tok]) - float(log_probs[d - 1, want])) <= NEAR_TIE, (
                f"slot {i}: token {tok} at depth {d} rank {r}, the independent top-K has {want} there"
            )
        expected = np.float32(row["logw"][p] + log_probs[d - 1, tok])
        # the builder's log-softmax is a separate float32 computation, which may round differently (GPU)
        assert abs(row["logw"][i] - expected) <= 1e-6 + 2e-6 * abs(expected), (
            f"slot {i}: logw {row['logw'][i]} != parent + lp = {expected}"
        )
        assert row["logw"][i] <= row["logw"][i - 1], "logw must be non-increasing in slot order"
        seen_children.setdefault(int(p), []).append(int(r))
    for p, rs in seen_children.items():
        assert rs == list(range(len(rs))), f"children of slot {p} must be ranks 0..m-1 in slot order, got {rs}"
    pad = slice(n, slots)
    assert (row["parents"][pad] == -1).all() and (row["depths"][pad] == 0).all()
    assert (row["ranks"][pad] == -1).all() and (row["tokens"][pad] == 0).all()
    assert np.isneginf(row["logw"][pad]).all()


def assert_matches_reference(tree: DraftTree, b: int, ref: ReferenceTree, *, allow_near_ties: bool = True) -> bool:
    """Same nodes, same order, same parents as the heap; returns True if it matched exactly.

    With allow_near_ties, a swap of float32 near-tied nodes (see `compare_to_reference`) is accepted.
    """
    verdict = compare_to_reference(tree, b, ref)
    if verdict == "exact" or (allow_near_ties and verdict == "near-tie"):
        return verdict == "exact"
    row = row_arrays(tree, b)
    n = ref.num_nodes
    why = near_tie_swap_only(row, ref) if row["num_nodes"] == n else f"{row['num_nodes']} nodes, the reference {n}"
    raise AssertionError(
        f"row {b}: jit tree differs from the reference ({verdict}: {why})\n"
        f"jit tokens {row['tokens'][:n]}\nref tokens {ref.tokens}\n"
        f"jit parents {row['parents'][:n]}\nref parents {ref.parents}"
    )


def brute_force_paths(draft_logits: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """All prefixes of the per-depth top-K, sorted by (-logw, ranks tuple), first `budget` kept."""
    depth_limit, vocab = draft_logits.shape
    k = min(budget, vocab)
    lp, _ = top_k_ranked(log_softmax_f32(draft_logits), k)
    keyed = []
    for length in range(1, depth_limit + 1):
        for path in itertools.product(range(k), repeat=length):
            logw = np.float32(0)
            for d, r in enumerate(path):
                logw = np.float32(logw + lp[d, r])
            keyed.append((-logw, path))
    keyed.sort()
    return [path for _, path in keyed[:budget]]


def tree_paths(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    row = row_arrays(tree, b)
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, row["num_nodes"]):
        paths.append(paths[row["parents"][i]] + (int(row["ranks"][i]),))
    return paths[1:]
