"""Pallas kernels for target-only tree rejection sampling (`shared/spec/tree_sampling.md`).

Two entry points, each beside its pure-JAX reference twin:

  tree_sampling_from_probs(...)    mode (a): processed probabilities [B, N, V] in, the spec's walk out
                                   (`verify_sampling(..., impl="pallas")`).
  tree_sampling_from_logits(...)   mode (b): raw target logits [B, N, V] (bf16 or f32) and per-row
                                   SamplingParams in; the same result as
                                   `verify_sampling(processed_probs(logits, params), ...)` without
                                   ever writing the [B, N, V] probability tensor to HBM
                                   (`verify_step(..., impl="pallas")`). Greedy rows (T = 0) are the
                                   argmax walk in the same kernels.

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

Kernels (Triton lowering via `pl.pallas_call`; interpret mode on CPU):

  _row_stats_kernel   grid (B * N,): one program per slot row -> max, argmax, cut, min_e, Z, valid.
  _walk_kernel        grid (B,):     one program per batch row: the walk over the tree lists, then
                                     the final inverse-CDF sample (logits mode or probs mode).

Numerics. The reference (`processed_probs` + `verify_sampling`) sorts and cumsums; these kernels
reduce in another order, so a coin or a filter cut that lies within float32 rounding of a CDF bucket
boundary may fall on the other side. Tests require >= 99.9% row agreement and check that every
mismatch is such a boundary case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import processed_probs
from ddtree_jax.verify.result import VerifyResult
from ddtree_jax.verify.sampling import verify_sampling

STATS_BLOCK = 1024  # vocab elements per load in the row-statistics passes
SEARCH_FANOUT = 16  # thresholds per search pass (a power of two: Triton tensors are power-of-two sized)
WALK_BLOCK = 1024  # vocab elements per load in the final-sample scan

_INT32_MIN = np.iinfo(np.int32).min


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


# --- shared elementwise pieces (used by the kernels and by tests) ------------------------------------


def logit_key(x: jax.Array, shift: int) -> jax.Array:
    """int32 key, monotone in the float32 value x (ties equal; -0.0 == +0.0), arithmetic-shifted right
    by `shift` (16 for bf16 inputs, whose low 16 bits are zero; 0 for float32)."""
    x = x.astype(jnp.float32) + 0.0  # -0.0 -> +0.0
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


# --- kernel 1: per-slot row statistics -----------------------------------------------------------------


def _row_stats_kernel(
    params_ref,  # f32 [4]: temperature, top_k, top_p, min_p of this slot's batch row
    logits_ref,  # [V] bf16 / f32: this slot's target logits
    max_ref,  # f32 []: max logit (as float32)
    z_ref,  # f32 []: sum of kept e = exp((x - max) / T) (T := 1 for greedy rows)
    min_e_ref,  # f32 []: min-p threshold on e (0 = off)
    cut_ref,  # i32 []: keep iff logit_key(x) >= cut (INT32_MIN = no cut)
    argmax_ref,  # i32 []: first index of the max logit
    valid_ref,  # i32 []: 1 iff no NaN / +inf and at least one finite logit
    *,
    vocab: int,
    block: int,
    shift: int,
):
    temperature = params_ref[0]
    top_k = params_ref[1].astype(jnp.int32)
    top_p = params_ref[2]
    min_p = params_ref[3]
    greedy = temperature == 0.0
    inv_t = jnp.where(greedy, 1.0, temperature)
    num_chunks = pl.cdiv(vocab, block)

    def load(i):
        idx = i * block + jnp.arange(block, dtype=jnp.int32)
        in_row = idx < vocab
        x = plgpu.load(logits_ref.at[idx], mask=in_row, other=-jnp.inf).astype(jnp.float32)
        return idx, in_row, x

    # pass 1: online max / Z / argmax / min key / validity
    def pass1(i, carry):
        m, z, arg, kmin, bad = carry
        idx, in_row, x = load(i)
        bad = bad | (jnp.max((jnp.isnan(x) | (x == jnp.inf)).astype(jnp.int32)) > 0)
        xs = jnp.where(jnp.isnan(x), -jnp.inf, x)
        cmax = jnp.max(xs)
        carg = i * block + jnp.argmax(xs).astype(jnp.int32)
        new_m = jnp.maximum(m, cmax)
        finite = new_m > -jnp.inf
        scale = jnp.where(finite & (m > -jnp.inf), jnp.exp((m - new_m) / inv_t), 0.0)
        e = jnp.where(finite, jnp.exp((xs - new_m) / inv_t), 0.0)
        z = z * scale + jnp.sum(e)
        arg = jnp.where(cmax > m, carg, arg)
        kmin = jnp.minimum(kmin, jnp.min(jnp.where(in_row, logit_key(xs, shift), jnp.iinfo(jnp.int32).max)))
        return new_m, z, arg, kmin, bad

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(0), jnp.int32(np.iinfo(np.int32).max), jnp.bool_(False))
    m, z, arg, kmin, bad = lax.fori_loop(0, num_chunks, pass1, init)
    valid = ~bad & (m > -jnp.inf)
    m_safe = jnp.where(valid, m, 0.0)
    kmax = logit_key(m_safe, shift)

    def e_of(x):
        return jnp.where(x > -jnp.inf, jnp.exp((x - m_safe) / inv_t), 0.0)

    # top-k: the largest key t with count(key >= t) >= k (the k-th largest logit)
    topk_on = valid & ~greedy & (top_k > 0) & (top_k < vocab)

    def count_pass(t):
        def body(i, counts):
            _, in_row, x = load(i)
            key = jnp.where(in_row, logit_key(x, shift), _INT32_MIN)
            return counts + jnp.sum((key[:, None] >= t[None, :]).astype(jnp.int32), axis=0)

        return lax.fori_loop(0, num_chunks, body, jnp.zeros(t.shape, jnp.int32))

    def topk_step(state):
        lo, hi = state  # count(key >= lo) >= k, count(key >= hi) < k
        t, ok = _thresholds(lo, hi)
        sat = ok & (count_pass(t) >= top_k)
        new_lo = jnp.max(jnp.where(sat, t, lo))  # thresholds rise with j, so max = the last satisfied
        new_hi = jnp.min(jnp.where(ok & ~sat, t, hi))
        return new_lo, new_hi

    def search_running(state):
        lo, hi = state
        return (hi - lo) != 1  # wrapping difference: 1 exactly when adjacent

    cut_k, _ = lax.while_loop(
        lambda s: topk_on & search_running(s), topk_step, (jnp.where(topk_on, kmin, _INT32_MIN), kmax + 1)
    )
    cut_k = jnp.where(topk_on, cut_k, _INT32_MIN)

    # top-p: the smallest key t with mass(key > t, key >= cut_k) < top_p * Z_k
    topp_on = valid & ~greedy & (top_p < 1.0)

    def mass_pass(t):
        def body(i, carry):
            masses, zk = carry
            _, in_row, x = load(i)
            key = logit_key(x, shift)
            e = jnp.where(in_row & (key >= cut_k), e_of(x), 0.0)
            above = key[:, None] > t[None, :]
            return masses + jnp.sum(jnp.where(above, e[:, None], 0.0), axis=0), zk + jnp.sum(e)

        return lax.fori_loop(0, num_chunks, body, (jnp.zeros(t.shape, jnp.float32), jnp.float32(0.0)))

    def topp_step(state):
        lo, hi = state  # mass above lo >= P, mass above hi < P
        t, ok = _thresholds(lo, hi)
        masses, zk = mass_pass(t)
        sat = ok & (masses < top_p * zk)
        new_hi = jnp.min(jnp.where(sat, t, hi))
        new_lo = jnp.max(jnp.where(ok & ~sat, t, lo))
        return new_lo, new_hi

    topp_lo0 = jnp.where(cut_k == _INT32_MIN, kmin, cut_k) - 1
    _, cut_p = lax.while_loop(lambda s: topp_on & search_running(s), topp_step, (topp_lo0, kmax))
    cut = jnp.where(topp_on, jnp.maximum(cut_p, cut_k), cut_k)

    # min-p on e (max e = 1); then Z over everything kept
    min_e = jnp.where(valid & ~greedy, min_p, 0.0)
    any_filter = valid & ~greedy & (topk_on | topp_on | (min_p > 0))

    def z_pass():
        def body(i, acc):
            _, in_row, x = load(i)
            e = e_of(x)
            kept = in_row & (logit_key(x, shift) >= cut) & (e >= min_e)
            return acc + jnp.sum(jnp.where(kept, e, 0.0))

        return lax.fori_loop(0, num_chunks, body, jnp.float32(0.0))

    z = lax.cond(any_filter, z_pass, lambda: z)

    max_ref[...] = m_safe
    z_ref[...] = z
    min_e_ref[...] = min_e
    cut_ref[...] = cut
    argmax_ref[...] = arg
    valid_ref[...] = valid.astype(jnp.int32)


def row_stats(logits: jax.Array, params_rows: jax.Array, *, interpret: bool | None = None) -> dict:
    """Per-row statistics of logits [R, V] (bf16 / f32) under per-row params f32 [R, 4]
    (temperature, top_k, top_p, min_p) -> dict of [R] arrays: max, z, min_e, cut, argmax, valid."""
    rows, vocab = logits.shape
    if logits.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"logits must be bfloat16 or float32, got {logits.dtype}")
    shift = 16 if logits.dtype == jnp.bfloat16 else 0
    interpret = _on_cpu() if interpret is None else interpret
    kernel = functools.partial(_row_stats_kernel, vocab=vocab, block=STATS_BLOCK, shift=shift)
    scalar = pl.BlockSpec((None,), lambda r: (r,))
    names = ("max", "z", "min_e", "cut", "argmax", "valid")
    dtypes = (jnp.float32, jnp.float32, jnp.float32, jnp.int32, jnp.int32, jnp.int32)
    outs = pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, 4), lambda r: (r, 0)), pl.BlockSpec((None, vocab), lambda r: (r, 0))],
        out_specs=[scalar] * len(names),
        out_shape=[jax.ShapeDtypeStruct((rows,), d) for d in dtypes],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_sampling_row_stats",
    )(params_rows, logits)
    return dict(zip(names, outs))


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
    cut_k = jnp.where(topk_on, jnp.take_along_axis(sorted_key, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], -1)[:, 0], _INT32_MIN)
    ek = jnp.where(key >= cut_k[:, None], e, 0.0)
    above = jnp.sum(jnp.where(key[:, None, :] > key[:, :, None], ek[:, None, :], 0.0), -1)  # [R, V] mass above each
    topp_on = valid & ~greedy & (top_p < 1.0)
    keep_p = (above < top_p[:, None] * ek.sum(-1, keepdims=True)) & (key >= cut_k[:, None])
    cut_p = jnp.min(jnp.where(keep_p, key, jnp.iinfo(jnp.int32).max), -1)
    cut = jnp.where(topp_on, jnp.maximum(cut_p, cut_k), cut_k)
    min_e = jnp.where(valid & ~greedy, min_p, 0.0)
    kept = (key >= cut[:, None]) & (e >= min_e[:, None])
    return dict(max=m, z=jnp.sum(jnp.where(kept, e, 0.0), -1), min_e=min_e, cut=cut,
                argmax=jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), -1).astype(jnp.int32), valid=valid.astype(jnp.int32))


# --- kernel 2: the walk and the final sample -----------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _walk_kernel(*refs, mode: str, vocab: int, slots: int, max_accept: int, threshold_single: float,
                 threshold_acc: float, block: int):
    if mode == "logits":
        (cand_ref,  # i32 [N]: token of each slot
         first_ref,  # i32 [N]: first child in verification order, -1 = none
         sib_ref,  # i32 [N]: next sibling in verification order, -1 = none
         coins_ref,  # f32 [N]: coin i decides among slot i's children
         final_coin_ref,  # f32 []: coin of the final sample
         temp_ref,  # f32 []: this row's temperature (0 = greedy)
         values_ref,  # [N, V] bf16 / f32: target logits at every slot
         max_ref, z_ref, min_e_ref,  # f32 [N]: row statistics (see _row_stats_kernel)
         cut_ref, argmax_ref,  # i32 [N]
         accept_ref,  # out i32 [S_pad]: accepted slots (0 first), -1 after
         count_ref,  # out i32 [2]: (num_accepted, final token)
         excl_tok_ref,  # out i32 [N_pad]: tokens rejected at the current row (scratch)
         excl_p_ref,  # out f32 [N_pad]: their probabilities (scratch)
         ) = refs
        temperature = temp_ref[...]
        greedy = temperature == 0.0
        inv_t = jnp.where(greedy, 1.0, temperature)
        shift = 16 if values_ref.dtype == jnp.bfloat16 else 0
    else:
        (cand_ref, first_ref, sib_ref, coins_ref, final_coin_ref,
         values_ref,  # f32 [N, V]: processed target probabilities
         accept_ref, count_ref, excl_tok_ref, excl_p_ref) = refs
        greedy = jnp.bool_(False)

    steps = max_accept + 1
    for s in range(accept_ref.shape[0]):
        accept_ref[s] = jnp.int32(0 if s == 0 else -1)

    def prob(row, tok):
        x = values_ref[row, tok].astype(jnp.float32)
        if mode == "probs":
            return x
        e = jnp.where(x > -jnp.inf, jnp.exp((x - max_ref[row]) / inv_t), 0.0)
        kept = (logit_key(x, shift) >= cut_ref[row]) & (e >= min_e_ref[row])
        p = jnp.where(kept, e / z_ref[row], 0.0)
        return jnp.where(greedy, (tok == argmax_ref[row]).astype(jnp.float32), p)

    # the spec's walk: every iteration tests one node or ends it, so N + 1 iterations suffice
    def body(_, state):
        cur, row, prob_acc, n_acc, done, last_rejected, n_excl = state
        active = ~done & (cur >= 0)
        node = jnp.maximum(cur, 0)
        tok = cand_ref[node]
        p = jnp.where(active, prob(row, jnp.clip(tok, 0, vocab - 1)), 0.0)
        acc = prob_acc + p
        take = active & (p > 0) & ((coins_ref[row] < acc / max(threshold_acc, 1e-9)) | (p >= threshold_single))
        reject = active & ~take
        n_acc = n_acc + take.astype(jnp.int32)

        @pl.when(take)
        def _():
            accept_ref[n_acc] = node

        @pl.when(reject)
        def _():
            excl_tok_ref[n_excl] = tok
            excl_p_ref[n_excl] = p

        n_excl = jnp.where(take, 0, n_excl + reject.astype(jnp.int32))
        last_rejected = jnp.where(take, -1, jnp.where(reject & (p > 0), tok, last_rejected))
        prob_acc = jnp.where(take, 0.0, jnp.where(reject, acc, prob_acc))
        row = jnp.where(take, node, row)
        done = done | (~done & (cur < 0)) | (take & (n_acc == steps - 1))
        cur = jnp.where(take, first_ref[node], jnp.where(reject, sib_ref[node], cur))
        return cur, row, prob_acc, n_acc, done, last_rejected, n_excl

    init = (first_ref[0], jnp.int32(0), jnp.float32(0.0), jnp.int32(0), jnp.bool_(steps == 1), jnp.int32(-1), jnp.int32(0))
    _, row, _, n_acc, _, last_rejected, n_excl = lax.fori_loop(0, slots + 1, body, init)
    n_excl = jnp.where(n_acc == steps - 1, 0, n_excl)  # a bonus sample excludes nothing

    # the final sample: u = coin * sum(residual); the first token whose running CDF passes u
    num_chunks = pl.cdiv(vocab, block)

    def residual_chunk(c):
        idx = c * block + jnp.arange(block, dtype=jnp.int32)
        in_row = idx < vocab
        x = plgpu.load(values_ref.at[row, idx], mask=in_row, other=0.0 if mode == "probs" else -jnp.inf)
        x = x.astype(jnp.float32)
        if mode == "probs":
            res = jnp.where(in_row, x, 0.0)
        else:
            e = jnp.where(x > -jnp.inf, jnp.exp((x - max_ref[row]) / inv_t), 0.0)
            kept = in_row & (logit_key(x, shift) >= cut_ref[row]) & (e >= min_e_ref[row])
            res = jnp.where(kept, e / z_ref[row], 0.0)
        res = lax.fori_loop(0, n_excl, lambda j, r: jnp.where(idx == excl_tok_ref[j], 0.0, r), res)
        return idx, res

    excluded_mass = lax.fori_loop(0, n_excl, lambda j, s: s + excl_p_ref[j], jnp.float32(0.0))
    if mode == "probs":
        row_total = lax.fori_loop(0, num_chunks, lambda c, s: s + jnp.sum(residual_chunk(c)[1]), jnp.float32(0.0))
    else:
        row_total = jnp.float32(1.0) - excluded_mass  # kept e / Z sums to one
    u = final_coin_ref[...] * row_total

    def scan_cond(state):
        c, _, found, _, _ = state
        return (c < num_chunks) & ~found

    def scan_body(state):
        c, running, found, first, last_pos = state
        idx, res = residual_chunk(c)
        cdf = running + jnp.cumsum(res)
        hit = (res > 0) & (cdf > u)
        chunk_first = jnp.min(jnp.where(hit, idx, vocab))
        last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(res > 0, idx, -1)))
        return c + 1, running + jnp.sum(res), chunk_first < vocab, chunk_first, last_pos

    skip_scan = greedy if mode == "logits" else jnp.bool_(False)
    _, _, found, first, last_pos = lax.while_loop(
        lambda s: scan_cond(s) & ~skip_scan, scan_body,
        (jnp.int32(0), jnp.float32(0.0), jnp.bool_(False), jnp.int32(vocab), jnp.int32(-1)))
    final = jnp.where(found, first, jnp.where(last_pos >= 0, last_pos, jnp.where(last_rejected >= 0, last_rejected, vocab - 1)))
    if mode == "logits":
        final = jnp.where(greedy, argmax_ref[row], final)
    count_ref[0] = n_acc
    count_ref[1] = final


def _walk(mode, lists, coins, final_coins, values, extra, *, max_accept, threshold_single, threshold_acc, interpret):
    candidates, next_token, next_sibling = lists
    batch, slots, vocab = values.shape
    steps = max_accept + 1
    s_pad, n_pad = _next_pow2(steps), _next_pow2(slots)
    row_vec = pl.BlockSpec((None, slots), lambda b: (b, 0))
    row_scalar = pl.BlockSpec((None,), lambda b: (b,))
    in_specs = [row_vec] * 4 + [row_scalar]
    inputs = [candidates, next_token, next_sibling, coins, final_coins]
    if mode == "logits":
        temperature, stats = extra
        in_specs += [row_scalar, pl.BlockSpec((None, slots, vocab), lambda b: (b, 0, 0))] + [row_vec] * 5
        inputs += [temperature, values] + [stats[k].reshape(batch, slots) for k in ("max", "z", "min_e", "cut", "argmax")]
    else:
        in_specs += [pl.BlockSpec((None, slots, vocab), lambda b: (b, 0, 0))]
        inputs += [values]
    kernel = functools.partial(
        _walk_kernel, mode=mode, vocab=vocab, slots=slots, max_accept=max_accept,
        threshold_single=threshold_single, threshold_acc=threshold_acc, block=WALK_BLOCK)
    accept, counts, _, _ = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, s_pad), lambda b: (b, 0)), pl.BlockSpec((None, 2), lambda b: (b, 0)),
                   pl.BlockSpec((None, n_pad), lambda b: (b, 0)), pl.BlockSpec((None, n_pad), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, s_pad), jnp.int32), jax.ShapeDtypeStruct((batch, 2), jnp.int32),
                   jax.ShapeDtypeStruct((batch, n_pad), jnp.int32), jax.ShapeDtypeStruct((batch, n_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"tree_sampling_walk_{mode}",
    )(*inputs)
    accept = accept[:, :steps]
    num_accepted, final = counts[:, 0], counts[:, 1]
    positions = jnp.arange(steps)
    accepted_tokens = jnp.take_along_axis(candidates, jnp.maximum(accept, 0), axis=1)
    shifted = jnp.concatenate([accepted_tokens[:, 1:], accepted_tokens[:, -1:]], axis=1)
    tokens = jnp.where(positions < num_accepted[:, None], shifted, -1)
    tokens = jnp.where(positions == num_accepted[:, None], final[:, None], tokens).astype(jnp.int32)
    return VerifyResult(accept_index=accept, num_accepted=num_accepted, tokens=tokens)


# --- public entries -------------------------------------------------------------------------------------


def _check_common(candidates, next_token, next_sibling, values, coins, final_coins, max_accept, threshold_single, threshold_acc):
    if isinstance(max_accept, bool) or not isinstance(max_accept, (int, np.integer)) or max_accept < 0:
        raise ValueError(f"max_accept must be an integer >= 0, got {max_accept!r}")
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if values.ndim != 3 or values.shape[:2] != candidates.shape:
        raise ValueError(f"probs/logits must have shape [B, N, V] with [B, N] = {tuple(candidates.shape)}, got {tuple(values.shape)}")
    if next_token.shape != candidates.shape or next_sibling.shape != candidates.shape:
        raise ValueError(f"next_token and next_sibling must have the shape of candidates {tuple(candidates.shape)}")
    if coins.shape != candidates.shape or final_coins.shape != candidates.shape[:1]:
        raise ValueError(f"coins must be [B, N] and final_coins [B]; got {tuple(coins.shape)}, {tuple(final_coins.shape)}")


@functools.partial(jax.jit, static_argnames=("max_accept", "threshold_single", "threshold_acc", "interpret"))
def _from_probs_jit(candidates, next_token, next_sibling, probs, coins, final_coins, *, max_accept, threshold_single,
                    threshold_acc, interpret):
    return _walk("probs", (candidates, next_token, next_sibling), coins, final_coins, probs, None,
                 max_accept=max_accept, threshold_single=threshold_single, threshold_acc=threshold_acc, interpret=interpret)


def tree_sampling_from_probs(candidates, next_token, next_sibling, target_probs, coins, final_coins, *, max_accept: int,
                             threshold_single: float = 1.0, threshold_acc: float = 1.0,
                             interpret: bool | None = None) -> VerifyResult:
    """Mode (a): the spec's walk over processed probabilities, as `verify_sampling` (same arguments:
    candidates / next_token / next_sibling int32 [B, N], target_probs f32 [B, N, V], coins f32 [B, N],
    final_coins f32 [B]; static max_accept and thresholds) -> VerifyResult [B, max_accept + 1].
    Sibling tokens must be distinct (`verify_sampling` checks concrete inputs; so does its caller here)."""
    _check_common(candidates, next_token, next_sibling, target_probs, coins, final_coins, max_accept, threshold_single, threshold_acc)
    return _from_probs_jit(
        jnp.asarray(candidates, jnp.int32), jnp.asarray(next_token, jnp.int32), jnp.asarray(next_sibling, jnp.int32),
        jnp.asarray(target_probs, jnp.float32), jnp.asarray(coins, jnp.float32), jnp.asarray(final_coins, jnp.float32),
        max_accept=int(max_accept), threshold_single=float(threshold_single), threshold_acc=float(threshold_acc),
        interpret=_on_cpu() if interpret is None else bool(interpret))


def tree_sampling_from_probs_reference(candidates, next_token, next_sibling, target_probs, coins, final_coins, *,
                                       max_accept: int, threshold_single: float = 1.0, threshold_acc: float = 1.0) -> VerifyResult:
    """The reference twin of mode (a): `verify_sampling` itself."""
    return verify_sampling(candidates, next_token, next_sibling, target_probs, coins, final_coins, max_accept=max_accept,
                           threshold_single=threshold_single, threshold_acc=threshold_acc)


def params_rows(params: SamplingParams, slots: int) -> jax.Array:
    """f32 [B * N, 4]: (temperature, top_k, top_p, min_p) repeated for each of a row's N slots."""
    per_row = jnp.stack([params.temperature, params.top_k.astype(jnp.float32), params.top_p, params.min_p], axis=-1)
    return jnp.repeat(per_row, slots, axis=0)


@functools.partial(jax.jit, static_argnames=("max_accept", "threshold_single", "threshold_acc", "interpret"))
def _from_logits_jit(candidates, next_token, next_sibling, logits, params, coins, final_coins, *, max_accept,
                     threshold_single, threshold_acc, interpret):
    batch, slots, vocab = logits.shape
    stats = row_stats(logits.reshape(batch * slots, vocab), params_rows(params, slots), interpret=interpret)
    result = _walk("logits", (candidates, next_token, next_sibling), coins, final_coins, logits,
                   (params.temperature, stats), max_accept=max_accept, threshold_single=threshold_single,
                   threshold_acc=threshold_acc, interpret=interpret)
    return result, stats["valid"].reshape(batch, slots).astype(bool)


def tree_sampling_from_logits(candidates, next_token, next_sibling, target_logits, params: SamplingParams, coins,
                              final_coins, *, max_accept: int, threshold_single: float = 1.0, threshold_acc: float = 1.0,
                              interpret: bool | None = None) -> tuple[VerifyResult, jax.Array]:
    """Mode (b): fused from raw logits [B, N, V] (bf16 / f32) and per-row params [B].

    Returns (VerifyResult [B, max_accept + 1], valid bool [B, N]). Where a slot's logits hold NaN /
    +inf or are all -inf, `valid` is False; the caller (`verify_step`) turns rows with an invalid
    reachable slot into INVALID_TOKEN rows, exactly as for the reference path.
    """
    _check_common(candidates, next_token, next_sibling, target_logits, coins, final_coins, max_accept, threshold_single, threshold_acc)
    if target_logits.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"target_logits must be bfloat16 or float32, got {target_logits.dtype}")
    if params.temperature.shape != candidates.shape[:1]:
        raise ValueError(f"params have batch {params.temperature.shape}, the tree has batch {candidates.shape[0]}")
    return _from_logits_jit(
        jnp.asarray(candidates, jnp.int32), jnp.asarray(next_token, jnp.int32), jnp.asarray(next_sibling, jnp.int32),
        target_logits, params, jnp.asarray(coins, jnp.float32), jnp.asarray(final_coins, jnp.float32),
        max_accept=int(max_accept), threshold_single=float(threshold_single), threshold_acc=float(threshold_acc),
        interpret=_on_cpu() if interpret is None else bool(interpret))


def tree_sampling_from_logits_reference(candidates, next_token, next_sibling, target_logits, params: SamplingParams, coins,
                                        final_coins, *, max_accept: int, threshold_single: float = 1.0,
                                        threshold_acc: float = 1.0) -> tuple[VerifyResult, jax.Array]:
    """The reference twin of mode (b): `verify_sampling(processed_probs(logits, params), ...)`."""
    from ddtree_jax.sampling.probs import valid_rows

    probs = processed_probs(target_logits, params)
    result = verify_sampling(candidates, next_token, next_sibling, probs, coins, final_coins, max_accept=max_accept,
                             threshold_single=threshold_single, threshold_acc=threshold_acc, check=False)
    return result, valid_rows(target_logits)
