"""ddtree_kernels/tree_sampling.py (interpret mode on CPU) against its references.

Row statistics against the sorting reference; mode (a) (processed probabilities) against
`verify_sampling` coin for coin; mode (b) (fused from logits) against
`verify_sampling(processed_probs(logits))`. The kernels reduce in another order than XLA, so a row
may disagree only where a decision sits within float32 rounding of its boundary: the tests require
>= 99.9% of rows to agree and check each disagreement with the float64 oracle of tests/kernels/margins.py.
Then the walk's boundary cases, large vocabularies, mixed greedy/sampled batches, `verify_step(impl=
"pallas")` and the output law through the fused path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import COIN_MAX, COIN_MIN, SamplingParams, processed_probs
from ddtree_jax.sampling.probs import INVALID_TOKEN
from ddtree_jax.tree import build_tree, verification_order
from ddtree_jax.verify import VerifyResult, verify_greedy, verify_sampling, verify_step
from ddtree_kernels import tree_sampling
from ddtree_kernels.tree_sampling import (
    logit_key,
    params_rows,
    row_stats,
    row_stats_reference,
    tree_sampling_from_probs_reference,
)
from tests.kernels.margins import row_margin
from tests.verify.test_verify_sampling import (
    EX_CAND,
    EX_NEXT,
    EX_SIB,
    WORKED_EXAMPLE_CASES,
    _follow_some_children,
    _worked_example_probs,
)


def tree_sampling_from_probs(*args, **kwargs) -> VerifyResult:
    """The kernel's arrays as the library's result type (what `verify_sampling(impl="pallas")` does)."""
    return VerifyResult(*tree_sampling.tree_sampling_from_probs(*args, **kwargs))


def _with_rows(kernel, candidates, next_token, next_sibling, logits, params, *rest, **kwargs):
    *arrays, valid = kernel(candidates, next_token, next_sibling, logits, params.as_rows(), *rest, **kwargs)
    return VerifyResult(*arrays), valid


def tree_sampling_from_logits(*args, **kwargs):
    """(VerifyResult, valid) from SamplingParams, as `verify_step(impl="pallas")` calls the kernel."""
    return _with_rows(tree_sampling.tree_sampling_from_logits, *args, **kwargs)


def tree_sampling_from_logits_reference(*args, **kwargs):
    return _with_rows(tree_sampling.tree_sampling_from_logits_reference, *args, **kwargs)


MARGIN_TOL = 1e-5  # float32 sums over up to V = 163840 values: disagreements beyond this are bugs


def _random_params(rng, batch):
    return SamplingParams.create(
        batch,
        temperature=rng.choice([0.0, 0.6, 1.0, 1.7], batch),
        top_k=rng.choice([0, 1, 3, 40], batch),
        top_p=rng.choice([1.0, 0.95, 0.6], batch),
        min_p=rng.choice([0.0, 0.02, 0.2], batch),
    )


def _inputs(seed, batch, depth, vocab, budget, dtype=jnp.float32, order="draft", scale=2.0):
    rng = np.random.default_rng(seed)
    tree = build_tree(
        (rng.standard_normal((batch, depth, vocab)) * 2).astype(np.float32),
        budget,
        rng.integers(0, vocab, batch).astype(np.int32),
    )
    nxt, sib = verification_order(tree, order, jax.random.key(seed))
    target = jnp.asarray(rng.standard_normal((batch, budget + 1, vocab)) * scale, jnp.float32)
    target = _follow_some_children(tree, nxt, sib, target, rng).astype(dtype)
    coins = np.clip(rng.random((batch, budget + 1)).astype(np.float32), COIN_MIN, COIN_MAX)
    final = np.clip(rng.random(batch).astype(np.float32), COIN_MIN, COIN_MAX)
    return tree, nxt, sib, target, coins, final, rng


def _assert_agreement(got, ref, explain, min_share=0.999):
    """>= min_share of rows identical; every other row explained by `explain(b)` (a margin)."""
    same = np.ones(got.tokens.shape[0], bool)
    for name in ("accept_index", "num_accepted", "tokens"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(ref, name))
        same &= (a == b).reshape(a.shape[0], -1).all(axis=1)
    assert same.mean() >= min_share, f"only {same.mean():.4%} of rows agree"
    for b in np.flatnonzero(~same):
        margin = explain(b)
        assert margin < MARGIN_TOL, f"row {b} disagrees with decision margin {margin:.3g}"
    return same


def _row_margins(tree, nxt, sib, target, coins, final, depth, params):
    """explain(b) for `_assert_agreement`: row b's float64 decision margin (`row_margin`) under params, a
    SamplingParams (row b's settings) or one (temperature, top_k, top_p, min_p) for every row."""
    t = np.asarray(target.astype(jnp.float32))
    if isinstance(params, SamplingParams):
        pr = [np.asarray(a) for a in (params.temperature, params.top_k, params.top_p, params.min_p)]
        params_of_row = lambda b: [v[b] for v in pr]
    else:
        params_of_row = lambda b: params
    return lambda b: row_margin(
        np.asarray(tree.tokens[b]),
        np.asarray(nxt[b]),
        np.asarray(sib[b]),
        t[b],
        params_of_row(b),
        coins[b],
        final[b],
        depth,
    )


# --- row statistics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "single streamed", "spans"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_stats_match_the_sorting_reference(dtype, layout):
    """Both layouts (one program per row, the row in registers (V <= the default stats_block) or, "single
    streamed", loaded in 256-element chunks; a (row, span) grid with XLA combines) against the sorting reference, on rows with masked tokens,
    ties at the cut, NaN / inf / all -inf rows and flat rows."""
    rng = np.random.default_rng(7)
    rows, vocab = 40, 700
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    x[3, rng.integers(0, vocab, 50)] = -np.inf  # masked tokens
    x[4] = np.round(x[4])  # many exact ties
    x[5, 17] = np.nan
    x[6] = -np.inf
    x[7, 9] = np.inf
    x[8] = x[8] * 1e-3 - 50.0  # all logits negative, nearly flat
    p = np.stack(
        [
            rng.choice([0.0, 0.5, 1.0, 3.0], rows),
            rng.choice([0, 1, 2, 50, 699, 700, 5000], rows),
            rng.choice([1.0, 0.99, 0.7, 0.05], rows),
            rng.choice([0.0, 0.01, 0.3], rows),
        ],
        axis=1,
    ).astype(np.float32)
    p[4] = [1.0, 0, 0.5, 0]  # ties at the top-p cut
    logits = jnp.asarray(x, dtype)
    if layout == "single streamed":
        got = row_stats(logits, jnp.asarray(p), layout="single", tiling=tree_sampling.SingleTiling(stats_block=256))
    else:
        got = row_stats(logits, jnp.asarray(p), layout=layout)
    ref = row_stats_reference(logits, jnp.asarray(p))
    for name in ("valid", "argmax", "max", "cut", "min_e"):
        valid = np.asarray(ref["valid"]).astype(bool)
        np.testing.assert_array_equal(np.asarray(got[name])[valid], np.asarray(ref[name])[valid], err_msg=name)
    np.testing.assert_array_equal(np.asarray(got["valid"]), [0 if r in (5, 6, 7) else 1 for r in range(rows)])
    valid = np.asarray(ref["valid"]).astype(bool)
    np.testing.assert_allclose(np.asarray(got["z"])[valid], np.asarray(ref["z"])[valid], rtol=2e-6)


def test_single_layout_tilings_give_the_same_statistics():
    """The single layout's tiling (warps, search loads, the row in registers or streamed; `SingleTiling`)
    changes the reduction order only: the same cut, argmax and validity, Z within float32 rounding, at a
    vocabulary no load size divides."""
    rng = np.random.default_rng(3)
    rows, vocab = 12, 3000
    x = jnp.asarray(rng.standard_normal((rows, vocab)) * 3, jnp.float32)
    p = jnp.asarray(
        np.stack(
            [np.full(rows, 1.0), rng.choice([0, 5, 100], rows), rng.choice([1.0, 0.9, 0.5], rows), np.zeros(rows)], 1
        ),
        jnp.float32,
    )
    base = row_stats(x, p, layout="single")
    for tiling in (
        tree_sampling.SingleTiling(warps=8, search_block=1024, stats_block=1024),  # streamed, 16 thresholds a pass
        tree_sampling.SingleTiling(stats_block=512),
        tree_sampling.SingleTiling(stats_block=4096),  # the row in registers: the cuts by bisection
    ):
        other = row_stats(x, p, layout="single", tiling=tiling)
        for name in ("cut", "argmax", "valid", "max"):
            np.testing.assert_array_equal(np.asarray(other[name]), np.asarray(base[name]), err_msg=name)
        np.testing.assert_allclose(np.asarray(other["z"]), np.asarray(base["z"]), rtol=2e-6)
    with pytest.raises(ValueError, match="SingleTiling needs"):
        tree_sampling.SingleTiling(warps=3)


def test_logit_key_orders_like_the_floats():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000), [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45]]
    ).astype(np.float32)
    key = np.asarray(logit_key(jnp.asarray(x), 0))
    order = np.argsort(x, kind="stable")
    assert (np.diff(key[order]) >= 0).all()
    assert key[np.flatnonzero(x == 0)].tolist() == [key[np.flatnonzero(x == 0)][0]] * 2  # -0.0 == +0.0
    xb = jnp.asarray(x, jnp.bfloat16)
    kb = np.asarray(logit_key(xb, 16))
    xb32 = np.asarray(xb.astype(jnp.float32))
    i, j = rng.integers(0, len(x), (2, 5000))
    assert (np.sign(kb[i].astype(np.int64) - kb[j]) == (xb32[i] > xb32[j]).astype(int) - (xb32[i] < xb32[j])).all()


# --- mode (a): from processed probabilities -------------------------------------------------------------------


@pytest.mark.parametrize("order, layout", [("draft", "single"), ("random", "spans")])
def test_from_probs_agrees_with_verify_sampling(order, layout):
    batch, depth, vocab, budget = 192, 4, 1000, 20
    tree, nxt, sib, target, coins, final, rng = _inputs(1, batch, depth, vocab, budget, order=order)
    params = _random_params(rng, batch)
    probs = processed_probs(target, params)
    got = tree_sampling_from_probs(tree.tokens, nxt, sib, probs, coins, final, max_accept=depth, layout=layout)
    ref = verify_sampling(tree.tokens, nxt, sib, probs, coins, final, max_accept=depth)
    # the walk reads the same float32 values in the same order: acceptance is bit-identical
    np.testing.assert_array_equal(np.asarray(got.accept_index), np.asarray(ref.accept_index))
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(ref.num_accepted))
    assert float(np.asarray(ref.num_accepted).mean()) > 0.5  # deep walks are exercised
    _assert_agreement(got, ref, _row_margins(tree, nxt, sib, target, coins, final, depth, params))


def test_from_probs_worked_example_and_verify_sampling_dispatch():
    for (coins, final), (accept, n_acc, tokens) in WORKED_EXAMPLE_CASES:  # each coin's outcome, derived by hand
        res = verify_sampling(
            EX_CAND,
            EX_NEXT,
            EX_SIB,
            _worked_example_probs(),
            coins,
            np.array([final], np.float32),
            max_accept=3,
            impl="pallas",
        )
        assert np.asarray(res.accept_index).tolist() == [accept]
        assert np.asarray(res.num_accepted).tolist() == [n_acc]
        assert np.asarray(res.tokens).tolist() == [tokens]


def _fan(probs_row, coin, final_coin=0.5, vocab=None):
    """Root with children = tokens 0..C-1 in order, through mode (a); returns (n_acc, first token)."""
    c = len(probs_row)
    vocab = vocab or c
    cand = np.concatenate([[0], np.arange(c)]).astype(np.int32)[None]
    nxt = np.full((1, c + 1), -1, np.int32)
    nxt[0, 0] = 1
    sib = np.full((1, c + 1), -1, np.int32)
    sib[0, 1:c] = np.arange(2, c + 1)
    probs = np.zeros((1, c + 1, vocab), np.float32)
    probs[0, 0, :c] = probs_row
    probs[0, 1:] = 1.0 / vocab
    res = tree_sampling_from_probs(
        cand, nxt, sib, probs, np.full((1, c + 1), coin, np.float32), np.array([final_coin], np.float32), max_accept=1
    )
    return int(res.num_accepted[0]), int(res.tokens[0, 0])


def test_spec_boundary_cases():
    assert _fan(np.array([0.25, 0.75], np.float32), coin=0.25) == (1, 1)  # strict <: next bucket
    assert _fan(np.array([0.25, 0.75], np.float32), coin=float(np.nextafter(np.float32(0.25), np.float32(0)))) == (1, 0)
    assert _fan(np.array([0.0, 1.0, 0.0], np.float32), coin=COIN_MIN)[1] == 1  # zero-probability first child
    assert _fan(np.array([0.0, 0.0, 1.0], np.float32), coin=COIN_MAX)[1] == 2
    third = np.float32(0.3333333)  # sums to 0.9999999 < the largest coin: residual empty
    assert _fan(np.array([third] * 3, np.float32), coin=COIN_MAX, final_coin=COIN_MAX) == (0, 2)
    res = tree_sampling_from_probs(
        EX_CAND,
        EX_NEXT,
        EX_SIB,
        np.zeros((1, 6, 7), np.float32),
        np.full((1, 6), 0.5, np.float32),
        np.array([0.5], np.float32),
        max_accept=3,
    )
    assert int(res.tokens[0, 0]) == 6  # no mass anywhere: V - 1
    # the final sample scans more than one chunk (V > the kernel's block) and never emits a zero-mass id
    vocab = 8193
    row = np.zeros(vocab, np.float32)
    row[[5, 4097, 8192]] = [0.2, 0.3, 0.5]
    for final_coin, want in ((COIN_MIN, 5), (0.2, 4097), (0.49, 4097), (0.5, 8192), (COIN_MAX, 8192)):
        probs = np.zeros((1, 2, vocab), np.float32)
        probs[0, 0] = row
        res = tree_sampling_from_probs(
            np.array([[0, 7]], np.int32),
            np.array([[1, -1]], np.int32),
            np.array([[-1, -1]], np.int32),
            probs,
            np.full((1, 2), 0.5, np.float32),
            np.array([final_coin], np.float32),
            max_accept=1,
        )
        assert int(res.tokens[0, 0]) == want, (final_coin, int(res.tokens[0, 0]))


# --- mode (b): fused from logits ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, layout", [(jnp.float32, "single"), (jnp.bfloat16, "single"), (jnp.float32, "spans")])
def test_from_logits_agrees_with_the_reference_pipeline(dtype, layout):
    batch, depth, vocab, budget = 256, 4, 1000, 16
    tree, nxt, sib, target, coins, final, rng = _inputs(2, batch, depth, vocab, budget, dtype=dtype)
    params = _random_params(rng, batch)
    got, valid = tree_sampling_from_logits(
        tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth, layout=layout
    )
    ref, ref_valid = tree_sampling_from_logits_reference(
        tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth
    )
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(ref_valid))
    assert float(np.asarray(ref.num_accepted).mean()) > 0.5
    _assert_agreement(got, ref, _row_margins(tree, nxt, sib, target, coins, final, depth, params))


def test_the_margin_check_catches_a_real_difference():
    """The explanation is not vacuous: a kernel run with a wrong top-p disagrees on rows the oracle
    (given the true params) does not excuse."""
    batch, depth, vocab, budget = 48, 3, 500, 8
    tree, nxt, sib, target, coins, final, rng = _inputs(3, batch, depth, vocab, budget)
    params = SamplingParams.create(batch, temperature=1.0, top_p=0.9)
    wrong = SamplingParams.create(batch, temperature=1.0, top_p=0.5)
    got, _ = tree_sampling_from_logits(tree.tokens, nxt, sib, target, wrong, coins, final, max_accept=depth)
    ref, _ = tree_sampling_from_logits_reference(tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth)
    explain = _row_margins(tree, nxt, sib, target, coins, final, depth, (1.0, 0, 0.9, 0.0))
    with pytest.raises(AssertionError):
        _assert_agreement(got, ref, explain, min_share=0.0)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [8193, 151936, 163840])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_vocabularies(vocab, dtype):
    batch, depth, budget = 3, 5, 12
    tree, nxt, sib, target, coins, final, rng = _inputs(vocab, batch, depth, vocab, budget, dtype=dtype, scale=4.0)
    params = SamplingParams.create(
        batch, temperature=[0.0, 1.0, 0.8], top_k=[0, 0, 1000], top_p=[1.0, 0.9, 0.95], min_p=[0.0, 0.0, 0.01]
    )
    got, _ = tree_sampling_from_logits(tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth)
    ref, _ = tree_sampling_from_logits_reference(tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth)
    _assert_agreement(got, ref, _row_margins(tree, nxt, sib, target, coins, final, depth, params), min_share=0.0)
    probs = np.asarray(processed_probs(target, params))
    tokens, n_acc, accept = (np.asarray(a) for a in (got.tokens, got.num_accepted, got.accept_index))
    for b in range(batch):
        for j, row in enumerate(accept[b, : n_acc[b] + 1]):
            assert 0 <= tokens[b, j] < vocab and probs[b, row, tokens[b, j]] > 0


def test_greedy_rows_are_the_argmax_walk_in_a_mixed_batch():
    batch, depth, vocab, budget = 16, 4, 300, 12
    tree, nxt, sib, target, coins, final, rng = _inputs(4, batch, depth, vocab, budget)
    temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 1.0)
    params = SamplingParams.create(batch, temperature=temperature, top_p=0.9)
    got, _ = tree_sampling_from_logits(tree.tokens, nxt, sib, target, params, coins, final, max_accept=depth)
    greedy = verify_greedy(tree.tokens, nxt, sib, target, max_accept=depth)
    rows = temperature == 0
    for name in ("accept_index", "num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[rows], np.asarray(getattr(greedy, name))[rows])
    assert np.asarray(greedy.num_accepted)[rows].mean() > 0.3  # drafts are accepted, not only rejected


def test_verify_step_pallas_matches_xla_and_flags_invalid_rows():
    batch, depth, vocab, budget = 8, 4, 256, 10
    tree, _, _, target, _, _, rng = _inputs(5, batch, depth, vocab, budget)
    target = np.asarray(target).copy()
    target[2, 0, 5] = np.nan
    params = SamplingParams.create(batch, temperature=rng.choice([0.0, 1.0], batch), top_k=20)
    keys = jax.random.split(jax.random.key(9), batch)
    a = verify_step(tree, jnp.asarray(target), params, keys, order="random", impl="pallas")
    b = verify_step(tree, jnp.asarray(target), params, keys, order="random", impl="xla")
    for name in ("accept_index", "num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    assert (np.asarray(a.tokens[2]) == INVALID_TOKEN).all()
    with pytest.raises(ValueError, match="verifier='sampling' only"):
        verify_step(tree, jnp.asarray(target), params, keys, verifier="sample_then_walk", impl="pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        verify_step(tree, jnp.asarray(target), params, keys, impl="triton")


def test_bad_inputs_are_named():
    tree, nxt, sib, target, coins, final, rng = _inputs(6, 2, 2, 50, 4)
    params = SamplingParams.create(2, temperature=1.0)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        tree_sampling_from_logits(tree.tokens, nxt, sib, target.astype(jnp.float16), params, coins, final, max_accept=2)
    with pytest.raises(ValueError, match="max_accept"):
        tree_sampling_from_logits(tree.tokens, nxt, sib, target, params, coins, final, max_accept=-1)
    with pytest.raises(ValueError, match="coins must be"):
        tree_sampling_from_logits(tree.tokens, nxt, sib, target, params, coins[:, :2], final, max_accept=2)
    with pytest.raises(ValueError, match=r"sampling_params must be f32 \[B, 4\] = \(2, 4\)"):
        tree_sampling_from_logits(tree.tokens, nxt, sib, target, SamplingParams.create(3), coins, final, max_accept=2)
    with pytest.raises(ValueError, match="layout must be one of .* got 'grid'"):
        tree_sampling_from_logits(tree.tokens, nxt, sib, target, params, coins, final, max_accept=2, layout="grid")
    assert tree_sampling.resolve_layout("auto", tree_sampling.SINGLE_PROGRAM_MAX_VOCAB) == "single"
    assert tree_sampling.resolve_layout("auto", tree_sampling.SINGLE_PROGRAM_MAX_VOCAB + 1) == "spans"


def test_params_rows_repeat_per_slot():
    params = SamplingParams.create(2, temperature=[0.5, 1.0], top_k=[3, 0], top_p=[0.9, 1.0], min_p=[0.0, 0.1])
    rows = np.asarray(params_rows(params.as_rows(), 3))
    assert rows.shape == (6, 4)
    np.testing.assert_allclose(rows[:3], [[0.5, 3, 0.9, 0.0]] * 3)
    np.testing.assert_allclose(rows[3:], [[1.0, 0, 1.0, 0.1]] * 3)


@pytest.mark.slow
@pytest.mark.gpu
def test_output_law_through_the_fused_kernel():
    """The output-law test of tests/verify/test_law.py (Markov-chain target, V = 6, three DDTree steps, exact law by
    enumeration), run through verify_step(impl="pallas"): chi-square at ALPHA = 1e-3 (a false-positive
    rate of 1e-3 for an exact sampler), and the same chains through the XLA path, whose law
    tests/verify/test_law.py checks with many more chains: the two emit the same tokens on >= 99.9% of
    the chains (the kernel's contract), which carries that test's power over to the kernel. Interpret
    mode costs ~15 ms per chain here (the "single" layout: three kernels a step), so 2,500 chains;
    big-sample runs through the kernel: `experiments/sampling_correctness.py --impl pallas`."""
    from ddtree_jax.verify.markov import simulate, transition_probs
    from tests.stats_helpers import ALPHA
    from tests.verify import test_law

    samples, setting = 2500, "T1.5-topp0.8-minp0.05"
    params = SamplingParams.create(samples, **test_law.SETTINGS[setting])
    roots = jnp.full((samples,), test_law.ROOT, jnp.int32)
    runs = {
        impl: simulate(
            test_law.TRANSITION,
            test_law.DRAFT,
            params,
            roots,
            jax.random.key(3),
            budget=test_law.BUDGET,
            num_steps=3,
            order="random",
            impl=impl,
        )
        for impl in ("pallas", "xla")
    }
    emitted, accepted = (np.asarray(a) for a in runs["pallas"])
    same = (emitted == np.asarray(runs["xla"][0])).all(axis=1).mean()
    assert same >= 0.999, same
    probs = transition_probs(test_law.TRANSITION, SamplingParams.create(1, **test_law.SETTINGS[setting]))
    assert test_law._law_pvalue(emitted, probs) > ALPHA
    assert accepted.mean() > 0.3


def test_a_sibling_cycle_ends_the_walk_as_the_reference():
    """A malformed tree under jit (its lists cannot be checked there): slot 1's next sibling is 2 and 2's is 1, and
    the target gives both tokens probability 0, so every test rejects. The kernel's while loop spun forever (a
    hung GPU); it is bounded now and emits what the reference emits."""
    candidates = jnp.array([[0, 1, 2]], jnp.int32)
    next_token = jnp.array([[1, -1, -1]], jnp.int32)
    next_sibling = jnp.array([[-1, 2, 1]], jnp.int32)
    probs = jnp.broadcast_to(jnp.array([1.0, 0.0, 0.0, 0.0]), (1, 3, 4))
    coins, final_coin = jnp.full((1, 3), 0.5), jnp.array([0.5])
    args = (candidates, next_token, next_sibling, probs, coins, final_coin)
    want = tree_sampling_from_probs_reference(*args, max_accept=2)
    got = tree_sampling.tree_sampling_from_probs(*args, max_accept=2, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
