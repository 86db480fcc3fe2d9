"""Path-conditioned trees (`tree.conditional`): the heap reduces to DDTree's on marginal distributions, the jit
builder equals the heap on random conditional tables, every tree is the brute-force best prefix set, and bad
input is refused (eagerly) or marked (under jit)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.tree import build_tree, build_tree_reference
from ddtree_jax.tree.conditional import (
    build_conditional_tree,
    build_conditional_tree_reference,
    table_child_logits,
)
from ddtree_jax.tree.reference import log_softmax_f32


def _marginal_child_logits(draft_logits, parent_depth, parent_tokens):
    """A ChildLogitsFn that ignores the parent: every node at depth d gets the depth-(d + 1) marginal."""
    batch, parents = parent_tokens.shape
    return jnp.broadcast_to(draft_logits[:, parent_depth][:, None, :], (batch, parents, draft_logits.shape[-1]))


def _row_fields(tree, b):
    n = int(tree.num_nodes[b])
    return {name: np.asarray(getattr(tree, name)[b])[:n] for name in ("tokens", "parents", "depths", "ranks", "logw")}


def _assert_same(tree, b, ref):
    row = _row_fields(tree, b)
    assert len(row["tokens"]) == ref.num_nodes
    for name in ("tokens", "parents", "depths", "ranks"):
        np.testing.assert_array_equal(row[name], getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(row["logw"], ref.logw, rtol=1e-6, atol=1e-6)


def _random_table(rng, depth, vocab, scale, batch=None):
    shape = (depth - 1, vocab, vocab) if batch is None else (depth - 1, batch, vocab, vocab)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("depth,vocab,budget", [(4, 30, 12), (6, 200, 40), (3, 5, 64)])
def test_the_heap_on_marginals_is_ddtrees_heap(depth, vocab, budget):
    rng = np.random.default_rng(depth * vocab)
    logits = (rng.standard_normal((depth, vocab)) * 2.5).astype(np.float32)
    want = build_tree_reference(logits, budget, root_token=3)
    got = build_conditional_tree_reference(logits[0], lambda d, t: logits[d], budget, depth, root_token=3)
    for name in ("tokens", "parents", "depths", "ranks", "logw"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.paths == want.paths and got.frontier_logw == want.frontier_logw


def test_the_jit_builder_on_marginals_is_build_tree():
    rng = np.random.default_rng(11)
    batch, depth, vocab, budget = 4, 7, 300, 48
    logits = jnp.asarray(rng.standard_normal((batch, depth, vocab)) * 2, jnp.float32)
    roots = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got = build_conditional_tree(logits[:, 0], _marginal_child_logits, logits, budget, depth, roots)
    want = build_tree(logits, budget, roots, impl="xla")
    for name in ("tokens", "parents", "depths", "ranks", "num_nodes"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    # the log-softmax of a [B, P, V] broadcast rounds in its own order on the CPU: an ulp apart at most
    np.testing.assert_allclose(np.asarray(got.logw), np.asarray(want.logw), rtol=4e-7, atol=1e-7)
    assert got.max_depth == want.max_depth == depth


@pytest.mark.parametrize(
    "batch,depth,vocab,budget,scale",
    [(6, 5, 50, 20, 2.0), (4, 8, 120, 64, 3.0), (3, 3, 7, 40, 1.0), (2, 15, 64, 96, 2.5)],
)
def test_the_jit_builder_equals_the_heap_on_conditional_tables(batch, depth, vocab, budget, scale):
    _check_against_the_heap(batch, depth, vocab, budget, scale, impl="xla")


@pytest.mark.parametrize("batch,depth,vocab,budget,scale", [(3, 5, 50, 20, 2.0), (2, 4, 120, 64, 3.0)])
def test_the_kernel_top_k_builder_equals_the_heap(batch, depth, vocab, budget, scale):
    """impl="pallas" (the top-K kernel per parent list, interpret mode on CPU) builds the heap's tree too."""
    _check_against_the_heap(batch, depth, vocab, budget, scale, impl="pallas")


def _check_against_the_heap(batch, depth, vocab, budget, scale, impl):
    rng = np.random.default_rng(batch * 1000 + budget)
    first = (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)
    table = _random_table(rng, depth, vocab, scale, batch)  # each row its own conditional drafter
    roots = rng.integers(0, vocab, batch).astype(np.int32)
    tree = build_conditional_tree(
        jnp.asarray(first), table_child_logits, jnp.asarray(table), budget, depth, roots, impl=impl
    )
    exact = 0
    for b in range(batch):
        ref = build_conditional_tree_reference(
            first[b], lambda d, t, b=b: table[d - 1, b, t], budget, depth, root_token=int(roots[b])
        )
        if ref.has_near_tie():
            continue  # a float32 near-tie may be ordered either way (tree.compare); none expected at these scales
        _assert_same(tree, b, ref)
        exact += 1
    assert exact >= batch - 1, f"only {exact}/{batch} rows free of near-ties"


def test_a_conditional_tree_differs_from_the_marginal_one_and_follows_its_parents():
    """On a table whose children depend strongly on the parent, the tree's tokens are each parent's own top
    choices (not a shared marginal's) and every log-weight is the path's sum under the parents' distributions."""
    rng = np.random.default_rng(5)
    depth, vocab, budget = 4, 40, 30
    first = (rng.standard_normal(vocab) * 2).astype(np.float32)
    table = _random_table(rng, depth, vocab, 4.0)
    tree = build_conditional_tree(jnp.asarray(first)[None], table_child_logits, jnp.asarray(table), budget, depth)
    row = _row_fields(tree, 0)
    lp_first = log_softmax_f32(first[None])[0]
    for i in range(1, len(row["tokens"])):
        parent, token, d = row["parents"][i], row["tokens"][i], row["depths"][i]
        lp = lp_first if d == 1 else log_softmax_f32(table[d - 2, row["tokens"][parent]][None])[0]
        assert np.argsort(-lp, kind="stable")[row["ranks"][i]] == token
        np.testing.assert_allclose(row["logw"][i], row["logw"][parent] + lp[token], rtol=1e-5, atol=1e-5)
    # siblings under different parents at one depth come from different lists: not all the same token set
    marginal = build_tree_reference(np.stack([first, *table[:, 0]]), budget)
    assert set(map(tuple, zip(row["depths"], row["tokens"]))) != set(
        map(tuple, zip(marginal.depths.tolist(), marginal.tokens.tolist()))
    )


def test_every_tree_is_the_best_prefix_set_by_brute_force():
    """V = 3, L = 3: all 39 prefixes enumerated; the tree's nodes are the `budget` largest log-weights."""
    rng = np.random.default_rng(9)
    vocab, depth = 3, 3
    first = (rng.standard_normal(vocab) * 2).astype(np.float32)
    table = _random_table(rng, depth, vocab, 2.0)
    weights = {}
    for length in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=length):
            logw, parent_token = 0.0, None
            for d, token in enumerate(path):
                lp = log_softmax_f32((first if d == 0 else table[d - 1, parent_token])[None])[0]
                logw += float(lp[token])
                parent_token = token
            weights[path] = logw
    for budget in (5, 39):  # a cut inside the second level, and every prefix
        tree = build_conditional_tree(jnp.asarray(first)[None], table_child_logits, jnp.asarray(table), budget, depth)
        row = _row_fields(tree, 0)
        paths = []
        for i in range(1, len(row["tokens"])):
            path, node = [], i
            while node > 0:
                path.append(int(row["tokens"][node]))
                node = row["parents"][node]
            paths.append(tuple(reversed(path)))
        best = sorted(weights.values(), reverse=True)[:budget]
        np.testing.assert_allclose(sorted((weights[p] for p in paths), reverse=True), best, rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_invalid_rows_are_root_only_under_jit_and_minus_inf_is_valid(impl):
    rng = np.random.default_rng(3)
    depth, vocab, budget = 4, 20, 16
    first = rng.standard_normal((3, vocab)).astype(np.float32)
    table = _random_table(rng, depth, vocab, 1.0, batch=3)
    first[1, 4] = np.nan  # row 1: its first logits are invalid
    table[1, 2] = np.inf  # row 2: every depth-2 parent's children at depth 3 are invalid
    first[0, : vocab // 2] = -np.inf  # row 0: half the first tokens are impossible: valid
    tree = jax.jit(
        lambda f, t: build_conditional_tree(f, table_child_logits, t, budget, depth, jnp.asarray([1, 2, 3]), impl=impl)
    )(jnp.asarray(first), jnp.asarray(table))
    num_nodes = np.asarray(tree.num_nodes)
    assert num_nodes[1] == 1 and num_nodes[2] == 1  # marked: root-only, no plausible tokens
    assert (np.asarray(tree.tokens)[1:, 1:] == 0).all() and (np.asarray(tree.parents)[1:, 1:] == -1).all()
    row0 = _row_fields(tree, 0)
    assert num_nodes[0] == budget + 1
    assert not np.isin(row0["tokens"][row0["depths"] == 1], np.arange(vocab // 2)).any()


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(budget=0), "budget must be an integer >= 1, got 0"),
        (dict(budget=2**31), r"budget must be at most MAX_BUDGET = 1024 .*got 2147483648"),
        (dict(depth_limit=0), "depth_limit must be an integer >= 1, got 0"),
        (dict(first_logits=np.zeros((2, 3, 4), np.float32)), r"first_logits must have shape \[B, V\]"),
        (dict(first_logits=np.zeros((2, 4), np.int32)), "first_logits must be a float array"),
        (dict(root_tokens=np.zeros(3, np.int32)), r"root_tokens must have shape \[B\] = \(2,\)"),
        # eagerly as build_tree (were accepted: a NaN row became root-only with no error)
        (dict(first_logits=np.array([[0.0, np.nan, 0.0, 0.0], [0.0] * 4], np.float32)), "contain NaN/\\+inf"),
        (dict(root_tokens=np.array([1, -5], np.int32)), r"root_tokens\[1\] = -5 is outside the vocabulary"),
    ],
)
def test_the_jit_builder_refuses_bad_arguments(change, message):
    kwargs = dict(first_logits=np.zeros((2, 4), np.float32), budget=4, depth_limit=2, root_tokens=None)
    kwargs.update(change)
    table = jnp.zeros((max(kwargs["depth_limit"], 2) - 1, 4, 4))
    with pytest.raises(ValueError, match=message):
        build_conditional_tree(
            kwargs["first_logits"],
            table_child_logits,
            table,
            kwargs["budget"],
            kwargs["depth_limit"],
            kwargs["root_tokens"],
        )


def test_the_heap_refuses_bad_logits():
    first = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"child_logits\(1, 0\) has 4 entries, the first depth's logits 5"):
        build_conditional_tree_reference(first, lambda d, t: np.zeros(4, np.float32), 3, 2)
    with pytest.raises(ValueError, match=r"child_logits\(1, 0\) contain NaN/\+inf \(first at token 2\)"):
        build_conditional_tree_reference(first, lambda d, t: np.array([0, 0, np.nan, 0, 0], np.float32), 3, 2)
    with pytest.raises(ValueError, match="first_logits must be a non-empty"):
        build_conditional_tree_reference(np.zeros((2, 5)), lambda d, t: first, 3, 2)
