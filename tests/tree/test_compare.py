"""compare_to_reference excuses only swaps of near-tied nodes, and check_invariants checks tokens against
an independent top-K: trees with shifted tokens, parents moved to the root or a reversed tie-break fail."""

import numpy as np
import pytest

from ddtree_jax.tree import DraftTree, build_tree, build_tree_reference
from ddtree_jax.tree.compare import compare_to_reference, reference_has_near_tie
from tests.tree.tree_checks import check_invariants


def _tree(tokens, parents, depths, ranks, logw, slots, max_depth) -> DraftTree:
    """A one-row DraftTree from unpadded node arrays (slot 0 = root), padded to `slots`."""
    n = len(tokens)

    def pad(values, fill, dtype):
        out = np.full((1, slots), fill, dtype)
        out[0, :n] = values
        return out

    return DraftTree(
        pad(tokens, 0, np.int32),
        pad(parents, -1, np.int32),
        pad(depths, 0, np.int32),
        pad(ranks, -1, np.int32),
        pad(logw, -np.inf, np.float32),
        np.array([n], np.int32),
        max_depth,
    )


def _from_ref(ref, slots, max_depth, **over):
    fields = {name: np.array(getattr(ref, name)) for name in ("tokens", "parents", "depths", "ranks", "logw")}
    fields.update(over)
    return _tree(**fields, slots=slots, max_depth=max_depth)


def _near_tied_row(rng, depth=3, vocab=60):
    """Random logits whose depth-1 ranks 1 and 2 differ by 2e-6 (different logits, a float32 near-tie)."""
    logits = (rng.standard_normal((depth, vocab)) * 2).astype(np.float32)
    order = np.argsort(-logits[0], kind="stable")
    logits[0, order[2]] = logits[0, order[1]] - np.float32(2e-6)
    return logits


def test_near_tie_does_not_excuse_other_tokens_or_parents():
    logits = _near_tied_row(np.random.default_rng(0))
    budget = 12
    ref = build_tree_reference(logits, budget)
    assert reference_has_near_tie(ref)  # the old rule excused any tree with these log-weights here
    n, slots = ref.num_nodes, budget + 1
    assert compare_to_reference(build_tree(logits[None], budget), 0, ref) in ("exact", "near-tie")
    shifted = np.array(ref.tokens)
    shifted[1:] = (shifted[1:] + 1) % logits.shape[1]
    assert compare_to_reference(_from_ref(ref, slots, 3, tokens=shifted), 0, ref) == "mismatch"
    to_root = dict(parents=np.r_[-1, np.zeros(n - 1, np.int64)], depths=np.r_[0, np.ones(n - 1, np.int64)])
    assert compare_to_reference(_from_ref(ref, slots, 3, **to_root), 0, ref) == "mismatch"
    moved = np.array(ref.tokens)  # one deep node's token replaced by another top-K token of its depth
    i = int(np.argmax(ref.depths))
    d, r = int(ref.depths[i]), int(ref.ranks[i])
    moved[i] = ref.top_ids[d - 1, (r + 3) % ref.top_ids.shape[1]]
    assert compare_to_reference(_from_ref(ref, slots, 3, tokens=moved), 0, ref) == "mismatch"


def _fan_logits(tied: bool):
    """L = 1, V = 10: tokens 4 and 7 rank 3rd and 4th, with equal logits or 2e-6 apart."""
    logits = np.array([[0.0, 3.0, -1.0, 2.5, 1.0, -2.0, 0.5, 1.0, -3.0, -0.5]], np.float32)
    if not tied:
        logits[0, 7] = logits[0, 4] - np.float32(2e-6)
    return logits


def _fan_tree(tokens, logits, slots):
    lp = logits[0].astype(np.float64) - np.log(np.exp(logits[0].astype(np.float64)).sum())
    n = len(tokens) + 1
    return _tree(
        np.r_[0, tokens],
        np.r_[-1, np.zeros(n - 1)],
        np.r_[0, np.ones(n - 1)],
        np.arange(-1, n - 1),
        np.r_[0.0, lp[tokens]].astype(np.float32),
        slots,
        1,
    )


def test_a_near_tie_excuses_the_swap_of_the_near_tied_nodes_only():
    logits = _fan_logits(tied=False)
    ref = build_tree_reference(logits, 4)
    assert ref.tokens.tolist() == [0, 1, 3, 4, 7]
    assert compare_to_reference(_fan_tree([1, 3, 4, 7], logits, 5), 0, ref) == "exact"
    assert compare_to_reference(_fan_tree([1, 3, 7, 4], logits, 5), 0, ref) == "near-tie"  # the near-tied pair swapped
    assert compare_to_reference(_fan_tree([3, 1, 4, 7], logits, 5), 0, ref) == "mismatch"  # not near-tied
    assert compare_to_reference(_fan_tree([1, 3, 4, 6], logits, 5), 0, ref) == "mismatch"  # another token


def _cut_logits():
    """L = 2, V = 10: depth-1 token 2 first, its child 1, then its child 8 and the depth-1 token 6 within
    ~1e-6 of each other (different paths): with budget 3 the cut falls between those two."""
    logits = np.zeros((2, 10), np.float64)
    logits[0, 2], logits[1, 1], logits[1, 8] = 5.0, 3.0, 2.0
    lp = lambda row: row - np.log(np.exp(row).sum())  # noqa: E731
    lo, hi = -5.0, 5.0  # bisect token 6's depth-1 logit onto logw(2, 8)
    for _ in range(200):
        mid = (lo + hi) / 2
        logits[0, 6] = mid
        lo, hi = (mid, hi) if lp(logits[0])[6] < lp(logits[0])[2] + lp(logits[1])[8] else (lo, mid)
    logits[0, 6] = lo
    return logits.astype(np.float32)


def test_a_near_tie_at_the_cut_excuses_only_the_near_tied_node():
    logits = _cut_logits()
    ref = build_tree_reference(logits, 3)
    assert abs(float(ref.logw[-1]) - float(ref.frontier_logw)) < 1e-5
    lp, ids = ref.top_log_probs, ref.top_ids
    rank = lambda d, tok: int(np.flatnonzero(ids[d - 1] == tok)[0])  # noqa: E731
    nodes = {  # path -> (parent slot, depth, rank, logw)
        (2, 8): (1, 2, rank(2, 8), np.float32(lp[0, rank(1, 2)] + lp[1, rank(2, 8)])),
        (6,): (0, 1, rank(1, 6), lp[0, rank(1, 6)]),
        (0,): (0, 1, rank(1, 0), lp[0, rank(1, 0)]),
    }
    chosen = (2, 8) if ref.depths[-1] == 2 else (6,)
    other = (6,) if chosen == (2, 8) else (2, 8)
    assert ref.tokens[:3].tolist() == [0, 2, 1] and ref.tokens[-1] == chosen[-1]

    def with_last(path):
        parent, depth, r, w = nodes[path]
        return _tree(
            np.r_[ref.tokens[:3], path[-1]],
            np.r_[ref.parents[:3], parent],
            np.r_[ref.depths[:3], depth],
            np.r_[ref.ranks[:3], r],
            np.r_[ref.logw[:3], w],
            4,
            2,
        )

    assert compare_to_reference(with_last(chosen), 0, ref) == "exact"
    assert compare_to_reference(with_last(other), 0, ref) == "near-tie"  # the near-tied node across the cut
    assert compare_to_reference(with_last((0,)), 0, ref) == "mismatch"  # token 0 (rank 2) is far from the cut


def test_a_reversed_tie_break_is_rejected():
    """Equal logits: lower token id first, in every builder; a tree ranking 7 before 4 is wrong."""
    logits = _fan_logits(tied=True)
    ref = build_tree_reference(logits, 4)
    assert ref.tokens.tolist() == [0, 1, 3, 4, 7]
    reversed_tree = _fan_tree([1, 3, 7, 4], logits, 5)
    assert compare_to_reference(reversed_tree, 0, ref) == "mismatch"
    check_invariants(_fan_tree([1, 3, 4, 7], logits, 5), 0, logits)
    with pytest.raises(AssertionError, match="equal logits rank lower ids first"):
        check_invariants(reversed_tree, 0, logits)


def test_check_invariants_uses_an_independent_top_k():
    logits = _near_tied_row(np.random.default_rng(1))
    budget = 12
    tree = build_tree(logits[None], budget)
    check_invariants(tree, 0, logits)
    ref = build_tree_reference(logits, budget)
    shifted = np.array(ref.tokens)
    shifted[1:] = (shifted[1:] + 1) % logits.shape[1]
    with pytest.raises(AssertionError, match="the independent top-K has"):
        check_invariants(_from_ref(ref, budget + 1, 3, tokens=shifted), 0, logits)
    with pytest.raises(AssertionError, match="outside the top-1"):
        check_invariants(tree, 0, logits, k=1)
