"""Shared checks for draft trees: invariants, and equality with the reference up to float32 near-ties."""

from __future__ import annotations

import itertools

import numpy as np

from ddtree_jax.tree import DraftTree, ReferenceTree
from ddtree_jax.tree.compare import compare_to_reference
from ddtree_jax.tree.reference import log_softmax_f32, top_k_ranked

def row_arrays(tree: DraftTree, b: int) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(getattr(tree, name)[b]) for name in ("tokens", "parents", "depths", "ranks", "logw")
    } | {"num_nodes": int(tree.num_nodes[b])}


def check_invariants(tree: DraftTree, b: int, top_lp: np.ndarray, top_ids: np.ndarray) -> None:
    """Structural facts every row must satisfy. top_lp/top_ids [L, K]: the builder's own selection."""
    row = row_arrays(tree, b)
    n, slots = row["num_nodes"], len(row["tokens"])
    assert 1 <= n <= slots
    assert row["parents"][0] == -1 and row["depths"][0] == 0 and row["ranks"][0] == -1 and row["logw"][0] == 0
    seen_children: dict[int, list[int]] = {}
    for i in range(1, n):
        p, d, r = row["parents"][i], row["depths"][i], row["ranks"][i]
        assert 0 <= p < i, f"slot {i}: parent {p} must be an earlier real slot"
        assert d == row["depths"][p] + 1 and 1 <= d <= tree.max_depth
        assert row["tokens"][i] == top_ids[d - 1, r]
        expected = np.float32(row["logw"][p] + top_lp[d - 1, r])
        # top_lp comes from a separate compilation, whose log-softmax may round differently (GPU)
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
    raise AssertionError(
        f"row {b}: jit tree differs from the reference ({verdict})\n"
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
