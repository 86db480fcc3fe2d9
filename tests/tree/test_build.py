"""build_tree (jit) against the faithful heap, brute-force optimality, ties, validation, the chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.tree import build_chain, build_tree, build_tree_reference, top_k_log_probs
from tests.tree.tree_checks import (
    assert_matches_reference,
    brute_force_paths,
    check_invariants,
    independent_ranking,
    row_arrays,
    tree_paths,
)


def _check_batch(draft_logits, budget, *, allow_near_ties=True, topk_impl="auto", roots=None, impl="auto"):
    tree = build_tree(draft_logits, budget, roots, topk_impl=topk_impl, impl=impl)
    host_logits = np.asarray(jnp.asarray(draft_logits, jnp.float32))
    exact = 0
    for b in range(draft_logits.shape[0]):
        check_invariants(tree, b, host_logits[b])
        ref = build_tree_reference(np.asarray(draft_logits[b]), budget, None if roots is None else int(roots[b]))
        exact += assert_matches_reference(tree, b, ref, allow_near_ties=allow_near_ties)
    return tree, exact


@pytest.mark.parametrize(
    "batch,depth,vocab,budget,scale",
    [(8, 15, 1000, 64, 2.0), (4, 6, 300, 256, 4.0), (6, 3, 40, 17, 1.0), (3, 15, 5000, 128, 3.0)],
)
def test_matches_reference_on_random_float32(batch, depth, vocab, budget, scale):
    rng = np.random.default_rng(1000 * depth + budget)
    logits = (rng.standard_normal((batch, depth, vocab)) * scale).astype(np.float32)
    roots = rng.integers(0, vocab, batch).astype(np.int32)
    _, exact = _check_batch(logits, budget, roots=roots)
    # near-ties within 1e-5 are rare at these scales: nearly every row must match bit for bit
    assert exact >= batch - 1, f"only {exact}/{batch} rows matched exactly"


@pytest.mark.parametrize("topk_impl", ["xla", "prefilter"])
def test_topk_impls_give_reference_tree(topk_impl):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((4, 5, 2051)) * 3).astype(np.float32)  # V not a multiple of any chunk
    _check_batch(logits, 48, topk_impl=topk_impl)
    _, ids = top_k_log_probs(jnp.asarray(logits), 48, impl=topk_impl)  # the builder's selection, independently
    np.testing.assert_array_equal(np.asarray(ids), independent_ranking(logits)[..., :48])


def test_vocab_smaller_than_budget_pads():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 3, 2)).astype(np.float32)
    tree, _ = _check_batch(logits, 64)
    assert (np.asarray(tree.num_nodes) == 1 + 2 + 4 + 8).all()  # every prefix fits: 14 nodes + root


def test_a_huge_budget_is_refused_before_anything_is_allocated():
    """The audit's case: budget 2^31 on [2, 3, 16] logits used > 20 GB before being killed. Above MAX_BUDGET (the
    engine's --budget limit too): ValueError at once, eagerly and under jit (the budget is static)."""
    from ddtree_jax.options import MAX_BUDGET  # the engine's --budget limit too (options.check_options)

    assert MAX_BUDGET == 1024
    logits = np.zeros((2, 3, 16), np.float32)
    for budget in (2**31, 2**31 - 1, np.int64(2**40), MAX_BUDGET + 1):
        with pytest.raises(ValueError, match=f"budget must be at most MAX_BUDGET = 1024.*got {budget}"):
            build_tree(logits, budget)
    with pytest.raises(ValueError, match="got 1025"):
        jax.jit(lambda x: build_tree(x, MAX_BUDGET + 1))(logits)
    assert int(build_tree(np.zeros((1, 4, 1), np.float32), MAX_BUDGET).num_nodes[0]) == 5  # V = 1: a padded chain


def test_budget_one_and_depth_one():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 1, 50)).astype(np.float32)
    tree, exact = _check_batch(logits, 1)
    assert exact == 5
    assert (np.asarray(tree.tokens[:, 1]) == logits[:, 0].argmax(-1)).all()
    tree, exact = _check_batch(logits, 20)  # L = 1: the tree is the top-20 fan
    assert exact == 5 and (np.asarray(tree.depths[:, 1:]) == 1).all()


SIDON = np.array([0.0, 1.0, 3.0, 7.0, 15.0])  # pairwise sums distinct: ties only from equal values / commutation


@pytest.mark.parametrize("depth", [1, 2])
def test_bf16_exact_ties_match_exactly(depth):
    """Many equal logits per row (bf16): lower token id first, bit-exact agreement with the heap."""
    rng = np.random.default_rng(4)
    row = rng.choice(SIDON, size=(6, 1, 64)) * 0.5
    logits = jnp.asarray(np.repeat(row, depth, axis=1), dtype=jnp.bfloat16)
    for budget in (5, 40):
        _, exact = _check_batch(logits, budget, allow_near_ties=False)
        assert exact == 6


def test_bf16_deep_trees_with_ties():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.integers(-4, 5, size=(6, 15, 3000)) * 0.75, dtype=jnp.bfloat16)
    _check_batch(logits, 96)


@pytest.mark.parametrize("kind", ["near_flat", "near_one_hot"])
def test_near_flat_and_near_one_hot_rows(kind):
    rng = np.random.default_rng(6)
    noise = rng.standard_normal((6, 8, 700)).astype(np.float32)
    if kind == "near_flat":
        logits = noise * 1e-3
    else:
        logits = noise.copy()
        logits[np.arange(6)[:, None], np.arange(8)[None, :], rng.integers(0, 700, (6, 8))] = 40.0
    tree, _ = _check_batch(logits, 64)
    if kind == "near_one_hot":  # the chain of argmax tokens comes first, every depth
        chain = build_chain(logits)
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, :9]), np.asarray(chain.tokens))


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 1.5, 3.0]), min_size=12, max_size=12),
    noise_seed=st.integers(0, 2**31 - 1),
    budget=st.sampled_from([1, 5, 20, 84]),
    jitter=st.booleans(),
)
def test_node_set_is_the_optimal_top_budget_set(values, noise_seed, budget, jitter):
    """Brute force over every prefix (L = 3, V = 4): the tree is the top-`budget` set in heap order."""
    logits = np.array(values, dtype=np.float32).reshape(3, 4)
    if jitter:
        logits = logits + np.random.default_rng(noise_seed).standard_normal((3, 4)).astype(np.float32)
    expected = brute_force_paths(logits, budget)
    ref = build_tree_reference(logits, budget)
    assert list(ref.paths[1:]) == expected  # the reference heap is the objective's optimum, in order
    tree = build_tree(logits[None], budget)
    got = tree_paths(tree, 0)
    if got != expected:  # allowed only as a swap of float32 near-ties
        assert_matches_reference(tree, 0, ref, allow_near_ties=True)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.01, 1.0, 5.0, 30.0]), bf16=st.booleans())
def test_invariants_hold_for_any_logits(seed, scale, bf16):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((2, 5, 97)) * scale).astype(np.float32)
    if bf16:
        logits = jnp.asarray(logits, jnp.bfloat16)
    _check_batch(logits, 33)


def test_rows_are_independent():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((4, 6, 500)) * 2).astype(np.float32)
    full = build_tree(logits, 32)
    alone = build_tree(logits[2:3], 32)
    for name in ("tokens", "parents", "depths", "ranks", "logw"):
        np.testing.assert_array_equal(np.asarray(getattr(full, name)[2]), np.asarray(getattr(alone, name)[0]))


def test_validation_errors_name_the_bad_value():
    good = np.zeros((1, 2, 8), np.float32) + np.arange(8, dtype=np.float32)
    for bad_budget in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="budget"):
            build_tree(good, bad_budget)
    with pytest.raises(ValueError, match=r"\[B, L, V\].*\(2, 8\)"):
        build_tree(good[0], 4)
    with pytest.raises(ValueError, match="float"):
        build_tree(good.astype(np.int32), 4)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(good, 4, jnp.zeros((3,), jnp.int32))
    for bad in (np.nan, np.inf):  # -inf is a valid logit (tests/tree/test_masked_logits.py)
        logits = good.copy()
        logits[0, 1, 5] = bad
        with pytest.raises(ValueError, match=r"NaN/\+inf.*depth index 1, token 5"):
            build_tree(logits, 4)
        with pytest.raises(ValueError, match=r"NaN/\+inf.*depth index 1, token 5"):
            build_chain(logits)
        with pytest.raises(ValueError, match=r"NaN/\+inf"):
            build_tree_reference(logits[0], 4)
    with pytest.raises(ValueError, match="budget"):
        build_tree_reference(good[0], 0)
    with pytest.raises(ValueError, match="budget must be an integer >= 1, got True"):
        build_tree_reference(good[0], True)
    for empty in (np.zeros((0, 5), np.float32), np.zeros((3, 0), np.float32)):  # L = 0, V = 0
        with pytest.raises(ValueError, match=r"non-empty .* got shape \((0, 5|3, 0)\)"):
            build_tree_reference(empty, 4)
    with pytest.raises(ValueError, match="float array .* got int64"):  # the caller's dtype, not jnp's int32
        build_tree(np.zeros((1, 2, 8), np.int64), 4)
    with pytest.raises(ValueError, match="float array, got int64"):
        build_tree_reference(np.zeros((2, 8), np.int64), 4)
    as_list = build_tree(good.tolist(), 4)  # a nested list is an array-like like any other
    np.testing.assert_array_equal(np.asarray(as_list.tokens), np.asarray(build_tree(good, 4).tokens))


def test_non_finite_row_under_jit_gives_root_only_tree():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((3, 4, 50)).astype(np.float32)
    logits[1, 2, 7] = np.nan
    tree = jax.jit(lambda x: build_tree(x, 10))(logits)
    assert list(np.asarray(tree.num_nodes)) == [11, 1, 11]
    row = row_arrays(tree, 1)
    assert (row["parents"][1:] == -1).all() and np.isneginf(row["logw"][1:]).all()


@pytest.mark.parametrize(
    "shape,budget,kind",
    [
        ((3, 15, 1000, 64), 64, "normal"),
        ((4, 6, 300, 256), 256, "normal"),
        ((6, 2, 64, 40), 40, "bf16_ties"),
        ((4, 5, 40, 33), 33, "dead"),
        ((2, 2, 20000, 8), 8, "normal"),  # V > MAX_ROW: the prefilter, or the chunked top-K (tree_topk_logits_chunked)
        ((2, 3, 20000, 64), 64, "dead"),  # ... with dead depths and half -inf rows
        ((1, 2, 20000, 16), 16, "bf16_ties"),  # ... with exact ties across chunks
    ],
)
@pytest.mark.parametrize("chunked", [False, True])
def test_pallas_builder_matches_the_heap_and_the_xla_builder(shape, budget, kind, chunked, monkeypatch):
    """impl="pallas" (the tree_build kernels; interpreted on CPU): the heap's tree, and the XLA builder's
    slots bit for bit. The kernel computes its own log-softmax (`tree_topk_logits`), whose log-normaliser
    may differ from XLA's by an ulp: the tree's structure must be identical, its log-weights equal up to
    those ulps (one per depth on the path)."""
    batch, depth, vocab, _ = shape
    if chunked and vocab <= 16384:
        pytest.skip("the chunked top-K is for rows longer than the kernel's")
    from ddtree_jax import dispatch
    from ddtree_jax.tree import build as build_module

    # V > MAX_ROW: the chunked top-K or the prefilter. The flag is read while tracing, so compiled builders of the
    # other setting are dropped, and a spy checks which path ran
    monkeypatch.setattr(dispatch, "AUTO_TREE_TOPK_CHUNKED", chunked)
    build_module.build_tree_unchecked.clear_cache()  # this builder only: clearing every cache slows the suite
    chunked_calls = []
    real_chunked = build_module.tree_topk_logits_chunked
    monkeypatch.setattr(
        build_module,
        "tree_topk_logits_chunked",
        lambda *a, **kw: chunked_calls.append(1) or real_chunked(*a, **kw),
    )
    rng = np.random.default_rng(vocab + budget)
    if kind == "bf16_ties":
        logits = jnp.asarray(rng.choice(SIDON, size=(batch, depth, vocab)) * 0.5, jnp.bfloat16)
    else:
        logits = (rng.standard_normal((batch, depth, vocab)) * 3).astype(np.float32)
        if kind == "dead":
            logits[0, 2] = -np.inf
            logits[1, 0, : vocab // 2] = -np.inf
    tree, _ = _check_batch(logits, budget, impl="pallas", allow_near_ties=kind != "bf16_ties")
    assert bool(chunked_calls) == (chunked and vocab > 16384)
    xla = build_tree(logits, budget, impl="xla")
    if vocab > 16384:  # different top-K code paths: the same trees up to near-ties (checked above)
        return
    for name in ("tokens", "parents", "depths", "ranks", "num_nodes"):
        np.testing.assert_array_equal(np.asarray(getattr(tree, name)), np.asarray(getattr(xla, name)), err_msg=name)
    got, want = np.asarray(tree.logw), np.asarray(xla.logw)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    ulps = depth * np.spacing(np.float32(np.log(vocab) + 1.0))  # an ulp of each depth's log-normaliser
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6, atol=4 * ulps)


def test_pallas_builder_under_jit_gives_a_non_finite_row_a_root_only_tree():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 4, 50)).astype(np.float32)
    logits[1, 2, 7] = np.inf
    tree = jax.jit(lambda x: build_tree(x, 10, impl="pallas", check_finite=False))(logits)
    assert list(np.asarray(tree.num_nodes)) == [11, 1, 11]
    with pytest.raises(ValueError, match="impl must be one of"):
        build_tree(np.zeros((1, 2, 8), np.float32), 4, impl="triton")


def test_chain_is_top1_per_depth():
    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((3, 7, 300)) * 2).astype(np.float32)
    logits[0, 3, 10] = logits[0, 3, 20] = 50.0  # exact tie: lower id wins
    roots = jnp.array([4, 5, 6], jnp.int32)
    chain = build_chain(logits, roots)
    tokens = np.asarray(chain.tokens)
    assert tokens[0, 4] == 10
    np.testing.assert_array_equal(tokens[:, 0], [4, 5, 6])
    np.testing.assert_array_equal(tokens[:, 1:], logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(chain.parents[0]), np.arange(-1, 7))
    np.testing.assert_array_equal(np.asarray(chain.num_nodes), [8, 8, 8])
    for b in range(3):
        check_invariants(chain, b, logits[b], k=1)
    # the chain is not build_tree(budget = L), which branches where siblings beat deep nodes
    tree = build_tree(logits, 7)
    assert (np.asarray(tree.depths) != np.asarray(chain.depths)).any()


def test_compare_to_reference_catches_a_wrong_tree():
    """The comparison the tests rely on must fail on a real difference (no near-tie in this input)."""
    from ddtree_jax.tree.compare import compare_to_reference

    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((1, 4, 100)) * 3).astype(np.float32)
    tree = build_tree(logits, 12)
    ref = build_tree_reference(logits[0], 12)
    assert compare_to_reference(tree, 0, ref) == "exact"
    wrong = tree.tokens.at[0, 5].set((tree.tokens[0, 5] + 1) % 100)
    assert (
        compare_to_reference(
            jax.tree.map(
                lambda x: x,
                tree.__class__(wrong, tree.parents, tree.depths, tree.ranks, tree.logw, tree.num_nodes, tree.max_depth),
            ),
            0,
            ref,
        )
        == "mismatch"
    )
    short = build_tree(logits, 11)
    assert compare_to_reference(short, 0, ref) == "mismatch"
