"""ddtree_kernels.tree_build: the top-K and best-first selection kernels against their twins
(`lax.top_k`, the level-by-level XLA selection), on fresh random inputs with many exact ties, dead depths
and more budget than reachable prefixes; and the errors on bad input. Interpreted on CPU, compiled on GPU
(`scripts/test_gpu.sh`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels import tree_build
from ddtree_kernels.tree_build import (
    float_key,
    key_float,
    tree_select,
    tree_select_reference,
    tree_slots,
    tree_slots_reference,
    tree_topk,
    tree_topk_logits,
    tree_topk_logits_reference,
    tree_topk_reference,
)


def _log_probs(logits):
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return jnp.where(jnp.isnan(lp), -jnp.inf, lp)  # an all -inf depth: no candidates


def _assert_same_slots(got, want):
    """Equal slots wherever the twin's slot is real (logw finite); the same padding."""
    real = np.isfinite(np.asarray(want[3]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got[3])), real)
    for name, a, b in zip(("level", "rank", "parent", "logw"), got, want):
        np.testing.assert_array_equal(np.where(real, np.asarray(a), 0), np.where(real, np.asarray(b), 0), err_msg=name)


def test_float_key_is_monotone_and_inverted():
    x = jnp.asarray([-jnp.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    keys = np.asarray(float_key(x))
    assert (np.diff(keys) >= 0).all() and keys[3] == keys[4]  # -0.0 == +0.0
    assert (np.diff(keys)[[0, 1, 2, 4, 5, 6]] > 0).all()
    np.testing.assert_array_equal(np.asarray(key_float(float_key(x))), np.asarray(x + 0.0))


@pytest.mark.parametrize(
    "rows,count,k,quantized",
    [
        (3, 300, 17, False),
        (4, 64, 64, True),
        (2, 1000, 5, True),
        (5, 33, 1, False),
        (2, 2048, 128, True),
        # k > EXTRACT_MAX_K: "auto" takes the resident search, compaction and ranking
        (2, 2048, 200, True),
        (3, 700, 256, False),
        (2, 300, 300, True),
    ],
)
@pytest.mark.parametrize("method", ["auto", "extract", "search", "resident"])
def test_topk_matches_its_twin(rows, count, k, quantized, method):
    """Every kernel path against the two-key sort: "auto" (k <= EXTRACT_MAX_K: extraction; beyond: the
    resident search), "extract" (one at a time), "search" (the radix search over streamed chunks) and
    "resident" (the row in registers: bisection, one compaction scan)."""
    assert tree_build.EXTRACT_MAX_K < 17  # "auto" takes both paths over these cases
    rng = np.random.default_rng(count + k)
    values = rng.standard_normal((rows, count)) * 3
    if quantized:  # many exact ties: the lower position must come first
        values = np.round(values)
    values[0, rng.integers(0, count, count // 3)] = -np.inf
    values = jnp.asarray(values, jnp.float32)
    got, want = tree_topk(values, k, method=method), tree_topk_reference(values, k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("method", ["extract", "search", "resident"])
def test_topk_with_more_k_than_finite_entries_takes_the_lowest_positions(method):
    values = jnp.asarray([[-jnp.inf, 0.5, -jnp.inf, -jnp.inf, 1.0, -jnp.inf]], jnp.float32)
    got_values, got_pos = tree_topk(values, 4, method=method)
    np.testing.assert_array_equal(np.asarray(got_pos), [[4, 1, 0, 2]])
    np.testing.assert_array_equal(np.asarray(got_values), [[1.0, 0.5, -np.inf, -np.inf]])


@pytest.mark.parametrize(
    "rows,count,k,dtype",
    [
        (6, 300, 16, jnp.float32),  # extraction
        (6, 1000, 64, jnp.float32),  # the resident search
        (6, 2048, 33, jnp.bfloat16),  # bf16 logits: many exact ties, lower position first
        (6, 64, 64, jnp.bfloat16),  # k = C
    ],
)
def test_topk_logits_matches_its_twin(rows, count, k, dtype):
    """The fused log-softmax + flags + top-K against the twin (XLA log-softmax, plain reductions, the two-key
    sort) on fresh random logits with a dead row, a NaN row, a +inf row and a half -inf row: the flags and
    positions exactly, the log-probs within ulps of the log-normaliser (the kernel sums in its own order)."""
    rng = np.random.default_rng(count + k)
    logits = rng.standard_normal((rows, count)) * 3
    logits[1] = -np.inf  # dead
    logits[2, rng.integers(0, count)] = np.nan
    logits[3, rng.integers(0, count)] = np.inf
    logits[4, : count // 2] = -np.inf
    logits = jnp.asarray(logits, dtype)
    got, want = tree_topk_logits(logits, k), tree_topk_logits_reference(logits, k)
    flags = np.asarray(want[2])
    np.testing.assert_array_equal(np.asarray(got[2]), flags)
    assert list(flags) == [0, tree_build.DEAD_DEPTH, tree_build.INVALID_ROW, tree_build.INVALID_ROW, 0, 0]
    ok = flags == 0  # flagged rows' top-K are meaningless (the builder reads the flags)
    np.testing.assert_array_equal(np.asarray(got[1])[ok], np.asarray(want[1])[ok])
    ulp = np.spacing(np.float32(np.log(count) + 10.0))
    np.testing.assert_allclose(np.asarray(got[0])[ok], np.asarray(want[0])[ok], rtol=0, atol=2 * ulp)
    with pytest.raises(ValueError, match="search"):
        tree_topk_logits(logits, k, method="search")


@pytest.mark.parametrize(
    "batch,depth,vocab,budget,kind",
    [
        (2, 15, 512, 64, "normal"),
        (3, 5, 40, 33, "ties"),
        (2, 4, 8, 64, "ties"),  # more budget than prefixes: padding
        (2, 6, 16, 16, "dead"),
        (1, 3, 4, 84, "ties"),
        (2, 1, 50, 20, "normal"),  # L = 1: a fan
        (1, 15, 300, 256, "ties"),
    ],
)
def test_select_matches_the_level_by_level_twin(batch, depth, vocab, budget, kind):
    rng = np.random.default_rng(depth * 1000 + vocab + budget)
    if kind == "normal":
        logits = rng.standard_normal((batch, depth, vocab)) * 3
    else:  # integer logits: exact ties within and across depths (equal sums along different paths)
        logits = rng.integers(-3, 2, size=(batch, depth, vocab)).astype(np.float64)
    if kind == "dead":
        logits[0, 2] = -np.inf  # a dead depth: the tree stops above it
        logits[1, 0, vocab // 2 :] = -np.inf  # masked tokens never enter the tree
    k = min(budget, vocab)
    top, _ = tree_topk_reference(_log_probs(logits).reshape(batch * depth, vocab), k)
    top = top.reshape(batch, depth, k)
    got = tree_select(top, budget)
    want = tree_select_reference(top, budget)
    _assert_same_slots(got, want)
    if kind == "ties":  # the tie walk ran: some popped log-weights repeat
        logw = np.asarray(want[3])[0]
        assert len(np.unique(logw[np.isfinite(logw)])) < np.isfinite(logw).sum()


@pytest.mark.parametrize(
    "batch,depth,vocab,budget,kind",
    [(3, 6, 40, 16, "ties"), (2, 15, 512, 64, "normal"), (2, 4, 8, 64, "ties"), (3, 6, 16, 24, "dead")],
)
def test_slots_lay_the_tree_out_like_their_twin(batch, depth, vocab, budget, kind):
    """`tree_slots` (selection + layout in one kernel) against `tree_slots_reference`: every field equal,
    padding included, with dead depths (passed as `live`, not masked in the log-probs), a root-only row and
    more budget than prefixes."""
    rng = np.random.default_rng(7 * depth + vocab + budget)
    if kind == "normal":
        lp = _log_probs(rng.standard_normal((batch, depth, vocab)) * 3)
    else:
        lp = _log_probs(rng.integers(-3, 2, size=(batch, depth, vocab)).astype(np.float64))
    k = min(budget, vocab)
    top, pos = tree_topk_reference(lp.reshape(batch * depth, vocab), k)
    top, ids = top.reshape(batch, depth, k), (pos.reshape(batch, depth, k) * 7 + 3) % 1000  # not the ranks
    live = np.ones((batch, depth), bool)
    row_ok = np.ones((batch,), bool)
    if kind == "dead":
        live[0, 2] = False  # the tree stops above depth 3
        live[2, 0] = False  # no depth-1 candidates: root-only
        row_ok[1] = False  # NaN logits upstream: root-only
    roots = jnp.asarray(rng.integers(0, vocab, size=batch), jnp.int32)
    args = (top, jnp.asarray(ids, jnp.int32), jnp.asarray(live), roots, jnp.asarray(row_ok), budget)
    pads = (5, -1, 0, -1)
    got = tree_slots(*args, pads=pads)
    want = tree_slots_reference(*args, pads=pads)
    for name, a, b in zip(("tokens", "parents", "depths", "ranks", "logw", "num_nodes"), got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    num_nodes = np.asarray(want[5])
    assert (num_nodes > 1).any() and (num_nodes <= budget + 1).all()
    if kind == "dead":
        assert num_nodes[1] == 1 and num_nodes[2] == 1 and (np.asarray(want[2])[0] < 3).all()
    with pytest.raises(ValueError, match="top_ids must have top_lp's shape"):
        tree_slots(top, jnp.asarray(ids)[:, :, :1], *args[2:])


@pytest.mark.parametrize(
    "count,k,chunk,dtype",
    [
        (1000, 16, 128, jnp.float32),  # extraction per chunk; V not a multiple of the chunk (-inf padding)
        (3000, 64, 256, jnp.bfloat16),  # the resident search per chunk, bf16: exact ties across chunks
        (777, 100, 64, jnp.float32),  # k > chunk: every chunk's whole content is a candidate
        (512, 7, 512, jnp.bfloat16),  # one chunk
    ],
)
def test_chunked_topk_logits_matches_its_twin(count, k, chunk, dtype):
    """Rows longer than one kernel program holds, cut into chunks: the same flags, token ids and log-probs (within
    ulps of the log-normaliser) as the twin's top-K over the whole row, on fresh random logits with a dead row,
    NaN and +inf rows, a row with fewer than k finite logits and values repeated across chunks (equal values:
    the lower token id first)."""
    rng = np.random.default_rng(count + k + chunk)
    logits = rng.standard_normal((7, count)) * 3
    logits[1] = -np.inf  # dead
    logits[2, rng.integers(0, count)] = np.nan
    logits[3, rng.integers(0, count)] = np.inf
    logits[4, : count - 3] = -np.inf  # 3 finite logits, in the last chunk
    logits[5, rng.integers(0, count, 40)] = logits[5].max() + 1.0  # ties at the top, spread over chunks
    logits = jnp.asarray(logits, dtype)
    got = tree_build.tree_topk_logits_chunked(logits, k, chunk=chunk)
    want = tree_topk_logits_reference(logits, k)
    flags = np.asarray(want[2])
    np.testing.assert_array_equal(np.asarray(got[2]), flags)
    assert list(flags) == [0, tree_build.DEAD_DEPTH, tree_build.INVALID_ROW, tree_build.INVALID_ROW, 0, 0, 0]
    ok = flags == 0
    finite = np.isfinite(np.asarray(want[0])) & ok[:, None]
    np.testing.assert_array_equal(np.isfinite(np.asarray(got[0]))[ok], finite[ok])
    np.testing.assert_array_equal(np.where(finite, np.asarray(got[1]), 0), np.where(finite, np.asarray(want[1]), 0))
    assert ((np.asarray(got[1]) >= 0) & (np.asarray(got[1]) < count)).all()  # -inf entries: still real token ids
    ulp = np.spacing(np.float32(np.log(count) + 10.0))
    np.testing.assert_allclose(
        np.where(finite, np.asarray(got[0]), 0), np.where(finite, np.asarray(want[0]), 0), rtol=0, atol=2 * ulp
    )


def test_chunked_topk_breaks_log_prob_ties_by_token_id_as_the_whole_row_does():
    """Two different logits that round to one float32 log-prob (a review's counterexample): the whole-row order
    takes the lower token id first, so the chunked top-K must rank by log-probs, not by raw logits."""
    x = np.full((1, 16384), 0.5, np.float32)
    x[0, 100] = np.nextafter(np.float32(1.0), np.float32(0.0))
    x[0, 200] = 1.0
    x = jnp.asarray(x)
    for k in (1, 2):
        want = tree_topk_logits_reference(x, k)
        got = tree_build.tree_topk_logits_chunked(x, k, chunk=8192)  # both ids in chunk 0
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_chunked_topk_rejects_bad_chunks_by_name():
    x = jnp.zeros((2, 1000))
    with pytest.raises(ValueError, match="chunk must be a power of two <= MAX_ROW"):
        tree_build.tree_topk_logits_chunked(x, 4, chunk=100)
    with pytest.raises(ValueError, match="use a larger chunk"):
        tree_build.tree_topk_logits_chunked(jnp.zeros((1, 40000)), 512, chunk=8)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, V=1000\]"):
        tree_build.tree_topk_logits_chunked(x, 1001)


def test_select_and_topk_reject_bad_input_by_name():
    with pytest.raises(ValueError, match="k must be an integer in"):
        tree_topk(jnp.zeros((2, 8)), 9)
    with pytest.raises(ValueError, match="method must be one of .* got 'sort'"):
        tree_topk(jnp.zeros((2, 8)), 2, method="sort")
    with pytest.raises(ValueError, match="MAX_ROW"):
        tree_topk(jnp.zeros((1, tree_build.MAX_ROW + 1)), 4)
    with pytest.raises(ValueError, match=r"shape \[R, C\]"):
        tree_topk(jnp.zeros((8,)), 2)
    with pytest.raises(ValueError, match="K=8 must be <= budget=4"):
        tree_select(jnp.zeros((1, 3, 8)), 4)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        tree_select(jnp.zeros((1, 3, 1)), 0)
    with pytest.raises(ValueError, match="do not pack into 31 bits"):
        tree_select(jnp.zeros((1, 2**13, 2)), 2**16)
