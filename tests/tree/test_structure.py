"""positions, ancestor_mask and verification_order against direct Python definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.tree import ancestor_mask, build_tree, positions, verification_order


def _tree(seed, batch=3, depth=5, vocab=30, budget=24, scale=1.5):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, depth, vocab)) * scale).astype(np.float32)
    if batch > 1:
        logits[-1] = np.zeros_like(logits[-1])  # flat row: wide sibling groups (V = 30 ties)
    return build_tree(logits, budget)


def _children(parents, n, i):
    return [j for j in range(1, n) if parents[j] == i]


def _walk(next_token, next_sibling, i):
    out, cur = [], next_token[i]
    while cur != -1:
        out.append(int(cur))
        cur = next_sibling[cur]
    return out


def test_positions_are_start_plus_depth():
    tree = _tree(0)
    start = jnp.array([5, 0, 100], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(positions(tree, start)), np.asarray(start)[:, None] + np.asarray(tree.depths)
    )


def test_positions_takes_a_scalar_start_for_every_row():
    tree = _tree(0)
    for start in (7, np.int32(7), jnp.int32(7)):
        np.testing.assert_array_equal(np.asarray(positions(tree, start)), 7 + np.asarray(tree.depths))


@pytest.mark.parametrize(
    "start,message",
    [
        ([-5, 0, 3], r"start\[0\] = -5 is negative"),
        (jnp.array([4, 0, -1], jnp.int32), r"start\[2\] = -1 is negative"),
        (-2, r"start = -2 is negative"),
        (2**31 - 2, r"start = 2147483646 is too large: start \+ L \(the depth limit, 5\) must be <= 2147483647"),
        (np.array([0, 2**31 - 5, 0], np.int64), r"start\[1\] = 2147483643 is too large"),
        (2**70, r"start = 1180591620717411303424 is too large"),  # beyond int64: named, not an OverflowError
        ([1, 2], r"start must be a scalar or have shape \[B\] = \(3,\), got shape \(2,\)"),
        (np.zeros((3, 1), np.int32), r"shape \[B\] = \(3,\), got shape \(3, 1\)"),
        ([1.5, 2.0, 0.0], r"start must be integers .* got float64"),
    ],
)
def test_positions_refuses_a_bad_start(start, message):
    """Eagerly a start that is negative, whose deepest slot (start + L) would wrap int32, of the wrong shape or
    not integral raises ValueError naming the row and value (before: negative or wrapped positions, or a
    broadcasting TypeError)."""
    with pytest.raises(ValueError, match=message):
        positions(_tree(0), start)


def test_positions_at_the_int32_limit_and_under_jit():
    tree = _tree(0)
    top = 2**31 - 1 - tree.max_depth  # the largest start: the deepest slot lands on int32's maximum
    pos = np.asarray(positions(tree, [0, top, 5]))
    assert pos[1].min() == top and pos.max() <= 2**31 - 1
    # a traced start cannot be read: not checked (documented); the caller's cache lengths must obey the bounds
    got = jax.jit(positions)(tree, jnp.array([-5, 0, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got)[0], -5 + np.asarray(tree.depths)[0])


@pytest.mark.parametrize("fn", ["positions", "ancestor_mask", "verification_order"])
def test_structure_functions_refuse_a_plain_array_for_the_tree(fn):
    """A plain array (e.g. tree.parents) for the tree: ValueError naming the function and the type, not an
    AttributeError from deep inside."""
    tree = _tree(0)
    args = {"positions": (0,), "ancestor_mask": (), "verification_order": ("draft",)}[fn]
    call = {"positions": positions, "ancestor_mask": ancestor_mask, "verification_order": verification_order}[fn]
    with pytest.raises(ValueError, match=f"{fn} takes a DraftTree .* got ArrayImpl"):
        call(tree.parents, *args)
    with pytest.raises(ValueError, match=f"{fn} takes a DraftTree .* got ndarray"):
        call(np.asarray(tree.parents), *args)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_ancestor_mask_is_the_ancestor_closure(seed):
    tree = _tree(seed)
    mask = np.asarray(ancestor_mask(tree))
    parents = np.asarray(tree.parents)
    for b in range(tree.batch_size):
        expected = np.eye(tree.num_slots, dtype=bool)
        for i in range(tree.num_slots):
            j = parents[b, i]
            while j >= 0:
                expected[i, j] = True
                j = parents[b, j]
        np.testing.assert_array_equal(mask[b], expected)
    n = np.asarray(tree.num_nodes)
    for b in range(tree.batch_size):  # padding rows attend only to themselves
        assert (mask[b, n[b] :].sum(-1) == 1).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), order=st.sampled_from(["draft", "reverse", "random"]))
def test_each_order_lists_every_node_once_under_its_parent(seed, order):
    tree = _tree(seed)
    next_token, next_sibling = (np.asarray(a) for a in verification_order(tree, order, jax.random.key(seed)))
    parents, ranks, n = np.asarray(tree.parents), np.asarray(tree.ranks), np.asarray(tree.num_nodes)
    for b in range(tree.batch_size):
        listed = []
        for i in range(n[b]):
            kids = _walk(next_token[b], next_sibling[b], i)
            assert sorted(kids) == _children(parents[b], n[b], i)
            kid_ranks = [int(ranks[b, j]) for j in kids]
            if order == "draft":
                assert kid_ranks == sorted(kid_ranks)
            elif order == "reverse":
                assert kid_ranks == sorted(kid_ranks, reverse=True)
            listed += kids
        assert sorted(listed) == list(range(1, n[b]))  # every non-root node exactly once
        assert (next_token[b, n[b] :] == -1).all() and (next_sibling[b, n[b] :] == -1).all()


def test_random_order_is_keyed_and_per_row():
    tree = _tree(1, batch=4, budget=60)
    a = verification_order(tree, "random", jax.random.key(0))
    b = verification_order(tree, "random", jax.random.key(0))
    c = verification_order(tree, "random", jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert (np.asarray(a[0]) != np.asarray(c[0])).any() or (np.asarray(a[1]) != np.asarray(c[1])).any()
    # a row's permutation depends only on (key, row): the same rows in a smaller batch agree
    sub = jax.tree.map(lambda x: x[:2], tree)
    d = verification_order(sub, "random", jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a[0][:2]), np.asarray(d[0]))
    # the flat row's 30-wide sibling group is really shuffled
    fan = _walk(np.asarray(a[0][3]), np.asarray(a[1][3]), 0)
    assert fan != sorted(fan)


def test_order_validation():
    tree = _tree(2)
    with pytest.raises(ValueError, match="order must be one of"):
        verification_order(tree, "descending")
    with pytest.raises(ValueError, match="PRNG key"):
        verification_order(tree, "random")
