"""-inf draft logits (masked / padded vocabulary entries): probability 0, never in the tree, never a
reason to degrade the row; an all -inf depth has no candidates; NaN / +inf still make a row invalid."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ddtree_jax.tree import build_chain, build_tree, build_tree_reference
from tests.tree.tree_checks import assert_matches_reference, check_invariants, row_arrays


def _masked_logits(seed=0, batch=3, depth=4, vocab=40, masked=0.5):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, depth, vocab)) * 2).astype(np.float32)
    logits[rng.random(logits.shape) < masked] = -np.inf
    logits[:, :, 0] = np.maximum(logits[:, :, 0], -5.0)  # at least one finite entry per depth
    return logits


@pytest.mark.parametrize("topk_impl", ["xla", "prefilter"])
@pytest.mark.parametrize("jit", [False, True])
def test_masked_tokens_never_enter_the_tree_and_match_the_reference(topk_impl, jit):
    logits = _masked_logits()
    build = lambda x: build_tree(x, 30, topk_impl=topk_impl)  # noqa: E731
    tree = jax.jit(build)(logits) if jit else build(logits)
    for b in range(logits.shape[0]):
        row = row_arrays(tree, b)
        n = row["num_nodes"]
        assert n > 1  # not degraded to root-only
        depths, tokens = row["depths"][1:n], row["tokens"][1:n]
        assert np.isfinite(logits[b, depths - 1, tokens]).all()
        check_invariants(tree, b, logits[b])
        assert_matches_reference(tree, b, build_tree_reference(logits[b], 30))


def test_one_masked_entry_keeps_the_full_tree():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 3, 50)).astype(np.float32)
    logits[1, 1, 7] = -np.inf
    for tree in (build_tree(logits, 10), jax.jit(lambda x: build_tree(x, 10))(logits)):
        assert list(np.asarray(tree.num_nodes)) == [11, 11]
        row = row_arrays(tree, 1)
        assert not ((row["depths"] == 2) & (row["tokens"] == 7)).any()


def test_fewer_finite_tokens_than_budget_pads():
    logits = np.full((1, 1, 20), -np.inf, np.float32)
    logits[0, 0, [3, 11, 17]] = [1.0, 2.0, 0.5]
    tree = build_tree(logits, 8)
    row = row_arrays(tree, 0)
    assert row["num_nodes"] == 4
    assert row["tokens"][1:4].tolist() == [11, 3, 17]
    check_invariants(tree, 0, logits[0])
    assert build_tree_reference(logits[0], 8).tokens.tolist() == [0, 11, 3, 17]


@pytest.mark.parametrize("dead_depth", [0, 2])
def test_all_masked_depth_has_no_candidates(dead_depth):
    logits = _masked_logits(seed=2, batch=2, masked=0.3)
    logits[1, dead_depth] = -np.inf
    for tree in (build_tree(logits, 20), jax.jit(lambda x: build_tree(x, 20))(logits)):
        row = row_arrays(tree, 1)
        n = row["num_nodes"]
        assert n == 1 + (0 if dead_depth == 0 else 20)
        assert (row["depths"][1:n] <= dead_depth).all()
        check_invariants(tree, 1, logits[1])
        assert_matches_reference(tree, 1, build_tree_reference(logits[1], 20))
        assert row_arrays(tree, 0)["num_nodes"] == 21  # the other row is unaffected
    chain = build_chain(logits)
    assert list(np.asarray(chain.num_nodes)) == [5, 1 + dead_depth]
    check_invariants(chain, 1, logits[1], k=1)


def test_chain_skips_masked_tokens():
    logits = np.zeros((1, 3, 6), np.float32)
    logits[0, :, 2] = 5.0
    logits[0, 1, 2] = -np.inf  # the top token at depth 2 is masked: the next best (ties: lowest id)
    for chain in (build_chain(logits), jax.jit(build_chain)(logits)):
        assert np.asarray(chain.tokens[0]).tolist() == [0, 2, 0, 2]
        assert int(chain.num_nodes[0]) == 4


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_still_invalidate_the_row(bad):
    logits = _masked_logits(seed=3)
    logits[1, 2, 9] = bad
    with pytest.raises(ValueError, match=r"NaN/\+inf"):
        build_tree(logits, 10)
    tree = jax.jit(lambda x: build_tree(x, 10))(logits)
    assert int(tree.num_nodes[1]) == 1 and int(tree.num_nodes[0]) == 11
    chain = jax.jit(build_chain)(logits)
    assert list(np.asarray(chain.num_nodes)) == [5, 1, 5]


@pytest.mark.parametrize("root", [50, -1])
def test_root_tokens_outside_the_vocabulary_raise(root):
    logits = _masked_logits(seed=4, batch=2, vocab=50)
    roots = np.array([3, root], np.int32)
    with pytest.raises(ValueError, match=rf"root_tokens\[1\] = {root} is outside the vocabulary \[0, V=50\)"):
        build_tree(logits, 5, roots)
    with pytest.raises(ValueError, match=r"root_tokens\[1\]"):
        build_chain(logits, roots)
