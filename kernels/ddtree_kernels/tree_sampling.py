"""Pallas kernels for target-only tree rejection sampling (the walk of `sampling_reference`).

Two entry points, each beside its pure-JAX reference twin (`*_reference`, built on `sampling_reference`):

  tree_sampling_from_probs(...)    mode (a): processed probabilities [B, N, V] in, the walk out
                                   (the library's `verify_sampling(..., impl="pallas")`).
  tree_sampling_from_logits(...)   mode (b): raw target logits [B, N, V] (bf16 or f32) and per-row
                                   settings [B, 4] in; the same result as
                                   `walk_reference(processed_probs_reference(logits, ...), ...)` without
                                   ever writing the [B, N, V] probability tensor to HBM
                                   (the library's `verify_step(..., impl="pallas")`). Greedy rows (T = 0)
                                   are the argmax walk in the same kernels.
Both return plain arrays (accept_index, num_accepted, tokens[, valid]); the callers wrap them.

Why this shape. The walk is sequential but tiny: it tests each tree node once, against its parent's
row, and samples one final token from one row. What costs is the vocabulary: turning a row of V
logits into processed probabilities. Three observations keep that to a few streaming passes:

  1. All three filters keep a prefix of the descending order (top-k keeps ties at the cut, top-p
     keeps a token iff the mass strictly above it is < top_p, min-p keeps p >= min_p * max p), so a
     filtered row is described by one logit cut `c` plus `e >= min_p`, with e = exp((x - max) / T):
     kept(x) = key(x) >= c and e(x) >= min_p.  p(x) = kept(x) * e(x) / Z, Z = sum of kept e.
  2. The cut is found by a K-ary threshold search over the monotone integer key of the logit
     (float32 bit pattern with the sign fixed up; bf16 logits need only its top 16 bits): each pass
     over the row evaluates 16 thresholds at once, so a bf16 row needs 4 passes per filter and
     an f32 row 8; no sort.
  3. The final correction/bonus sample reads one row per batch row, in vocab order, and stops at
     the chunk where the running CDF crosses the coin.

Kernels (Triton lowering via `pl.pallas_call`; interpret mode on CPU). A row of V = 163840 is too
long for one program to stream fast (one SM pulls ~100 GB/s), so every vocabulary pass runs on a
(row, span) grid sized to fill the GPU, and XLA combines the per-span partials in between:

  1 _partial_stats_kernel   (rows, spans): max, Z, argmax, min key, NaN/inf flag of a span
  2 _search_pass_kernel     (rows, spans): counts (top-k) or masses (top-p) at 16 thresholds; a fixed
                            number of passes (4 for bf16, 8 for f32), skipped when no row filters
  3 _kept_mass_kernel       (rows, spans): Z over the kept tokens (only when a row filters)
  4 _walk_kernel            (B, 1): the walk over the tree lists (scalar loop; one read per node)
  5 _residual_sums_kernel   (B, spans): residual mass of the final row per span (excluded tokens zeroed)
  6 _final_scan_kernel      (B, 1): the first CDF crossing inside the span XLA picked from 5's sums

Small vocabularies (V <= SINGLE_PROGRAM_MAX_VOCAB, e.g. the embedded pair's 8,192): a span grid buys
nothing there and its XLA combines cost a launch each (~90 launches a step with top-p on float32
logits), so layout "single" runs one program per row for everything:

  1' _single_row_stats_kernel (rows,): kernels 1-3 in one program (statistics, every search pass with
                            its bracket update, the kept mass); the row is re-read from L1 / L2
  4  _walk_kernel           (B, 1): as above
  5' _final_single_kernel   (B,): kernels 5 and 6 in one program (the residual's sum, then the crossing)

Numerics. The reference (`processed_probs_reference` + `walk_reference`) sorts and cumsums; these kernels
reduce in another order, so a coin or a filter cut that lies within float32 rounding of a CDF bucket
boundary may fall on the other side. Tests require >= 99.9% row agreement and check that every
mismatch is such a boundary case.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_kernels.sampling_reference import (
    processed_probs_reference,
    valid_params,
    valid_rows,
    walk_array_arguments,
    walk_reference,
    walk_static_arguments,
)
from ddtree_kernels.tiling import TARGET_PROGRAMS, default_interpret

STATS_BLOCK = 2048  # vocab elements per load: statistics and kept-mass passes
SEARCH_BLOCK = 256  # vocab elements per load in a search pass ([block, 16] comparisons and accumulators)
SEARCH_FANOUT = 16  # thresholds per search pass (a power of two: Triton tensors are power-of-two sized)
FINAL_BLOCK = 2048  # vocab elements per load in the final sample (a multiple of STATS_BLOCK's role: spans)
# layout "single": rows up to this are one load held in registers (the filter cuts by bisection). H200, V =
# 8,192 (`benchmarks.bench_small_kernels`, small_kernels_833ba35.json): T = 1 top-p 0.95, 1 x 17 rows:
# 10.0 us resident against 37.6 us streamed (8 warps, 1,024 a load) and 50.9 us (4 warps, 256); T = 0
# 4.1 against 4.4 us. Longer rows (not measured resident) stream.
SINGLE_STATS_BLOCK = 8192
SINGLE_PROGRAM_MAX_VOCAB = 16384  # layout "auto": one program per row ("single") up to this vocabulary


@dataclasses.dataclass(frozen=True)
class SingleTiling:
    """Layout "single"'s tiling: warps per program, vocab elements per load of a search pass ([search_block,
    16] comparisons per load) and of the statistics and kept-mass passes (stats_block: up to it, a row is
    one load held in registers and its filter cuts are found by bisection, one reduction a step), all powers
    of two. The defaults are what the H200 measured (`SINGLE_STATS_BLOCK`: the row resident up to V = 8,192;
    `benchmarks.bench_small_kernels` times the tilings)."""

    warps: int = 4
    search_block: int = SEARCH_BLOCK
    stats_block: int = SINGLE_STATS_BLOCK

    def __post_init__(self):
        blocks = (self.search_block, self.stats_block)
        if self.warps not in (1, 2, 4, 8, 16) or any(b < 16 or b & (b - 1) for b in blocks):
            raise ValueError(
                "SingleTiling needs warps in 1-16 (a power of two) and power-of-two search_block and "
                f"stats_block >= 16, got {self}"
            )


SINGLE_TILING = SingleTiling()
LAYOUTS = ("auto", "single", "spans")

_INT32_MIN = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


# --- shared elementwise pieces (used by the kernels and by tests) ------------------------------------


def logit_key(x: jax.Array, shift: int) -> jax.Array:
    """int32 key, monotone in the float32 value x (ties equal; -0.0 == +0.0), arithmetic-shifted right
    by `shift` (16 for bf16 inputs, whose low 16 bits are zero; 0 for float32)."""
    x = x.astype(jnp.float32)
    x = jnp.where(x == 0.0, jnp.float32(0.0), x)  # -0.0 -> +0.0 (a select: `x + 0.0` may be folded away)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return key >> shift if shift else key


def _thresholds(lo, hi):
    """SEARCH_FANOUT int32 keys spread over (lo, hi], in wrapping int32 arithmetic (hi - lo may exceed
    2^31 for float32 keys), plus a validity mask (when hi - lo < SEARCH_FANOUT, keys >= hi are off)."""
    width = hi - lo  # true value in [2, 2^32), read as unsigned
    step = lax.shift_right_logical(width, jnp.int32(SEARCH_FANOUT.bit_length() - 1))
    j = jnp.arange(1, SEARCH_FANOUT + 1, dtype=jnp.int32)
    wide = step > 0
    t = lo + jnp.where(wide, step, 1) * j
    valid = wide | (j < width)  # width < SEARCH_FANOUT here, so width is a small non-negative int
    return t, valid


# --- splitting a row over programs ---------------------------------------------------------------------


def _split(vocab: int, rows: int, block: int) -> tuple[int, int]:
    """(splits, span): each of `rows` rows is cut into `splits` spans of `span` elements (a multiple of
    `block`), so that rows * splits fills the GPU (~2 programs per SM) without spans under one block."""
    max_splits = pl.cdiv(vocab, block)
    splits = int(min(max(1, pl.cdiv(TARGET_PROGRAMS, rows)), max_splits))
    span = pl.cdiv(pl.cdiv(vocab, splits), block) * block
    return pl.cdiv(vocab, span), span


def _span_chunks(values_ref, row, span: int, block: int, vocab: int, other, base):
    """A loader over the span [base, base + span) of a row (kernels read program_id at their top level,
    where interpret mode can discharge it): chunk c -> (idx int32 [block], in_row bool, float32 x)."""

    def load(c):
        idx = base + c * block + jnp.arange(block, dtype=jnp.int32)
        in_row = idx < vocab
        view = values_ref.at[idx] if row is None else values_ref.at[row, idx]
        x = plgpu.load(view, mask=in_row, other=other).astype(jnp.float32)
        return idx, in_row, x

    return load, span // block


def _kept_e(x, in_row, m, inv_t, cut, min_e, shift: int):
    """e = exp((x - m) / T) where the filters keep x (logit_key(x) >= cut and e >= min_e), else 0: a row's
    unnormalised processed probabilities."""
    e = jnp.where(x > -jnp.inf, jnp.exp((x - m) / inv_t), 0.0)
    return jnp.where(in_row & (logit_key(x, shift) >= cut) & (e >= min_e), e, 0.0)


def _filter_cuts(search, topk_on, topp_on, kmin, kmax, top_k, top_p, no_cut, per_row=lambda a: a):
    """The keep-cut of the top-k and top-p filters through `search(mode, active, lo, hi, cut, threshold_fn)
    -> (lo, hi)` (one row in a kernel, or [R] rows in XLA, `per_row` broadcasting a row's value against its
    16 thresholds): top-k's is the largest key t with count(key >= t) >= k (the k-th largest logit);
    top-p's the smallest key t with mass(key > t, key >= cut_k) < top_p * Z_k; the cut is the larger."""
    cut_k, _ = search(
        "count",
        topk_on,
        jnp.where(topk_on, kmin, _INT32_MIN),
        kmax + 1,
        no_cut,
        lambda counts, _: counts >= per_row(top_k.astype(jnp.float32)),
    )
    cut_k = jnp.where(topk_on, cut_k, _INT32_MIN)
    _, cut_p = search(
        "mass",
        topp_on,
        jnp.where(cut_k == _INT32_MIN, kmin, cut_k) - 1,
        kmax,
        cut_k,
        lambda masses, zk: masses < per_row(top_p * zk),
    )
    return jnp.where(topp_on, jnp.maximum(cut_p, cut_k), cut_k)


# --- kernel 1: partial statistics of a span (max, Z, argmax, min key, validity) ---------------------------


def _span_stats(load, num_chunks: int, inv_t, vocab: int, shift: int):
    """(max, Z = sum of exp((x - max) / T), first argmax, min logit_key, NaN / +inf flag) over the chunks of
    `load`, with scalar carries: one exp per element. (Per-lane online-softmax accumulators need two exps
    per element and measured 1.4-1.8x slower on the H200 at 6a31c0f.)"""

    def body(c, carry):
        m, z, arg, kmin, bad = carry
        idx, in_row, x = load(c)
        bad = jnp.maximum(bad, jnp.max((jnp.isnan(x) | (x == jnp.inf)).astype(jnp.int32)))
        xs = jnp.where(jnp.isnan(x), -jnp.inf, x)
        cmax = jnp.max(xs)
        carg = jnp.min(jnp.where(xs == cmax, idx, vocab))
        new_m = jnp.maximum(m, cmax)
        finite = new_m > -jnp.inf
        scale = jnp.where(finite & (m > -jnp.inf), jnp.exp((m - new_m) / inv_t), 0.0)
        z = z * scale + jnp.sum(jnp.where(finite, jnp.exp((xs - new_m) / inv_t), 0.0))
        arg = jnp.where(cmax > m, carg, arg)
        kmin = jnp.minimum(kmin, jnp.min(jnp.where(in_row, logit_key(xs, shift), _INT32_MAX)))
        return new_m, z, arg, kmin, bad

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(vocab), jnp.int32(_INT32_MAX), jnp.int32(0))
    return lax.fori_loop(0, num_chunks, body, init)


def _search_accumulate(load, num_chunks: int, mode: str, t, cut, m, inv_t, shift: int, block: int = SEARCH_BLOCK):
    """One threshold-search pass over the chunks of `load` against thresholds t i32 [16]: "count" ->
    (#{key >= t_j} f32 [16], 0); "mass" -> (sum of e over key > t_j and key >= cut [16], sum of e over
    key >= cut)."""

    def body(c, carry):  # [block, 16] per-lane accumulators, reduced once at the end
        acc, total = carry
        _, in_row, x = load(c)
        key = jnp.where(in_row, logit_key(x, shift), _INT32_MIN)
        if mode == "count":
            return acc + (key[:, None] >= t[None, :]).astype(jnp.float32), total
        e = jnp.where(in_row & (key >= cut) & (x > -jnp.inf), jnp.exp((x - m) / inv_t), 0.0)
        return acc + jnp.where(key[:, None] > t[None, :], e[:, None], 0.0), total + e

    acc, total = lax.fori_loop(
        0,
        num_chunks,
        body,
        (jnp.zeros((block, SEARCH_FANOUT), jnp.float32), jnp.zeros((block,), jnp.float32)),
    )
    return jnp.sum(acc, axis=0), jnp.sum(total)


def _narrow(mode: str, t, ok, sat, lo, hi):
    """The bracket (lo, hi] after one pass: thresholds rise with j, so "sat" is a prefix (top-k: keys still
    leaving >= k tokens) or a suffix (top-p: keys whose upper mass is small); the bracket keeps the
    boundary. Works on one row (t [16], lo []) or a batch (t [R, 16], lo [R])."""
    lo_, hi_ = (lo, hi) if jnp.ndim(lo) == 0 else (lo[:, None], hi[:, None])
    if mode == "count":
        return jnp.max(jnp.where(sat, t, lo_), axis=-1), jnp.min(jnp.where(ok & ~sat, t, hi_), axis=-1)
    return jnp.max(jnp.where(ok & ~sat, t, lo_), axis=-1), jnp.min(jnp.where(sat, t, hi_), axis=-1)


def _partial_stats_kernel(
    temp_ref,  # f32 []: this row's temperature (0 = greedy: Z is computed at T = 1, unused)
    logits_ref,  # [V] bf16 / f32: the row
    max_ref,  # out f32 []: max over the span (-inf if none finite)
    z_ref,  # out f32 []: sum of exp((x - span max) / T)
    argmax_ref,  # out i32 []: first index of the span max
    kmin_ref,  # out i32 []: min logit_key over the span
    bad_ref,  # out i32 []: 1 if the span holds a NaN or +inf
    *,
    vocab: int,
    span: int,
    block: int,
    shift: int,
):
    base = pl.program_id(1) * span
    inv_t = jnp.where(temp_ref[...] == 0.0, 1.0, temp_ref[...])
    load, num_chunks = _span_chunks(logits_ref, None, span, block, vocab, -jnp.inf, base)
    m, z, arg, kmin, bad = _span_stats(load, num_chunks, inv_t, vocab, shift)
    max_ref[...] = m
    z_ref[...] = z
    argmax_ref[...] = arg
    kmin_ref[...] = kmin
    bad_ref[...] = bad


# --- kernel 2: one threshold-search pass over a span ---------------------------------------------------------


def _search_pass_kernel(
    active_ref,  # i32 []: 0 = this row needs no pass (the kernel returns zeros)
    t_ref,  # i32 [16]: thresholds (logit keys)
    cut_ref,  # i32 []: only keys >= cut count (the top-k cut when searching for top-p)
    max_ref,  # f32 []: the row max
    temp_ref,  # f32 []: the row temperature
    logits_ref,  # [V] bf16 / f32
    out_ref,  # out f32 [16]: "count": #{key >= t_j}; "mass": sum of e over key > t_j (and key >= cut)
    total_ref,  # out f32 []: "mass": sum of e over key >= cut (Z after top-k); "count": 0
    *,
    mode: str,
    vocab: int,
    span: int,
    block: int,
    shift: int,
):
    base = pl.program_id(1) * span
    out_ref[...] = jnp.zeros((SEARCH_FANOUT,), jnp.float32)
    total_ref[...] = jnp.float32(0.0)

    @pl.when(active_ref[...] != 0)
    def _():
        t = t_ref[...]
        cut = cut_ref[...]
        m = max_ref[...]
        inv_t = jnp.where(temp_ref[...] == 0.0, 1.0, temp_ref[...])
        load, num_chunks = _span_chunks(logits_ref, None, span, block, vocab, -jnp.inf, base)
        acc, total = _search_accumulate(load, num_chunks, mode, t, cut, m, inv_t, shift)
        out_ref[...] = acc
        total_ref[...] = total


# --- kernel 3: Z over the kept tokens of a span ---------------------------------------------------------------


def _kept_mass_kernel(
    active_ref,  # i32 []: 0 = skip (Z from kernel 1 stands)
    cut_ref,  # i32 []: keep iff logit_key(x) >= cut ...
    min_e_ref,  # f32 []: ... and e >= min_e
    max_ref,
    temp_ref,  # f32 []: row max and temperature
    logits_ref,  # [V]
    z_ref,  # out f32 []: sum of kept e over the span
    *,
    vocab: int,
    span: int,
    block: int,
    shift: int,
):
    base = pl.program_id(1) * span
    z_ref[...] = jnp.float32(0.0)

    @pl.when(active_ref[...] != 0)
    def _():
        cut, min_e, m = cut_ref[...], min_e_ref[...], max_ref[...]
        inv_t = jnp.where(temp_ref[...] == 0.0, 1.0, temp_ref[...])
        load, num_chunks = _span_chunks(logits_ref, None, span, block, vocab, -jnp.inf, base)

        def body(c, acc):
            _, in_row, x = load(c)
            return acc + _kept_e(x, in_row, m, inv_t, cut, min_e, shift)

        z_ref[...] = jnp.sum(lax.fori_loop(0, num_chunks, body, jnp.zeros((block,), jnp.float32)))


# --- kernel 1': one program per row, kernels 1-3 fused (layout "single") -------------------------------------------


def _single_row_stats_kernel(
    params_ref,  # f32 [4]: this row's (temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off))
    logits_ref,  # [V] bf16 / f32: the row
    max_ref,  # out f32 []
    z_ref,  # out f32 []
    min_e_ref,  # out f32 []
    cut_ref,  # out i32 []
    argmax_ref,  # out i32 []
    valid_ref,  # out i32 []  (the fields of `row_stats`)
    *,
    vocab: int,
    shift: int,
    passes: int,
    search_block: int,
    stats_block: int,
):
    temperature, top_p, min_p = params_ref[0], params_ref[2], params_ref[3]
    top_k = params_ref[1].astype(jnp.int32)
    greedy = temperature == 0.0
    inv_t = jnp.where(greedy, 1.0, temperature)
    stats_span = pl.cdiv(vocab, stats_block) * stats_block
    load, num_chunks = _span_chunks(logits_ref, None, stats_span, stats_block, vocab, -jnp.inf, 0)
    m_row, z, argmax, kmin, bad = _span_stats(load, num_chunks, inv_t, vocab, shift)
    valid = (bad == 0) & (m_row > -jnp.inf)
    m = jnp.where(valid, m_row, 0.0)
    z = jnp.where(m_row > -jnp.inf, z * jnp.exp((m_row - m) / inv_t), 0.0)  # one span of `row_stats`' combine
    kmax = logit_key(m, shift)
    topk_on = valid & ~greedy & (top_k > 0) & (top_k < vocab)
    topp_on = valid & ~greedy & (top_p < 1.0)
    min_e = jnp.where(valid & ~greedy, min_p, 0.0)
    any_filter = valid & ~greedy & (topk_on | topp_on | (min_p > 0))
    search_span = pl.cdiv(vocab, search_block) * search_block
    search_load, search_chunks = _span_chunks(logits_ref, None, search_span, search_block, vocab, -jnp.inf, 0)

    # a while loop, not a fori_loop with a traced trip count (Triton's scf.for rejects its bound types); both
    # searches also stop once the bracket is one key wide
    def streamed_search(mode, active, lo, hi, cut, threshold_fn):
        # the row streamed in search_block chunks, 16 thresholds a pass
        def more(state):
            i, lo, hi = state
            return active & (i < passes) & ((hi - lo) != 1)

        def one_pass(state):
            i, lo, hi = state
            t, ok = _thresholds(lo, hi)
            values, total = _search_accumulate(search_load, search_chunks, mode, t, cut, m, inv_t, shift, search_block)
            new_lo, new_hi = _narrow(mode, t, ok, ok & threshold_fn(values, total), lo, hi)
            return i + 1, new_lo, new_hi

        _, lo, hi = lax.while_loop(more, one_pass, (jnp.int32(0), lo, hi))
        return lo, hi

    if num_chunks == 1:  # the whole row in one load: it stays in registers, and each step is one reduction
        _, row_in, row_x = load(0)
        row_key = jnp.where(row_in, logit_key(row_x, shift), _INT32_MIN)
        row_live = row_in & (row_x > -jnp.inf)
        key_bits = 32 - shift

        def resident_search(mode, active, lo, hi, cut, threshold_fn):
            # bisection of (lo, hi] (at most key_bits halvings): the same cut as the 16-threshold passes
            e_cut = jnp.where(row_live & (row_key >= cut), jnp.exp((row_x - m) / inv_t), 0.0)
            total = jnp.sum(e_cut) if mode == "mass" else jnp.float32(0.0)

            def more(state):
                i, lo, hi = state
                return active & (i <= key_bits) & ((hi - lo) != 1)  # a bracket of 2^bits + 1 keys: bits + 1 steps

            def halve(state):
                i, lo, hi = state
                t = lo + lax.shift_right_logical(hi - lo, jnp.int32(1))  # wrapping: hi - lo may exceed 2^31
                if mode == "count":  # keys still leaving >= k tokens: the cut is at or above t
                    sat = threshold_fn(jnp.sum((row_key >= t).astype(jnp.float32)), total)
                    return i + 1, jnp.where(sat, t, lo), jnp.where(sat, hi, t)
                sat = threshold_fn(jnp.sum(jnp.where(row_key > t, e_cut, 0.0)), total)  # small upper mass
                return i + 1, jnp.where(sat, lo, t), jnp.where(sat, t, hi)

            _, lo, hi = lax.while_loop(more, halve, (jnp.int32(0), lo, hi))
            return lo, hi

        search = resident_search
    else:
        search = streamed_search

    cut = _filter_cuts(search, topk_on, topp_on, kmin, kmax, top_k, top_p, jnp.int32(_INT32_MIN))

    def kept(state):
        c, acc = state
        _, in_row, x = load(c)
        return c + 1, acc + _kept_e(x, in_row, m, inv_t, cut, min_e, shift)

    _, kept_e = lax.while_loop(
        lambda state: any_filter & (state[0] < num_chunks), kept, (jnp.int32(0), jnp.zeros((stats_block,), jnp.float32))
    )
    kept_z = jnp.sum(kept_e)
    max_ref[...] = m
    z_ref[...] = jnp.where(any_filter, kept_z, z)
    min_e_ref[...] = min_e
    cut_ref[...] = cut
    argmax_ref[...] = argmax
    valid_ref[...] = valid.astype(jnp.int32)


def _single_stats_warps(vocab: int, tiling: SingleTiling) -> int:
    """The row-statistics program's warps: tiling.warps, at least one per 1,024 elements (up to 16) when the
    row is one load (V <= tiling.stats_block), so the row's registers do not spill."""
    stats_block = min(_next_pow2(vocab), tiling.stats_block)
    resident = pl.cdiv(vocab, stats_block) == 1
    return max(tiling.warps, min(16, stats_block // 1024)) if resident else tiling.warps


def _single_row_stats(
    logits, settings, *, shift: int, passes: int, interpret: bool, tiling: SingleTiling, rows_per_setting: int
) -> dict:
    rows, vocab = logits.shape
    scalar = pl.BlockSpec((None,), lambda r: (r,))
    names = ("max", "z", "min_e", "cut", "argmax", "valid")
    dtypes = (jnp.float32,) * 3 + (jnp.int32,) * 3
    stats_block = min(_next_pow2(vocab), tiling.stats_block)
    outs = pl.pallas_call(
        functools.partial(
            _single_row_stats_kernel,
            vocab=vocab,
            shift=shift,
            passes=passes,
            search_block=tiling.search_block,
            stats_block=stats_block,
        ),
        grid=(rows,),
        # each row reads its settings row in place (no [R, 4] repeat of the [B, 4] settings)
        in_specs=[
            pl.BlockSpec((None, 4), lambda r: (r // rows_per_setting, 0)),
            pl.BlockSpec((None, vocab), lambda r: (r, 0)),
        ],
        out_specs=[scalar] * 6,
        out_shape=[jax.ShapeDtypeStruct((rows,), d) for d in dtypes],
        # a row held in registers (one load) gets >= 1 warp per 1,024 elements (64 f32 registers a thread)
        compiler_params=plgpu.CompilerParams(num_warps=_single_stats_warps(vocab, tiling), num_stages=2),
        interpret=interpret,
        name="tree_sampling_single_row_stats",
    )(settings.astype(jnp.float32), logits)
    return dict(zip(names, outs))


def resolve_layout(layout: str, vocab: int) -> str:
    """ "single" (one program per row) or "spans" (a (row, span) grid with XLA combines) for rows of
    `vocab` logits: "auto" is "single" up to SINGLE_PROGRAM_MAX_VOCAB."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "auto":
        return layout
    return "single" if vocab <= SINGLE_PROGRAM_MAX_VOCAB else "spans"


def _row_scalar_specs(count: int):
    return [pl.BlockSpec((None,), lambda r, s: (r,))] * count


def _grid_call(kernel, rows, splits, in_specs, out_specs, out_shape, name, interpret, num_warps=4):
    return pl.pallas_call(
        kernel,
        grid=(rows, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=name,
    )


def row_stats(
    logits: jax.Array,
    params_rows: jax.Array,
    *,
    interpret: bool | None = None,
    skip_with_cond: bool = True,
    layout: str = "auto",
    tiling: SingleTiling = SINGLE_TILING,
    rows_per_setting: int = 1,
) -> dict:
    """Per-row statistics of logits [R, V] (bf16 / f32) under per-row params f32 [R / rows_per_setting, 4]
    (temperature, top_k, top_p, min_p; rows_per_setting consecutive rows share one, e.g. a tree's N slots)
    -> dict of [R] arrays:

      max    f32  the row's max logit (0 for invalid rows)
      z      f32  sum of e = exp((x - max) / T) over the kept tokens (T := 1 for greedy rows)
      min_e  f32  min-p threshold on e (0 = off)
      cut    i32  keep iff logit_key(x) >= cut (INT32_MIN = no cut)
      argmax i32  first index of the max logit
      valid  i32  1 iff no NaN / +inf and at least one finite logit

    Kernels: partial statistics per (row, span), then fixed counts of search passes (4 per filter for
    bf16 keys, 8 for float32) each one pallas_call over (row, span) with the bracket updated in between,
    then the kept mass. Rows that do not filter skip the passes inside the kernels; a batch in which no
    row filters skips them all (one lax.cond; skip_with_cond=False launches them regardless, with every row
    inactive: `benchmarks/bench_tree_sampling.py --no-cond` measures that). layout "single" (`resolve_layout`)
    runs all of it in one program per row (kernel 1', its warps and search loads from `tiling`), the same
    statistics.
    """
    rows, vocab = logits.shape
    if logits.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"logits must be bfloat16 or float32, got {logits.dtype}")
    shift = 16 if logits.dtype == jnp.bfloat16 else 0
    passes = 4 if shift else 8  # 16 or 32 key bits, 4 bits per pass
    interpret = default_interpret(interpret)
    if params_rows.shape != (rows // rows_per_setting, 4) or rows % rows_per_setting:
        raise ValueError(
            f"params_rows must be f32 [R / rows_per_setting, 4] = ({rows} / {rows_per_setting}, 4), "
            f"got {tuple(params_rows.shape)}"
        )
    if resolve_layout(layout, vocab) == "single":
        return _single_row_stats(
            logits,
            params_rows,
            shift=shift,
            passes=passes,
            interpret=interpret,
            tiling=tiling,
            rows_per_setting=rows_per_setting,
        )
    params_rows = _repeat_settings(params_rows, rows_per_setting)
    splits, span = _split(vocab, rows, STATS_BLOCK)
    temperature, top_k, top_p, min_p = (params_rows[:, i] for i in range(4))
    top_k = top_k.astype(jnp.int32)
    greedy = temperature == 0.0
    inv_t = jnp.where(greedy, 1.0, temperature)
    row_spec = pl.BlockSpec((None, vocab), lambda r, s: (r, 0))
    part = pl.BlockSpec((None, None), lambda r, s: (r, s))
    common = dict(vocab=vocab, span=span, shift=shift)

    m_s, z_s, arg_s, kmin_s, bad_s = _grid_call(
        functools.partial(_partial_stats_kernel, block=STATS_BLOCK, **common),
        rows,
        splits,
        _row_scalar_specs(1) + [row_spec],
        [part] * 5,
        [jax.ShapeDtypeStruct((rows, splits), d) for d in (jnp.float32, jnp.float32, jnp.int32, jnp.int32, jnp.int32)],
        "tree_sampling_partial_stats",
        interpret,
    )(temperature, logits)
    m = jnp.max(m_s, axis=1)
    valid = (bad_s.max(axis=1) == 0) & (m > -jnp.inf)
    m = jnp.where(valid, m, 0.0)
    z = jnp.sum(jnp.where(m_s > -jnp.inf, z_s * jnp.exp((m_s - m[:, None]) / inv_t[:, None]), 0.0), axis=1)
    argmax = jnp.take_along_axis(arg_s, jnp.argmax(m_s, axis=1)[:, None], axis=1)[:, 0]
    kmin = kmin_s.min(axis=1)
    kmax = logit_key(m, shift)

    def search(mode, active, lo, hi, cut, threshold_fn):
        """`passes` passes narrowing (lo, hi]; threshold_fn(values, total) -> satisfied mask [R, 16]."""
        kernel = functools.partial(_search_pass_kernel, mode=mode, block=SEARCH_BLOCK, **common)
        call = _grid_call(
            kernel,
            rows,
            splits,
            [pl.BlockSpec((None,), lambda r, s: (r,)), pl.BlockSpec((None, SEARCH_FANOUT), lambda r, s: (r, 0))]
            + _row_scalar_specs(3)
            + [row_spec],
            [pl.BlockSpec((None, None, SEARCH_FANOUT), lambda r, s: (r, s, 0)), part],
            [
                jax.ShapeDtypeStruct((rows, splits, SEARCH_FANOUT), jnp.float32),
                jax.ShapeDtypeStruct((rows, splits), jnp.float32),
            ],
            f"tree_sampling_search_{mode}",
            interpret,
        )

        def run(bracket):
            lo, hi = bracket
            for _ in range(passes):
                running = active & ((hi - lo) != 1)
                t, ok = jax.vmap(_thresholds)(lo, hi)
                values, totals = call(running.astype(jnp.int32), t, cut, m, temperature, logits)
                sat = ok & threshold_fn(values.sum(axis=1), totals.sum(axis=1))
                new_lo, new_hi = _narrow(mode, t, ok, sat, lo, hi)
                lo, hi = jnp.where(running, new_lo, lo), jnp.where(running, new_hi, hi)
            return lo, hi

        return run((lo, hi))

    topk_on = valid & ~greedy & (top_k > 0) & (top_k < vocab)
    topp_on = valid & ~greedy & (top_p < 1.0)
    min_e = jnp.where(valid & ~greedy, min_p, 0.0)
    any_filter = valid & ~greedy & (topk_on | topp_on | (min_p > 0))

    def filtered(z):
        cut = _filter_cuts(search, topk_on, topp_on, kmin, kmax, top_k, top_p, no_cut, lambda a: a[:, None])
        z_parts = _grid_call(
            functools.partial(_kept_mass_kernel, block=STATS_BLOCK, **common),
            rows,
            splits,
            _row_scalar_specs(5) + [row_spec],
            part,
            jax.ShapeDtypeStruct((rows, splits), jnp.float32),
            "tree_sampling_kept_mass",
            interpret,
        )(any_filter.astype(jnp.int32), cut, min_e, m, temperature, logits)
        return cut, jnp.where(any_filter, z_parts.sum(axis=1), z)

    no_cut = jnp.full((rows,), _INT32_MIN, jnp.int32)
    if skip_with_cond:  # one predicate: does any row of the batch filter at all?
        cut, z = lax.cond(jnp.any(any_filter), filtered, lambda z: (no_cut, z), z)
    else:
        cut, z = filtered(z)
    return dict(max=m, z=z, min_e=min_e, cut=cut, argmax=argmax.astype(jnp.int32), valid=valid.astype(jnp.int32))


# --- kernel 4: the walk ----------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _slot_prob(mode, values_ref, stats, row, tok, shift):
    """p(tok | slot row) for one scalar token: a read of probs, or the processed value from the logit."""
    x = values_ref[row, tok].astype(jnp.float32)
    if mode == "probs":
        return x
    max_ref, z_ref, min_e_ref, cut_ref, argmax_ref, temperature = stats
    greedy = temperature == 0.0
    inv_t = jnp.where(greedy, 1.0, temperature)
    e = jnp.where(x > -jnp.inf, jnp.exp((x - max_ref[row]) / inv_t), 0.0)
    kept = (logit_key(x, shift) >= cut_ref[row]) & (e >= min_e_ref[row])
    p = jnp.where(kept, e / z_ref[row], 0.0)
    return jnp.where(greedy, (tok == argmax_ref[row]).astype(jnp.float32), p)


def _walk_kernel(
    *refs, mode: str, vocab: int, slots: int, max_accept: int, threshold_single: float, threshold_acc: float
):
    if mode == "logits":
        (
            cand_ref,  # i32 [N]: token of each slot
            first_ref,  # i32 [N]: first child in verification order, -1 = none
            sib_ref,  # i32 [N]: next sibling in verification order, -1 = none
            coins_ref,  # f32 [N]: coin i decides among slot i's children
            temp_ref,  # f32 []: this row's temperature (0 = greedy)
            values_ref,  # [N, V] bf16 / f32: target logits at every slot
            max_ref,
            z_ref,
            min_e_ref,  # f32 [N]: row statistics (see row_stats)
            cut_ref,
            argmax_ref,  # i32 [N]
            accept_ref,  # out i32 [S_pad]: accepted slots (0 first), -1 after
            walk_ref,  # out i32 [4]: (num_accepted, final row, excluded count, last rejected token)
            excl_ref,  # out i32 [N_pad]: tokens rejected at the final row
        ) = refs
        stats = (max_ref, z_ref, min_e_ref, cut_ref, argmax_ref, temp_ref[...])
        shift = 16 if values_ref.dtype == jnp.bfloat16 else 0
    else:
        (
            cand_ref,
            first_ref,
            sib_ref,
            coins_ref,
            values_ref,  # f32 [N, V]: processed target probabilities
            accept_ref,
            walk_ref,
            excl_ref,
        ) = refs
        stats, shift = None, 0

    steps = max_accept + 1
    for s in range(accept_ref.shape[0]):
        accept_ref[s] = jnp.int32(0 if s == 0 else -1)

    # the walk: every iteration tests one node (a while loop: it stops when the walk ends, typically after
    # a few nodes; each iteration is a chain of dependent scalar loads, ~0.3 us on an H200)
    slots = cand_ref.shape[0]

    def more(state):
        cur, done, iteration = state[0], state[4], state[7]
        # a well-formed tree ends the walk within its N - 1 non-root nodes; the bound ends a malformed one's (a
        # sibling cycle, under jit where its lists cannot be checked: it would spin forever) and keeps the
        # rejected-token list within its N entries
        return ~done & (cur >= 0) & (iteration < slots)

    def body(state):
        cur, row, prob_acc, n_acc, done, last_rejected, n_excl, iteration = state
        active = ~done & (cur >= 0)
        node = jnp.maximum(cur, 0)
        tok = cand_ref[node]
        p = jnp.where(active, _slot_prob(mode, values_ref, stats, row, jnp.clip(tok, 0, vocab - 1), shift), 0.0)
        acc = prob_acc + p
        take = active & (p > 0) & ((coins_ref[row] < acc / max(threshold_acc, 1e-9)) | (p >= threshold_single))
        reject = active & ~take
        n_acc = n_acc + take.astype(jnp.int32)

        @pl.when(take)
        def _():
            accept_ref[n_acc] = node

        @pl.when(reject)
        def _():
            excl_ref[n_excl] = tok

        n_excl = jnp.where(take, 0, n_excl + reject.astype(jnp.int32))
        last_rejected = jnp.where(take, -1, jnp.where(reject & (p > 0), tok, last_rejected))
        prob_acc = jnp.where(take, 0.0, jnp.where(reject, acc, prob_acc))
        row = jnp.where(take, node, row)
        done = done | (~done & (cur < 0)) | (take & (n_acc == steps - 1))
        cur = jnp.where(take, first_ref[node], jnp.where(reject, sib_ref[node], cur))
        return cur, row, prob_acc, n_acc, done, last_rejected, n_excl, iteration + 1

    init = (
        first_ref[0],
        jnp.int32(0),
        jnp.float32(0.0),
        jnp.int32(0),
        jnp.bool_(steps == 1),
        jnp.int32(-1),
        jnp.int32(0),
        jnp.int32(0),
    )
    # each iteration takes (moves to a child) or rejects (moves to a sibling), so the loop ends within N steps
    _, row, _, n_acc, _, last_rejected, n_excl, _ = lax.while_loop(more, body, init)
    walk_ref[0] = n_acc
    walk_ref[1] = row
    walk_ref[2] = jnp.where(n_acc == steps - 1, 0, n_excl)  # a bonus sample excludes nothing
    walk_ref[3] = last_rejected


# --- kernels 5 and 6: the final sample (u = coin * sum of the residual; first CDF crossing) ----------------------


def _residual_loader(mode, values_ref, stats, row, n_excl, excl_ref, span, block, vocab, base):
    load, num_chunks = _span_chunks(values_ref, row, span, block, vocab, 0.0 if mode == "probs" else -jnp.inf, base)
    shift = 16 if values_ref.dtype == jnp.bfloat16 else 0

    def residual(c):
        idx, in_row, x = load(c)
        if mode == "probs":
            res = jnp.where(in_row, x, 0.0)
        else:
            max_ref, z_ref, min_e_ref, cut_ref, _, temperature = stats
            inv_t = jnp.where(temperature == 0.0, 1.0, temperature)
            e = _kept_e(x, in_row, max_ref[row], inv_t, cut_ref[row], min_e_ref[row], shift)
            res = jnp.where(e > 0, e / z_ref[row], 0.0)
        return idx, lax.fori_loop(0, n_excl, lambda j, r: jnp.where(idx == excl_ref[j], 0.0, r), res)

    return residual, num_chunks


def _final_refs(refs, mode):
    """Splits the shared leading refs of kernels 5 and 6: (walk, excl, values, stats, rest)."""
    if mode == "logits":
        walk_ref, excl_ref, temp_ref, values_ref, max_ref, z_ref, min_e_ref, cut_ref, argmax_ref, *rest = refs
        return walk_ref, excl_ref, values_ref, (max_ref, z_ref, min_e_ref, cut_ref, argmax_ref, temp_ref[...]), rest
    walk_ref, excl_ref, values_ref, *rest = refs
    return walk_ref, excl_ref, values_ref, None, rest


def _residual_sums(residual, num_chunks: int, block: int):
    """(sum f32 [], last positive index i32 [] (-1 = none)) of the residual over the chunks of `residual`."""

    def body(c, carry):
        total, last = carry
        idx, res = residual(c)
        return total + res, jnp.maximum(last, jnp.where(res > 0, idx, -1))

    total, last = lax.fori_loop(
        0, num_chunks, body, (jnp.zeros((block,), jnp.float32), jnp.full((block,), -1, jnp.int32))
    )
    return jnp.sum(total), jnp.max(last)


def _first_crossing(residual, num_chunks: int, u, before, vocab: int):
    """The first token whose running residual CDF (from `before`) exceeds u, chunk by chunk, stopping at the
    chunk that holds it: i32 [] (vocab = no crossing)."""

    def cond(state):
        c, _, found, _ = state
        return (c < num_chunks) & ~found

    def body(state):
        c, running, _, _ = state
        idx, res = residual(c)
        cdf = running + jnp.cumsum(res)
        first = jnp.min(jnp.where((res > 0) & (cdf > u), idx, vocab))
        return c + 1, running + jnp.sum(res), first < vocab, first

    _, _, found, first = lax.while_loop(cond, body, (jnp.int32(0), before, jnp.bool_(False), jnp.int32(vocab)))
    return jnp.where(found, first, vocab)


def _residual_sums_kernel(*refs, mode: str, vocab: int, span: int, block: int):
    # refs: walk i32 [4], excl i32 [N_pad], (temperature f32 [], logits [N, V], stats [N] x 5) | probs [N, V];
    # out: sum f32 [] and last positive index i32 [] of the residual over this program's span
    walk_ref, excl_ref, values_ref, stats, (sum_ref, last_ref) = _final_refs(refs, mode)
    base = pl.program_id(1) * span
    sum_ref[...] = jnp.float32(0.0)
    last_ref[...] = jnp.int32(-1)

    def sums():
        residual, num_chunks = _residual_loader(
            mode, values_ref, stats, walk_ref[1], walk_ref[2], excl_ref, span, block, vocab, base
        )
        sum_ref[...], last_ref[...] = _residual_sums(residual, num_chunks, block)

    if mode == "logits":
        pl.when(stats[5] != 0.0)(sums)  # greedy rows: the final token is the argmax, no scan
    else:
        sums()


def _final_scan_kernel(*refs, mode: str, vocab: int, span: int, block: int):
    # refs: as kernel 5, then split i32 [] (the span holding the crossing, -1 = none), before f32 [] (the
    # residual mass of the spans before it), u f32 []; out: token i32 [] (vocab = no crossing found)
    walk_ref, excl_ref, values_ref, stats, (split_ref, before_ref, u_ref, token_ref) = _final_refs(refs, mode)
    token_ref[...] = jnp.int32(vocab)

    @pl.when(split_ref[...] >= 0)
    def _():
        residual, num_chunks = _residual_loader(
            mode, values_ref, stats, walk_ref[1], walk_ref[2], excl_ref, span, block, vocab, base=split_ref[...] * span
        )
        token_ref[...] = _first_crossing(residual, num_chunks, u_ref[...], before_ref[...], vocab)


def _final_single_kernel(*refs, mode: str, vocab: int, span: int, block: int):
    # refs: as kernel 5, then coin f32 []; out: token i32 [] (vocab = no crossing found), last positive index
    # i32 [] of the residual (-1 = none). Kernels 5 and 6 in one program over the whole row (layout "single").
    walk_ref, excl_ref, values_ref, stats, (coin_ref, token_ref, last_ref) = _final_refs(refs, mode)
    token_ref[...] = jnp.int32(vocab)
    last_ref[...] = jnp.int32(-1)

    def sample():
        residual, num_chunks = _residual_loader(
            mode, values_ref, stats, walk_ref[1], walk_ref[2], excl_ref, span, block, vocab, 0
        )
        total, last = _residual_sums(residual, num_chunks, block)
        token_ref[...] = _first_crossing(residual, num_chunks, coin_ref[...] * total, jnp.float32(0.0), vocab)
        last_ref[...] = last

    if mode == "logits":
        pl.when(stats[5] != 0.0)(sample)  # greedy rows: the final token is the argmax, no scan
    else:
        sample()


def _final_spans(final_specs, final_inputs, final_coins, batch, vocab, params, interpret):
    """Layout "spans": kernel 5 over (B, splits), the crossing span in XLA, kernel 6 over (B, 1) -> (token
    i32 [B] (vocab = none found), last positive index i32 [B])."""
    splits, span = _split(vocab, batch, FINAL_BLOCK)
    compiler = plgpu.CompilerParams(num_warps=4, num_stages=2)
    part = pl.BlockSpec((None, None), lambda b, s: (b, s))
    sums, last = pl.pallas_call(
        functools.partial(_residual_sums_kernel, span=span, block=FINAL_BLOCK, **params),
        grid=(batch, splits),
        in_specs=final_specs,
        out_specs=[part, part],
        out_shape=[
            jax.ShapeDtypeStruct((batch, splits), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits), jnp.int32),
        ],
        compiler_params=compiler,
        interpret=interpret,
        name=f"tree_sampling_residual_{params['mode']}",
    )(*final_inputs)
    u = final_coins * sums.sum(axis=1)
    upper = jnp.cumsum(sums, axis=1)
    crossing = (upper > u[:, None]) & (sums > 0)
    split = jnp.where(crossing.any(axis=1), jnp.argmax(crossing, axis=1), -1).astype(jnp.int32)
    before = jnp.take_along_axis(upper - sums, jnp.maximum(split, 0)[:, None], axis=1)[:, 0]
    scalar = pl.BlockSpec((None,), lambda b, s: (b,))
    token = pl.pallas_call(
        functools.partial(_final_scan_kernel, span=span, block=FINAL_BLOCK, **params),
        grid=(batch, 1),
        in_specs=final_specs + [scalar] * 3,
        out_specs=scalar,
        out_shape=jax.ShapeDtypeStruct((batch,), jnp.int32),
        compiler_params=compiler,
        interpret=interpret,
        name=f"tree_sampling_final_{params['mode']}",
    )(*final_inputs, split, before, u)
    return token, last.max(axis=1)


def _walk(
    mode,
    lists,
    coins,
    final_coins,
    values,
    extra,
    *,
    max_accept,
    threshold_single,
    threshold_acc,
    interpret,
    layout,
    tiling=SINGLE_TILING,
):
    """Kernel 4 (grid (B, 1)), then layout "spans": kernel 5 (grid (B, splits)), the crossing span in XLA,
    kernel 6 (grid (B, 1)); layout "single": kernel 5' (grid (B, 1))."""
    candidates, next_token, next_sibling = lists
    batch, slots, vocab = values.shape
    steps = max_accept + 1
    s_pad, n_pad = _next_pow2(steps), _next_pow2(slots)
    row_vec = pl.BlockSpec((None, slots), lambda b, s: (b, 0))
    row_scalar = pl.BlockSpec((None,), lambda b, s: (b,))
    slab = pl.BlockSpec((None, slots, vocab), lambda b, s: (b, 0, 0))
    if mode == "logits":
        temperature, stats = extra
        stat_arrays = [stats[k].reshape(batch, slots) for k in ("max", "z", "min_e", "cut", "argmax")]
        value_specs, value_inputs = [row_scalar, slab] + [row_vec] * 5, [temperature, values] + stat_arrays
    else:
        value_specs, value_inputs = [slab], [values]
    params = dict(mode=mode, vocab=vocab)
    compiler = plgpu.CompilerParams(num_warps=4, num_stages=2)

    walk_kernel = functools.partial(
        _walk_kernel,
        slots=slots,
        max_accept=max_accept,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        **params,
    )
    walk_inputs = (
        [candidates, next_token, next_sibling, coins]
        + ([value_inputs[0]] if mode == "logits" else [])
        + value_inputs[(1 if mode == "logits" else 0) :]
    )
    walk_specs = [row_vec] * 4 + value_specs
    accept, walk, excl = pl.pallas_call(
        walk_kernel,
        grid=(batch, 1),
        in_specs=walk_specs,
        out_specs=[
            pl.BlockSpec((None, s_pad), lambda b, s: (b, 0)),
            pl.BlockSpec((None, 4), lambda b, s: (b, 0)),
            pl.BlockSpec((None, n_pad), lambda b, s: (b, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, s_pad), jnp.int32),
            jax.ShapeDtypeStruct((batch, 4), jnp.int32),
            jax.ShapeDtypeStruct((batch, n_pad), jnp.int32),
        ],
        compiler_params=compiler,
        interpret=interpret,
        name=f"tree_sampling_walk_{mode}",
    )(*walk_inputs)

    final_specs = [
        pl.BlockSpec((None, 4), lambda b, s: (b, 0)),
        pl.BlockSpec((None, n_pad), lambda b, s: (b, 0)),
    ] + value_specs
    final_inputs = [walk, excl] + value_inputs
    if resolve_layout(layout, vocab) == "single":
        scalar = pl.BlockSpec((None,), lambda b, s: (b,))
        token, last_positive = pl.pallas_call(
            functools.partial(
                _final_single_kernel, span=pl.cdiv(vocab, FINAL_BLOCK) * FINAL_BLOCK, block=FINAL_BLOCK, **params
            ),
            grid=(batch, 1),
            in_specs=final_specs + [scalar],
            out_specs=[scalar, scalar],
            out_shape=[jax.ShapeDtypeStruct((batch,), jnp.int32)] * 2,
            compiler_params=plgpu.CompilerParams(num_warps=tiling.warps, num_stages=2),
            interpret=interpret,
            name=f"tree_sampling_final_single_{mode}",
        )(*final_inputs, final_coins)
    else:
        token, last_positive = _final_spans(final_specs, final_inputs, final_coins, batch, vocab, params, interpret)
    num_accepted, final_row, last_rejected = walk[:, 0], walk[:, 1], walk[:, 3]
    # no crossing (u at the very top of the CDF, rounding): the last token with mass, else the walk's fallbacks
    final = jnp.where(
        token < vocab,
        token,
        jnp.where(last_positive >= 0, last_positive, jnp.where(last_rejected >= 0, last_rejected, vocab - 1)),
    )
    if mode == "logits":
        argmax = jnp.take_along_axis(stats["argmax"].reshape(batch, slots), final_row[:, None], axis=1)[:, 0]
        final = jnp.where(temperature == 0.0, argmax, final)
    accept = accept[:, :steps]
    positions = jnp.arange(steps)
    accepted_tokens = jnp.take_along_axis(candidates, jnp.maximum(accept, 0), axis=1)
    shifted = jnp.concatenate([accepted_tokens[:, 1:], accepted_tokens[:, -1:]], axis=1)
    tokens = jnp.where(positions < num_accepted[:, None], shifted, -1)
    tokens = jnp.where(positions == num_accepted[:, None], final[:, None], tokens).astype(jnp.int32)
    return accept, num_accepted, tokens


def row_stats_reference(logits: jax.Array, params_rows: jax.Array) -> dict:
    """The same statistics with sorts and full-row reductions (jnp), for tests of the kernel."""
    shift = 16 if logits.dtype == jnp.bfloat16 else 0
    x = logits.astype(jnp.float32)
    temperature, top_k, top_p, min_p = (params_rows[:, i] for i in range(4))
    top_k = top_k.astype(jnp.int32)
    valid = (~jnp.isnan(x) & (x != jnp.inf)).all(-1) & (x > -jnp.inf).any(-1)
    greedy = temperature == 0
    m = jnp.where(valid, jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), -1), 0.0)
    inv_t = jnp.where(greedy, 1.0, temperature)[:, None]
    e = jnp.where(x > -jnp.inf, jnp.exp((x - m[:, None]) / inv_t), 0.0)
    key = logit_key(x, shift)
    vocab = x.shape[-1]
    sorted_key = -jnp.sort(-key, axis=-1)
    topk_on = valid & ~greedy & (top_k > 0) & (top_k < vocab)
    cut_k = jnp.where(
        topk_on, jnp.take_along_axis(sorted_key, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], -1)[:, 0], _INT32_MIN
    )
    ek = jnp.where(key >= cut_k[:, None], e, 0.0)
    above = jnp.sum(jnp.where(key[:, None, :] > key[:, :, None], ek[:, None, :], 0.0), -1)  # [R, V] mass above each
    topp_on = valid & ~greedy & (top_p < 1.0)
    keep_p = (above < top_p[:, None] * ek.sum(-1, keepdims=True)) & (key >= cut_k[:, None])
    cut_p = jnp.min(jnp.where(keep_p, key, jnp.iinfo(jnp.int32).max), -1)
    cut = jnp.where(topp_on, jnp.maximum(cut_p, cut_k), cut_k)
    min_e = jnp.where(valid & ~greedy, min_p, 0.0)
    kept = (key >= cut[:, None]) & (e >= min_e[:, None])
    return dict(
        max=m,
        z=jnp.sum(jnp.where(kept, e, 0.0), -1),
        min_e=min_e,
        cut=cut,
        argmax=jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), -1).astype(jnp.int32),
        valid=valid.astype(jnp.int32),
    )


# --- public entries -------------------------------------------------------------------------------------


def _checked_walk_statics(max_accept, threshold_single, threshold_acc) -> dict:
    """The kernels' checks of the walk's static keywords, then `walk_static_arguments`' conversion:
    {max_accept: int >= 0, threshold_single / threshold_acc: float in [0, 1]}."""
    if isinstance(max_accept, bool) or not isinstance(max_accept, (int, np.integer)) or max_accept < 0:
        raise ValueError(f"max_accept must be an integer >= 0, got {max_accept!r}")
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    return walk_static_arguments(max_accept, threshold_single, threshold_acc)


def _checked_walk_arrays(lists, values, coins, final_coins):
    """The kernels' shape checks (lists: (candidates, next_token, next_sibling) [B, N]; values: probs / logits
    [B, N, V]; coins [B, N]; final_coins [B]), then `walk_array_arguments`' conversion: ((candidates,
    next_token, next_sibling) int32 [B, N], coins f32 [B, N], final_coins f32 [B])."""
    candidates, next_token, next_sibling = lists
    if values.ndim != 3 or values.shape[:2] != candidates.shape:
        raise ValueError(
            f"probs/logits must have shape [B, N, V] with [B, N] = {tuple(candidates.shape)}, got {tuple(values.shape)}"
        )
    if next_token.shape != candidates.shape or next_sibling.shape != candidates.shape:
        raise ValueError(f"next_token and next_sibling must have the shape of candidates {tuple(candidates.shape)}")
    if coins.shape != candidates.shape or final_coins.shape != candidates.shape[:1]:
        raise ValueError(
            f"coins must be [B, N] and final_coins [B]; got {tuple(coins.shape)}, {tuple(final_coins.shape)}"
        )
    return walk_array_arguments(*lists, coins, final_coins)


# the static keywords of `_walk` (tiling optional), which the jitted entries pass through
_WALK_STATIC_ARGNAMES = ("max_accept", "threshold_single", "threshold_acc", "interpret", "layout", "tiling")


@functools.partial(jax.jit, static_argnames=_WALK_STATIC_ARGNAMES)
def _from_probs_jit(candidates, next_token, next_sibling, probs, coins, final_coins, **walk_options):
    """Mode (a) under jit: kernels 4-6 on probs f32 [B, N, V] (the other arrays as `tree_sampling_from_probs`
    takes them, converted); walk_options: `_walk`'s static keywords."""
    return _walk("probs", (candidates, next_token, next_sibling), coins, final_coins, probs, None, **walk_options)


def tree_sampling_from_probs(
    candidates,
    next_token,
    next_sibling,
    target_probs,
    coins,
    final_coins,
    *,
    max_accept: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    interpret: bool | None = None,
    layout: str = "auto",
):
    """Mode (a): the walk over processed probabilities (`walk_reference`'s arguments: candidates /
    next_token / next_sibling int32 [B, N], target_probs f32 [B, N, V], coins f32 [B, N], final_coins
    f32 [B]; static max_accept and thresholds) -> (accept_index int32 [B, S], num_accepted int32 [B],
    tokens int32 [B, S]), S = max_accept + 1. Sibling tokens must be distinct (the library's
    `verify_sampling` checks concrete inputs). layout: the final sample's "single" / "spans" / "auto"
    (`resolve_layout`)."""
    statics = _checked_walk_statics(max_accept, threshold_single, threshold_acc)
    lists, coins, final_coins = _checked_walk_arrays(
        (candidates, next_token, next_sibling), target_probs, coins, final_coins
    )
    probs = jnp.asarray(target_probs, jnp.float32)
    return _from_probs_jit(
        *lists, probs, coins, final_coins, **statics, interpret=default_interpret(interpret), layout=layout
    )


# The reference twin of mode (a) is the walk itself (pure jnp; the same arguments, array-likes converted).
tree_sampling_from_probs_reference = walk_reference


def _repeat_settings(sampling_params: jax.Array, slots: int) -> jax.Array:
    return jnp.repeat(sampling_params.astype(jnp.float32), slots, axis=0)


def params_rows(sampling_params: jax.Array, slots: int) -> jax.Array:
    """f32 [B * N, 4]: a row's (temperature, top_k, top_p, min_p) [B, 4] repeated for each of its N slots."""
    return _repeat_settings(sampling_params, slots)


@functools.partial(jax.jit, static_argnames=_WALK_STATIC_ARGNAMES + ("skip_with_cond",))
def _from_logits_jit(
    candidates,
    next_token,
    next_sibling,
    logits,
    sampling_params,
    coins,
    final_coins,
    *,
    interpret,
    layout,
    skip_with_cond,
    tiling=SINGLE_TILING,
    **walk_statics,
):
    """Mode (b) under jit: `row_stats` of logits [B, N, V] (bf16 / f32) under sampling_params f32 [B, 4], then
    kernels 4-6 (the other arrays as `tree_sampling_from_logits` takes them, converted); walk_statics:
    max_accept, threshold_single, threshold_acc. Returns `tree_sampling_from_logits`' four arrays."""
    batch, slots, vocab = logits.shape
    layout_options = dict(interpret=interpret, layout=layout, tiling=tiling)
    stats = row_stats(
        logits.reshape(batch * slots, vocab),
        sampling_params,
        skip_with_cond=skip_with_cond,
        rows_per_setting=slots,
        **layout_options,
    )
    lists = (candidates, next_token, next_sibling)
    extra = (sampling_params[:, 0], stats)
    accept, num_accepted, tokens = _walk(
        "logits", lists, coins, final_coins, logits, extra, **walk_statics, **layout_options
    )
    return accept, num_accepted, tokens, stats["valid"].reshape(batch, slots).astype(bool)


def _check_sampling_params(sampling_params, batch: int) -> None:
    if sampling_params.shape != (batch, 4):
        raise ValueError(
            f"sampling_params must be f32 [B, 4] = ({batch}, 4) (temperature, top_k, top_p, min_p), "
            f"got {tuple(sampling_params.shape)}"
        )


def tree_sampling_from_logits(
    candidates,
    next_token,
    next_sibling,
    target_logits,
    sampling_params,
    coins,
    final_coins,
    *,
    max_accept: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    interpret: bool | None = None,
    skip_with_cond: bool = True,
    layout: str = "auto",
    tiling: SingleTiling = SINGLE_TILING,
):
    """Mode (b): fused from raw logits [B, N, V] (bf16 / f32) and per-row settings sampling_params f32 [B, 4]
    (temperature, top_k, top_p, min_p; the library's `SamplingParams.as_rows()`).

    Returns (accept_index int32 [B, S], num_accepted int32 [B], tokens int32 [B, S], valid bool [B, N]).
    Where a slot's logits hold NaN / +inf or are all -inf, or the row's settings are out of range
    (`sampling_reference.valid_params`), `valid` is False; the caller (`verify_step`)
    turns rows with an invalid reachable slot into invalid rows, exactly as for the reference path.
    skip_with_cond: skip the filter passes with one lax.cond when no row filters (`row_stats`, layout
    "spans"). layout: "single" (one program per row), "spans" or "auto" (`resolve_layout`); tiling: the
    single layout's warps and search loads (`SingleTiling`).
    """
    statics = _checked_walk_statics(max_accept, threshold_single, threshold_acc)
    lists, coins, final_coins = _checked_walk_arrays(
        (candidates, next_token, next_sibling), target_logits, coins, final_coins
    )
    if target_logits.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"target_logits must be bfloat16 or float32, got {target_logits.dtype}")
    _check_sampling_params(sampling_params, candidates.shape[0])
    sampling_params = jnp.asarray(sampling_params, jnp.float32)
    accept, num_accepted, tokens, valid = _from_logits_jit(
        *lists,
        target_logits,
        sampling_params,
        coins,
        final_coins,
        **statics,
        interpret=default_interpret(interpret),
        skip_with_cond=bool(skip_with_cond),
        layout=layout,
        tiling=tiling,
    )
    return accept, num_accepted, tokens, valid & _params_ok(sampling_params)[:, None]


def _params_ok(sampling_params: jax.Array) -> jax.Array:
    """bool [B]: `valid_params` of the rows (temperature, top_k, top_p, min_p) f32 [B, 4]."""
    temperature, top_k, top_p, min_p = (sampling_params[:, i] for i in range(4))
    return valid_params(temperature, top_k, top_p, min_p)


def tree_sampling_from_logits_reference(
    candidates,
    next_token,
    next_sibling,
    target_logits,
    sampling_params,
    coins,
    final_coins,
    *,
    max_accept: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
):
    """The reference twin of mode (b): `walk_reference(processed_probs_reference(logits, ...), ...)`, plus
    `valid_rows(logits)` and `valid_params`; same returns as `tree_sampling_from_logits`."""
    _check_sampling_params(sampling_params, candidates.shape[0])
    temperature, top_k, top_p, min_p = (sampling_params[:, i] for i in range(4))
    probs = processed_probs_reference(target_logits, temperature, top_k.astype(jnp.int32), top_p, min_p)
    statics = walk_static_arguments(max_accept, threshold_single, threshold_acc)
    accept, num_accepted, tokens = walk_reference(
        candidates, next_token, next_sibling, probs, coins, final_coins, **statics
    )
    return accept, num_accepted, tokens, valid_rows(target_logits) & _params_ok(sampling_params)[:, None]
