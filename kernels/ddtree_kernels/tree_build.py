"""Pallas kernels for DDTree construction: per-depth top-K and the best-first selection, held on chip.

The tree of a row is the `budget` best prefixes of the best-first heap over the per-depth top-K of the
drafter's float32 log-probabilities: key(p) = (-logw(p), ranks tuple of p), lexicographic, where
logw(child) = logw(parent) + lp[depth, rank] in float32 and a prefix sorts before its extensions.

Two kernels, each beside its pure-jnp twin:

  tree_topk(values [R, C], k)      -> (values [R, k], positions [R, k]): the k largest of each row, descending,
                                      equal values -> lower position first (`lax.top_k`'s order; the
                                      candidates come in token-id order, so this is the heap's rank order).
                                      One program per row, no sort of the row. k <= EXTRACT_MAX_K: the
                                      row in registers, the k best extracted one at a time. Larger k
                                      ("resident"): the k-th largest value by a bisection with the row in
                                      registers (<= 33 count reductions, whatever k), one compaction
                                      scan, the ranks by counting; method="search" streams the row
                                      instead (8 radix passes of 16 thresholds), slower wherever both fit.
  tree_slots(top_lp, top_ids, ...)  -> the DraftTree fields [B, budget + 1]: tree_select's heap with the
                                      tree laid out in the same kernel (root slot, token ids, padding, the
                                      dead-depth mask and root-only rows), so the builder is two launches
                                      after the log-softmax.
  tree_select(top_lp [B, L, K], budget)
                                   -> (level, rank, parent int32 [B, budget], logw float32 [B, budget]):
                                      the slots in pop order. One program per row runs the heap literally:
                                      the frontier (<= budget + 1 entries: parent's logw, packed
                                      (parent, rank, depth)) lives in registers; each pop is a max
                                      reduction over the frontier's monotone integer keys, and pushes the
                                      popped node's next sibling and first child. Equal log-weights are
                                      broken by the ranks tuple exactly, by walking both paths up the
                                      popped tree to where they part (only when a tie occurs).

Twins: `tree_topk_reference` (a two-key sort), `tree_select_reference`, the parallel level-by-level
formulation (the library's XLA builder), and `tree_slots_reference` (it, then the layout in XLA): the same
keys, so the same trees, bit for bit, on the same log-probabilities. Padding slots (fewer reachable prefixes
than `budget`) have logw -inf; their other fields are unspecified (`tree_slots` sets them to the pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_kernels.tiling import default_interpret

MAX_ROW = 16384  # candidates one top-K program searches (longer rows: prefilter them first)
_DIGIT_BITS = 4  # bits of the k-th largest key found per pass over the row
_FANOUT = 1 << _DIGIT_BITS
_BLOCK = 512  # row elements per load in a pass ([block, 16] comparisons)
# "auto" (`resolve_topk_method`): k up to this, extract the k best one at a time; beyond, the resident
# search. H200, V = 8,192, 15 rows (`benchmarks.bench_small_kernels`, small_kernels_a9a0d5d.json): extract
# 10.4 / 19.4 / 37.6 us at k = 16 / 32 / 64 (~0.6 us a token), resident 13.9 / 13.9 / 14.2 us, the
# streamed search 68.4 / 68.2 / 68.8 us (kept for rows the registers cannot hold).
EXTRACT_MAX_K = 16
TOPK_METHODS = ("auto", "extract", "search", "resident")  # `tree_topk(method=)`, `resolve_topk_method`
_EMPTY = np.int32(np.iinfo(np.int32).min)  # below the key of every float, -inf included


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def float_key(x: jax.Array) -> jax.Array:
    """int32 key, monotone in the float32 value x (-0.0 and +0.0 equal; -inf the smallest float)."""
    x = x.astype(jnp.float32)
    # -0.0 -> +0.0 by a select: `x + 0.0` would do it in IEEE arithmetic, but compilers may fold it away
    bits = lax.bitcast_convert_type(jnp.where(x == 0.0, jnp.float32(0.0), x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def key_float(key: jax.Array) -> jax.Array:
    """The inverse of `float_key` (-0.0 comes back as +0.0)."""
    bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


# --- kernel 1: top-K of a row -------------------------------------------------------------------------

DEAD_DEPTH = 1  # `tree_topk_logits` row flag: every logit is -inf (the depth has no candidates)
INVALID_ROW = 2  # `tree_topk_logits` row flag: a logit is NaN or +inf


def _row_values(values_ref, count: int, log_softmax: bool):
    """(values f32 [C_pad], real bool [C_pad], flags i32 []): one row as the top-K kernels rank it.
    log_softmax False: the row as given (flags 0). True: the row is raw logits (any float dtype), ranked as
    their float32 log-softmax `(x - max) - log(sum(exp(x - max)))` (jax.nn.log_softmax's formula); flags
    DEAD_DEPTH when every logit is -inf, INVALID_ROW when one is NaN or +inf (such rows are ranked as
    zeros: finite, never NaN)."""
    x = values_ref[...].astype(jnp.float32)
    real = _iota(x.shape[0]) < count
    if not log_softmax:
        return x, real, jnp.int32(0)
    invalid = jnp.max((real & ((x != x) | (x == jnp.inf))).astype(jnp.int32))  # x != x: NaN
    dead = jnp.min((~real | (x == -jnp.inf)).astype(jnp.int32))
    flags = dead * DEAD_DEPTH + invalid * INVALID_ROW
    x = jnp.where(flags == 0, x, 0.0)
    shifted = x - jnp.max(jnp.where(real, x, -jnp.inf))
    total = jnp.sum(jnp.where(real, jnp.exp(shifted), 0.0))
    return shifted - jnp.log(total), real, flags


def _extract_kernel(
    values_ref, out_values_ref, out_pos_ref, *flags_ref, k: int, count: int, block: int, interpret: bool
):
    # values_ref:     f32 [C_pad]  one row of candidates (positions >= count are padding); with flags_ref:
    #                              raw logits of any float dtype, ranked as their log-softmax (_row_values)
    # out_values_ref: f32 [K_pad]  the k largest, descending (entries >= k unspecified)
    # out_pos_ref:    i32 [K_pad]  their positions in the row
    # flags_ref:      (i32 [],)    with log_softmax only: DEAD_DEPTH | INVALID_ROW of the row
    # Small k: the row in registers, the k best extracted one at a time (two reductions each). (One argmax
    # reduction plus a re-read of the value measured 10-15% slower on an H200 at 87ce57c.)
    del block, interpret
    c_pad, k_pad = values_ref.shape[0], out_values_ref.shape[0]
    pos = _iota(c_pad)
    out = _iota(k_pad)
    values, real, flags = _row_values(values_ref, count, bool(flags_ref))
    if flags_ref:
        flags_ref[0][...] = flags
    keys = jnp.where(real, float_key(values), _EMPTY)

    def extract(i, carry):
        keys, best_keys, best_pos = carry
        best = jnp.max(keys)
        at = jnp.min(jnp.where(keys == best, pos, c_pad))  # equal values: the lowest position
        best_keys = jnp.where(out == i, best, best_keys)
        best_pos = jnp.where(out == i, at, best_pos)
        return jnp.where(pos == at, _EMPTY, keys), best_keys, best_pos

    init = (keys, jnp.full((k_pad,), _EMPTY, jnp.int32), jnp.zeros((k_pad,), jnp.int32))
    _, best_keys, best_pos = lax.fori_loop(0, k, extract, init)
    out_values_ref[...] = key_float(best_keys)
    out_pos_ref[...] = best_pos


def _topk_kernel(values_ref, out_values_ref, out_pos_ref, *, k: int, count: int, block: int, interpret: bool):
    # values_ref:     f32 [C_pad]  one row of candidates (positions >= count are padding)
    # out_values_ref: f32 [K_pad + block]  the k largest, descending (entries >= k: scratch)
    # out_pos_ref:    i32 [K_pad + block]  their positions in the row
    # (No log_softmax form: it streams the row, which the fused log-softmax would read twice more.)
    c_pad, k_pad = values_ref.shape[0], out_values_ref.shape[0] - block
    num_chunks = c_pad // block
    lanes = _iota(block)

    def chunk(c):  # (positions i32 [block], keys i32 [block]) of chunk c
        pos = c * block + lanes
        x = values_ref[pl.ds(pl.multiple_of(c * block, block), block)]
        return pos, jnp.where(pos < count, float_key(x), _EMPTY)

    # 1. the k-th largest key t, one 4-bit digit per pass (8 passes over the row, 16 thresholds each), in
    #    the sign-flipped domain where int32 bit patterns order as unsigned; keys compare as signed ints.
    digits = _iota(_FANOUT)
    prefix = jnp.int32(0)
    for shift in range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        thresholds = (prefix | (digits << shift)) ^ _EMPTY  # back to the key domain

        def count_pass(c, acc, thresholds=thresholds):
            _, keys = chunk(c)
            return acc + (keys[:, None] >= thresholds[None, :]).astype(jnp.int32)

        counts = jnp.sum(lax.fori_loop(0, num_chunks, count_pass, jnp.zeros((block, _FANOUT), jnp.int32)), axis=0)
        digit = jnp.sum((counts >= k).astype(jnp.int32)) - 1  # counts fall with the digit; counts[0] >= k
        prefix = prefix | (digit << shift)
    cut = prefix ^ _EMPTY  # k-th largest key: every key > cut is in, and the first (k - #{> cut}) equal to it

    def above_pass(c, n):
        _, keys = chunk(c)
        return n + jnp.sum((keys > cut).astype(jnp.int32))

    ties_wanted = k - lax.fori_loop(0, num_chunks, above_pass, jnp.int32(0))

    # 2. compaction: the k chosen entries, in position order, scattered to the outputs
    def compact(c, carry):
        taken, ties_seen = carry
        pos, keys = chunk(c)
        tie = keys == cut
        tie_rank = ties_seen + jnp.cumsum(tie.astype(jnp.int32)) - 1
        chosen = (keys > cut) | (tie & (tie_rank < ties_wanted))
        # every lane stores to a slot of its own: the chosen ones to [0, k), the others to the scratch tail
        slot = jnp.where(chosen, taken + jnp.cumsum(chosen.astype(jnp.int32)) - 1, k_pad + lanes)
        plgpu.store(out_values_ref.at[slot], key_float(keys))
        plgpu.store(out_pos_ref.at[slot], pos)
        return taken + jnp.sum(chosen.astype(jnp.int32)), ties_seen + jnp.sum(tie.astype(jnp.int32))

    lax.fori_loop(0, num_chunks, compact, (jnp.int32(0), jnp.int32(0)))
    _rank_in_place(out_values_ref, out_pos_ref, k=k, k_pad=k_pad, tail=block, interpret=interpret)


def _rank_in_place(out_values_ref, out_pos_ref, *, k: int, k_pad: int, tail: int, interpret: bool):
    """Step 3 of the search kernels: the k compacted entries at [0, k) of the outputs (position order)
    re-stored in descending order, by counting: entry i's place = #{j: key_j > key_i, or equal with a
    lower position}. Lanes past k store to the scratch tail [k_pad, k_pad + tail)."""
    if not interpret:
        plgpu.debug_barrier()  # the scattered entries are read back by other threads
    out_lanes = _iota(k_pad)
    in_k = out_lanes < k
    keys = jnp.where(in_k, float_key(out_values_ref[pl.ds(0, k_pad)]), _EMPTY)
    pos = out_pos_ref[pl.ds(0, k_pad)]
    rank_block = min(k_pad, 32)

    def rank_pass(j, rank):
        at = pl.multiple_of(j * rank_block, rank_block)
        other_lanes = j * rank_block + _iota(rank_block)
        other_keys = jnp.where(other_lanes < k, float_key(out_values_ref[pl.ds(at, rank_block)]), _EMPTY)
        other_pos = out_pos_ref[pl.ds(at, rank_block)]
        before = (other_keys[None, :] > keys[:, None]) | (
            (other_keys[None, :] == keys[:, None]) & (other_pos[None, :] < pos[:, None])
        )
        return rank + jnp.sum((before & (other_lanes[None, :] < k)).astype(jnp.int32), axis=1)

    rank = lax.fori_loop(0, k_pad // rank_block, rank_pass, jnp.zeros((k_pad,), jnp.int32))
    if not interpret:
        plgpu.debug_barrier()  # every thread has read the compacted entries before they are overwritten
    if tail:
        slot = jnp.where(in_k, rank, k_pad + out_lanes % tail)  # lanes past k: to the scratch tail
        plgpu.store(out_values_ref.at[slot], key_float(keys))
        plgpu.store(out_pos_ref.at[slot], pos)
    else:  # no tail (the GPU's masked scatter): lanes past k store nothing
        plgpu.store(out_values_ref.at[jnp.where(in_k, rank, 0)], key_float(keys), mask=in_k)
        plgpu.store(out_pos_ref.at[jnp.where(in_k, rank, 0)], pos, mask=in_k)


def _resident_topk_kernel(
    values_ref, out_values_ref, out_pos_ref, *flags_ref, k: int, count: int, block: int, interpret: bool
):
    # values_ref:     f32 [C_pad]  one row of candidates (positions >= count are padding); with flags_ref:
    #                              raw logits of any float dtype, ranked as their log-softmax (_row_values)
    # out_values_ref: f32 [K_pad (+ C_pad in interpret mode)]  the k largest, descending (the tail: scratch
    #                              for the lanes that store nothing, where masked scatters are not run)
    # out_pos_ref:    i32 [same]   their positions in the row
    # flags_ref:      (i32 [],)    with log_softmax only: DEAD_DEPTH | INVALID_ROW of the row
    # The search kernel with the row in registers: the k-th largest key by bisection (<= 33 steps, one
    # count reduction each, whatever k), the k chosen entries compacted in one scan, then ranked.
    del block
    c_pad = values_ref.shape[0]
    k_pad = _next_pow2(k)
    tail = out_values_ref.shape[0] - k_pad  # c_pad in interpret mode, else 0
    pos = _iota(c_pad)
    values, real, flags = _row_values(values_ref, count, bool(flags_ref))
    if flags_ref:
        flags_ref[0][...] = flags
    keys = jnp.where(real, float_key(values), _EMPTY)

    # (lo, hi]: count(keys >= lo) >= k > count(keys >= hi); the cut is lo once hi = lo + 1
    def more(state):
        i, lo, hi = state
        return (i < 33) & ((hi - lo) != 1)

    def halve(state):
        i, lo, hi = state
        t = lo + lax.shift_right_logical(hi - lo, jnp.int32(1))  # wrapping: hi - lo may exceed 2^31
        enough = jnp.sum((keys >= t).astype(jnp.int32)) >= k
        return i + 1, jnp.where(enough, t, lo), jnp.where(enough, hi, t)

    lo = jnp.min(jnp.where(real, keys, np.int32(np.iinfo(np.int32).max)))
    _, cut, _ = lax.while_loop(more, halve, (jnp.int32(0), lo, jnp.max(keys) + 1))
    ties_wanted = k - jnp.sum((keys > cut).astype(jnp.int32))
    tie = keys == cut
    chosen = (keys > cut) | (tie & (jnp.cumsum(tie.astype(jnp.int32)) - 1 < ties_wanted))
    # the chosen ones to [0, k) in position order; the others store nothing (masked) or to the scratch tail
    slot = jnp.where(chosen, jnp.cumsum(chosen.astype(jnp.int32)) - 1, k_pad + pos % max(tail, 1))
    if tail:
        plgpu.store(out_values_ref.at[slot], key_float(keys))
        plgpu.store(out_pos_ref.at[slot], pos)
    else:
        plgpu.store(out_values_ref.at[jnp.where(chosen, slot, 0)], key_float(keys), mask=chosen)
        plgpu.store(out_pos_ref.at[jnp.where(chosen, slot, 0)], pos, mask=chosen)
    _rank_in_place(out_values_ref, out_pos_ref, k=k, k_pad=k_pad, tail=tail, interpret=interpret)


def _topk_warps(c_pad: int, extract: bool) -> int:
    if extract:  # the row in registers
        return int(min(16, max(4, c_pad // 512)))
    return 4 if c_pad <= 1024 else 8


def resolve_topk_method(method: str, k: int) -> str:
    """The top-K kernel for k: "extract" up to EXTRACT_MAX_K, else "resident" (the measured rule; "search"
    streams the row in blocks, only explicitly)."""
    if method not in TOPK_METHODS:
        raise ValueError(f"method must be one of {TOPK_METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "extract" if k <= EXTRACT_MAX_K else "resident"


_TOPK_KERNELS = {"extract": _extract_kernel, "search": _topk_kernel, "resident": _resident_topk_kernel}


@functools.partial(jax.jit, static_argnames=("k", "interpret", "method", "log_softmax"))
def _tree_topk_jit(values, *, k: int, interpret: bool, method: str = "auto", log_softmax: bool = False):
    rows, count = values.shape
    c_pad, k_pad = _next_pow2(count), _next_pow2(k)
    method = resolve_topk_method(method, k)
    if log_softmax and method == "search":
        raise ValueError("the streamed search ('search') has no log_softmax form: use 'extract' or 'resident'")
    block = min(c_pad, _BLOCK)
    # the searches' compaction needs a scratch tail: a block (streamed); the row (resident, in interpret mode
    # only: on the GPU its lanes that store nothing are masked)
    width = {"extract": k_pad, "search": k_pad + block, "resident": k_pad + (c_pad if interpret else 0)}[method]
    # the resident and extract kernels read any float dtype as float32 (`_row_values`): no converted copy of the row
    padded = values if log_softmax or method != "search" else values.astype(jnp.float32)
    padded = jnp.pad(padded, ((0, 0), (0, c_pad - count))) if c_pad != count else padded
    out_shape = [jax.ShapeDtypeStruct((rows, width), jnp.float32), jax.ShapeDtypeStruct((rows, width), jnp.int32)]
    out_specs = [pl.BlockSpec((None, width), lambda r: (r, 0))] * 2
    if log_softmax:
        out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.int32))
        out_specs.append(pl.BlockSpec((None,), lambda r: (r,)))
    outs = pl.pallas_call(
        functools.partial(_TOPK_KERNELS[method], k=k, count=count, block=block, interpret=interpret),
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, c_pad), lambda r: (r, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=_topk_warps(c_pad, method != "search"), num_stages=1),
        interpret=interpret,
        name="tree_topk_logits" if log_softmax else "tree_topk",
    )(padded)
    top = (outs[0][:, :k], outs[1][:, :k]) if width != k else (outs[0], outs[1])
    return top + tuple(outs[2:])


def fits_one_row(count: int) -> bool:
    """Whether `tree_topk` takes rows of `count` candidates (padded to a power of two <= MAX_ROW)."""
    return _next_pow2(count) <= MAX_ROW


def _check_topk(values, k) -> None:
    if values.ndim != 2 or 0 in values.shape:
        raise ValueError(f"values must have shape [R, C] with R, C >= 1, got {tuple(values.shape)}")
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise ValueError(f"values must be float, got {values.dtype}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= values.shape[1]:
        raise ValueError(f"k must be an integer in [1, C={values.shape[1]}], got {k!r}")
    if not fits_one_row(values.shape[1]):
        raise ValueError(f"rows of C={values.shape[1]} candidates exceed MAX_ROW={MAX_ROW}: prefilter them first")


def tree_topk(
    values: jax.Array, k: int, *, interpret: bool | None = None, method: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """The k largest of each row (module docstring). values: float [R, C], C padded to a power of two
    <= MAX_ROW; NaN is not allowed (the caller marks such rows invalid). method: one of TOPK_METHODS
    (`resolve_topk_method`; all give the same result). Returns (float32 [R, k] descending, int32 [R, k]
    positions)."""
    _check_topk(values, k)
    resolve_topk_method(method, k)
    return _tree_topk_jit(values, k=int(k), interpret=default_interpret(interpret), method=method)


def tree_topk_logits(
    logits: jax.Array, k: int, *, interpret: bool | None = None, method: str = "auto"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`tree_topk` of each row's float32 log-softmax, computed in the same kernel from the raw logits (one
    launch instead of the log-softmax, the row-flag reductions and the top-K).

    logits: float [R, C] (bf16 or f32; C padded to a power of two <= MAX_ROW); method "auto", "extract" or
    "resident". Returns (log-probs float32 [R, k] descending, positions int32 [R, k], flags int32 [R]):
    flags DEAD_DEPTH where every logit of the row is -inf, INVALID_ROW where one is NaN or +inf; such rows'
    top-K are those of zeros (finite, meaningless: the caller reads the flags). The log-softmax is
    jax.nn.log_softmax's formula in float32 with the kernel's own summation order, so a value may differ
    from XLA's by an ulp of the log-normaliser. Twin: `tree_topk_logits_reference`."""
    _check_topk(logits, k)
    if resolve_topk_method(method, k) == "search":
        raise ValueError("tree_topk_logits: method must be 'auto', 'extract' or 'resident', got 'search'")
    return _tree_topk_jit(logits, k=int(k), interpret=default_interpret(interpret), method=method, log_softmax=True)


CHUNK = 8192  # `tree_topk_logits_chunked`'s default chunk: rows longer than MAX_ROW are cut into chunks of this


@functools.partial(jax.jit, static_argnames=("k", "chunk", "interpret", "method"))
def _tree_topk_logits_chunked_jit(logits, *, k: int, chunk: int, interpret: bool, method: str):
    rows, vocab = logits.shape
    num_chunks = -(-vocab // chunk)
    k1 = min(k, chunk)
    x = logits.astype(jnp.float32)
    # the row flags and the log-softmax's normaliser over the whole row (XLA reductions: two reads of the row)
    dead = jnp.all(x == -jnp.inf, axis=-1)
    invalid = jnp.any((x != x) | (x == jnp.inf), axis=-1)  # x != x: NaN
    flags = (jnp.where(dead, DEAD_DEPTH, 0) | jnp.where(invalid, INVALID_ROW, 0)).astype(jnp.int32)
    ok = flags == 0
    x = jnp.where(ok[:, None], x, 0.0)  # flagged rows are ranked as zeros (as `tree_topk_logits` ranks them)
    row_max = jnp.max(x, axis=-1)
    log_total = jnp.log(jnp.sum(jnp.exp(x - row_max[:, None]), axis=-1))
    # stage 1: the k1 largest log-probs of every chunk, rows x chunks programs. Ranked as log-probs (not raw logits:
    # two logits may round to one log-prob, which the whole-row order breaks by the lower token id); padding -inf,
    # never above a real entry, so a chunk's top-k1 holds every entry of the row's top-k that lies in it
    log_probs = (x - row_max[:, None]) - log_total[:, None]
    padded = jnp.pad(log_probs, ((0, 0), (0, num_chunks * chunk - vocab)), constant_values=-jnp.inf)
    values, positions = _tree_topk_jit(
        padded.reshape(rows * num_chunks, chunk), k=k1, interpret=interpret, method=method
    )
    ids = positions.reshape(rows, num_chunks, k1) + chunk * jnp.arange(num_chunks, dtype=jnp.int32)[:, None]
    ids = ids.reshape(rows, num_chunks * k1)
    # stage 2: the k largest candidates, in chunk order: equal values keep the lower token id first, the order of
    # a top-K over the whole row
    top, picked = _tree_topk_jit(values.reshape(rows, num_chunks * k1), k=k, interpret=interpret, method=method)
    top_ids = jnp.minimum(jnp.take_along_axis(ids, picked, axis=-1), vocab - 1)  # padding ids: only at -inf
    return top, top_ids, flags


def tree_topk_logits_chunked(
    logits: jax.Array, k: int, *, chunk: int = CHUNK, interpret: bool | None = None, method: str = "auto"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`tree_topk_logits` for rows of any length (a drafter's full vocabulary, V = 151,936 or 163,840), in
    two top-K launches that fill the GPU instead of one program per row: the row's float32 log-softmax, flags
    and normaliser by XLA reductions (jax.nn.log_softmax's formula), then the k largest log-probs of every chunk
    of ceil(V / chunk) (rows x chunks programs), then the k largest of those candidates. Not the default: on the
    H200 it measured slower than the prefilter path at V = 151,936 (`dispatch.AUTO_TREE_TOPK_CHUNKED`).

    logits: float [R, V] (bf16 or f32); k <= V; chunk a power of two <= MAX_ROW with ceil(V / chunk) x
    min(k, chunk) <= MAX_ROW. Returns what `tree_topk_logits` returns: (log-probs float32 [R, k]
    descending, token ids int32 [R, k], flags int32 [R]); entries that are -inf (fewer than k finite
    logits) may carry other ids than a whole-row top-K would (any id of a -inf logit: they never enter a
    tree). Twin: `tree_topk_logits_reference`."""
    if logits.ndim != 2 or 0 in logits.shape:
        raise ValueError(f"logits must have shape [R, V] with R, V >= 1, got {tuple(logits.shape)}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be float, got {logits.dtype}")
    vocab = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an integer in [1, V={vocab}], got {k!r}")
    if chunk < 1 or chunk & (chunk - 1) or chunk > MAX_ROW:
        raise ValueError(f"chunk must be a power of two <= MAX_ROW={MAX_ROW}, got {chunk}")
    if _next_pow2(-(-vocab // chunk) * min(k, chunk)) > MAX_ROW:
        raise ValueError(
            f"V={vocab} in chunks of {chunk} gives {-(-vocab // chunk)} x {min(k, chunk)} candidates, more than "
            f"MAX_ROW={MAX_ROW}: use a larger chunk"
        )
    if resolve_topk_method(method, k) == "search":
        raise ValueError("tree_topk_logits_chunked: method must be 'auto', 'extract' or 'resident', got 'search'")
    return _tree_topk_logits_chunked_jit(
        logits, k=int(k), chunk=int(chunk), interpret=default_interpret(interpret), method=method
    )


def tree_topk_logits_reference(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`tree_topk_logits`'s twin: the flags by plain reductions, dead and invalid rows read as zeros, then
    `jax.nn.log_softmax` and `tree_topk_reference`."""
    x = logits.astype(jnp.float32)
    dead = jnp.all(x == -jnp.inf, axis=-1)
    invalid = jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1)
    flags = jnp.where(dead, DEAD_DEPTH, 0) | jnp.where(invalid, INVALID_ROW, 0)
    x = jnp.where((flags == 0)[:, None], x, 0.0)
    values, positions = tree_topk_reference(jax.nn.log_softmax(x, axis=-1), k)
    return values, positions, flags.astype(jnp.int32)


def tree_topk_reference(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`tree_topk`'s twin: a two-key sort of the float32 row by (value descending, position ascending), cut
    at k (the order `lax.top_k` documents, by definition rather than by an implementation's tie-break)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= values.shape[-1]:
        raise ValueError(f"k must be an integer in [1, C={values.shape[-1]}], got {k!r}")
    x = values.astype(jnp.float32)
    positions = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    x = jnp.where(x == 0.0, jnp.float32(0.0), x)  # -0.0 equals +0.0 (a select; `+ 0.0` may be folded)
    neg, pos = lax.sort((-x, positions), dimension=x.ndim - 1, num_keys=2)
    return jnp.where(neg == 0.0, jnp.float32(0.0), -neg)[..., : int(k)], pos[..., : int(k)]


# --- kernel 2: the best-first selection ---------------------------------------------------------------


def _meta_bits(budget: int, k: int, depth_limit: int) -> tuple[int, int, int]:
    """Bits of (parent slot, rank, depth) in one int32 frontier / table entry."""
    bits = (int(budget).bit_length(), max(1, int(k - 1).bit_length()), int(depth_limit).bit_length())
    if sum(bits) > 31:
        raise ValueError(f"budget={budget}, K={k}, L={depth_limit} do not pack into 31 bits (tree_select)")
    return bits


def _select_heap(lp, emit, *, budget: int, k: int, depth_limit: int):
    """The heap of one row, popped `budget` times (the body of both selection kernels). lp(depth_index,
    rank) -> f32 scalar reads the per-depth top-K log-probabilities (-inf: no such token); each pop calls
    emit(slot, valid, depth, rank, parent, logw) -> int32 count with slot 1..budget in pop order (valid
    False: padding, the other fields unspecified). Returns the sum of the counts."""
    parent_bits, rank_bits, _ = _meta_bits(budget, k, depth_limit)
    rank_shift, depth_shift = parent_bits, parent_bits + rank_bits
    f_pad = _next_pow2(budget + 1)
    fpos = _iota(f_pad)  # frontier positions, also table slots (slot 0 = the root)

    def pack(parent, rank, depth):
        return parent | (rank << rank_shift) | (depth << depth_shift)

    def unpack(meta):
        return (
            meta & ((1 << parent_bits) - 1),
            (meta >> rank_shift) & ((1 << rank_bits) - 1),
            meta >> depth_shift,
        )

    def pick(vector, at):  # vector[at] for a scalar position (one reduction)
        return jnp.sum(jnp.where(fpos == at, vector, 0))

    def lex_less(a_meta, b_meta, t_meta):
        """ranks tuple of frontier entry a < that of b (distinct nodes), walking up the popped tree."""
        pa, ra, da = unpack(a_meta)
        pb, rb, db = unpack(b_meta)

        def up(parent):  # the node that is popped slot `parent`: its (parent, rank)
            p, r, _ = unpack(pick(t_meta, parent))
            return p, r

        def raise_deeper(c):
            pa, ra, da, pb, rb, db = c
            a_deeper = da > db
            new_pa, new_ra = up(jnp.where(a_deeper, pa, pb))
            return (
                jnp.where(a_deeper, new_pa, pa),
                jnp.where(a_deeper, new_ra, ra),
                jnp.where(a_deeper, da - 1, da),
                jnp.where(a_deeper, pb, new_pa),
                jnp.where(a_deeper, rb, new_ra),
                jnp.where(a_deeper, db, db - 1),
            )

        a_was_deeper = da > db
        pa, ra, _, pb, rb, _ = lax.while_loop(lambda c: c[2] != c[5], raise_deeper, (pa, ra, da, pb, rb, db))
        same = (pa == pb) & (ra == rb)  # one path is a prefix of the other: the shorter comes first

        def raise_both(c):
            pa, ra, pb, rb = c
            pa2, ra2 = up(pa)
            pb2, rb2 = up(pb)
            return pa2, ra2, pb2, rb2

        pa, ra, pb, rb = lax.while_loop(lambda c: ~same & (c[0] != c[2]), raise_both, (pa, ra, pb, rb))
        return jnp.where(same, ~a_was_deeper, ra < rb)

    def tie_break(tied, at, f_meta, t_meta):
        """The lexicographically first of the tied frontier entries (tied: int32 0/1 mask)."""

        def body(c):
            remaining, best = c
            j = jnp.min(jnp.where(remaining > 0, fpos, f_pad))
            better = lex_less(pick(f_meta, j), pick(f_meta, best), t_meta)
            return jnp.where(fpos == j, 0, remaining), jnp.where(better, j, best)

        remaining = jnp.where(fpos == at, 0, tied)
        _, best = lax.while_loop(lambda c: jnp.max(c[0]) > 0, body, (remaining, at))
        return best

    def pop(slot, carry):
        # Two dependent reduction stages: the best key; then, in parallel, how many entries share it and,
        # when it is alone (the common case: equal float32 log-weights are rare), its packed fields as a
        # sum over the one matching entry. Its position stays a mask (`tied`) and its parent's logw is read
        # in place by the sibling push, so neither needs a reduction; a tie finds the first position and
        # re-reads the fields after the tie walk. H200, V = 8,192: the previous form (also the position and
        # the parent's logw as reductions) 20.6 against 24.5 us at budget 64 for a three-stage pop (max;
        # first and last position; fields); an argmax over the keys plus a reversed copy was slower still
        # (29.8 us): small_kernels_98535cc.json, small_kernels_a9a0d5d.json.
        # A one-stage pop (argmax-style, one reduction pass carrying the packed fields, the next pop's best
        # key from scalars) was measured slower and removed: 5.5 against 4.8 us at budget 16, 19.5 against
        # 18.4 at 64 (tree_slots, small_kernels_25753af.json).
        f_key, f_plogw, f_meta, t_meta, n_used, counted = carry
        best = jnp.max(f_key)
        valid = best != _EMPTY
        tied = (f_key == best).astype(jnp.int32)
        num_tied = jnp.sum(tied)
        alone_meta = jnp.sum(tied * f_meta)  # the fields of a lone best entry, as a sum over it

        def tie_walk():
            at = jnp.min(jnp.where(tied > 0, fpos, f_pad))
            won = tie_break(tied, at, f_meta, t_meta)
            return (fpos == won).astype(jnp.int32), pick(f_meta, won)

        # `here`: the popped entry's position as a mask (a lone best entry: `tied` itself, no position needed)
        here, meta = lax.cond(num_tied > 1, tie_walk, lambda: (tied, alone_meta))
        here = here > 0
        logw = key_float(best)
        parent, rank, depth = unpack(meta)
        counted = counted + emit(slot, valid, depth, rank, parent, logw)
        t_meta = jnp.where(fpos == slot, meta, t_meta)

        # next sibling: the same parent's logw (the entry's own f_plogw, read in place: no reduction) plus the
        # next rank's log-prob; it takes the popped entry's place
        sib_rank = rank + 1
        lp_sib = lp(jnp.maximum(depth - 1, 0), jnp.minimum(sib_rank, k - 1))
        push_sib = valid & (sib_rank < k) & (lp_sib > -jnp.inf)
        f_key = jnp.where(here, jnp.where(push_sib, float_key(f_plogw + lp_sib), _EMPTY), f_key)
        f_meta = jnp.where(here, pack(parent, sib_rank, depth), f_meta)
        # first child: this node's logw plus the next depth's best log-prob, at the next unused position
        lp_child = lp(jnp.minimum(depth, depth_limit - 1), 0)
        push_child = valid & (depth < depth_limit) & (lp_child > -jnp.inf)
        there = (fpos == n_used) & push_child
        f_key = jnp.where(there, float_key(logw + lp_child), f_key)
        f_plogw = jnp.where(there, logw, f_plogw)
        f_meta = jnp.where(there, pack(slot, 0, depth + 1), f_meta)
        return f_key, f_plogw, f_meta, t_meta, n_used + push_child.astype(jnp.int32), counted

    lp_first = lp(0, 0)
    root_push = (fpos == 0) & (lp_first > -jnp.inf)
    f_key = jnp.where(root_push, float_key(lp_first), _EMPTY)
    f_plogw = jnp.zeros((f_pad,), jnp.float32)
    f_meta = jnp.where(fpos == 0, pack(0, 0, 1), 0)
    t_meta = jnp.zeros((f_pad,), jnp.int32)  # slot 0: the root (never read: walks stop at depth 1)
    return lax.fori_loop(1, budget + 1, pop, (f_key, f_plogw, f_meta, t_meta, jnp.int32(1), jnp.int32(0)))[-1]


def _select_kernel(lp_ref, level_ref, rank_ref, parent_ref, logw_ref, *, budget: int, k: int, depth_limit: int):
    # lp_ref:     f32 [L, K]       per-depth top-K log-probabilities, descending (-inf: no such token)
    # level_ref:  i32 [budget]     out: depth - 1 of each slot 1..budget, in pop order
    # rank_ref:   i32 [budget]     out: its rank at its depth
    # parent_ref: i32 [budget]     out: its parent's slot (0 = the root)
    # logw_ref:   f32 [budget]     out: its log-weight (-inf: padding)
    def emit(slot, valid, depth, rank, parent, logw):
        level_ref[slot - 1] = depth - 1
        rank_ref[slot - 1] = rank
        parent_ref[slot - 1] = parent
        logw_ref[slot - 1] = jnp.where(valid, logw, -jnp.inf)
        return jnp.int32(0)

    _select_heap(lambda d, r: lp_ref[d, r], emit, budget=budget, k=k, depth_limit=depth_limit)


def _slots_kernel(
    lp_ref,  # f32 [L, K]   per-depth top-K log-probabilities, descending (-inf: no such token)
    ids_ref,  # i32 [L, K]  their token ids
    live_ref,  # i32 [L]    0: the depth has no candidates (its log-probs read as -inf)
    root_ref,  # i32 []     slot 0's token
    row_ok_ref,  # i32 []   0: the row is root-only (its logits held NaN / +inf)
    tokens_ref,  # i32 [N]  out, N = budget + 1: the DraftTree fields of the row, slot 0 the root
    parents_ref,  # i32 [N] out
    depths_ref,  # i32 [N]  out
    ranks_ref,  # i32 [N]   out
    logw_ref,  # f32 [N]    out (-inf: padding)
    num_nodes_ref,  # i32 [] out: 1 + real slots
    *,
    budget: int,
    k: int,
    depth_limit: int,
    pads: tuple[int, int, int, int],
):
    pad_token, pad_parent, pad_depth, pad_rank = pads
    row_ok = row_ok_ref[...] != 0
    tokens_ref[0] = root_ref[...]
    parents_ref[0] = jnp.int32(pad_parent)
    depths_ref[0] = jnp.int32(0)
    ranks_ref[0] = jnp.int32(-1)
    logw_ref[0] = jnp.float32(0.0)

    def lp(d, r):
        return jnp.where(live_ref[d] != 0, lp_ref[d, r], -jnp.inf)

    def emit(slot, valid, depth, rank, parent, logw):
        real = valid & row_ok
        token = ids_ref[jnp.clip(depth - 1, 0, depth_limit - 1), jnp.clip(rank, 0, k - 1)]
        tokens_ref[slot] = jnp.where(real, token, pad_token)
        parents_ref[slot] = jnp.where(real, parent, pad_parent)
        depths_ref[slot] = jnp.where(real, depth, pad_depth)
        ranks_ref[slot] = jnp.where(real, rank, pad_rank)
        logw_ref[slot] = jnp.where(real, logw, -jnp.inf)
        return real.astype(jnp.int32)

    num_nodes_ref[...] = 1 + _select_heap(lp, emit, budget=budget, k=k, depth_limit=depth_limit)


def _select_warps(budget: int) -> int:
    # H200, V = 8192 (bench_tree --select-warps, BENCHMARKS.md): budget 64: 1 warp 50, 2: 53, 4: 56 us;
    # budget 256: 1 warp 211, 2: 214, 4: 180 us
    return 1 if budget < 128 else 4


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps"))
def _tree_select_jit(top_lp, *, budget: int, interpret: bool, num_warps: int | None = None):
    batch, depth_limit, k = top_lp.shape
    out_spec = pl.BlockSpec((None, budget), lambda b: (b, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, budget=budget, k=k, depth_limit=depth_limit),
        grid=(batch,),
        in_specs=[pl.BlockSpec((None, depth_limit, k), lambda b: (b, 0, 0))],
        out_specs=[out_spec] * 4,
        out_shape=[jax.ShapeDtypeStruct((batch, budget), jnp.int32)] * 3
        + [jax.ShapeDtypeStruct((batch, budget), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _select_warps(budget), num_stages=1),
        interpret=interpret,
        name="tree_select",
    )(top_lp.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("budget", "pads", "interpret"))
def _tree_slots_jit(top_lp, top_ids, live, root_tokens, row_ok, *, budget: int, pads, interpret: bool):
    batch, depth_limit, k = top_lp.shape
    slots = budget + 1
    row_spec = pl.BlockSpec((None, slots), lambda b: (b, 0))
    scalar = pl.BlockSpec((None,), lambda b: (b,))
    table = pl.BlockSpec((None, depth_limit, k), lambda b: (b, 0, 0))
    return pl.pallas_call(
        functools.partial(_slots_kernel, budget=budget, k=k, depth_limit=depth_limit, pads=pads),
        grid=(batch,),
        in_specs=[table, table, pl.BlockSpec((None, depth_limit), lambda b: (b, 0)), scalar, scalar],
        out_specs=[row_spec] * 5 + [scalar],
        out_shape=[jax.ShapeDtypeStruct((batch, slots), jnp.int32)] * 4
        + [jax.ShapeDtypeStruct((batch, slots), jnp.float32), jax.ShapeDtypeStruct((batch,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=_select_warps(budget), num_stages=1),
        interpret=interpret,
        name="tree_slots",
    )(
        top_lp.astype(jnp.float32),
        top_ids.astype(jnp.int32),
        live.astype(jnp.int32),
        root_tokens.astype(jnp.int32),
        row_ok.astype(jnp.int32),
    )


def _check_select(top_lp, budget) -> None:
    if top_lp.ndim != 3 or 0 in top_lp.shape:
        raise ValueError(f"top_lp must have shape [B, L, K] with B, L, K >= 1, got {tuple(top_lp.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    if top_lp.shape[2] > budget:
        raise ValueError(f"top_lp's K={top_lp.shape[2]} must be <= budget={budget} (K = min(budget, V))")
    _meta_bits(budget, top_lp.shape[2], top_lp.shape[1])


def tree_select(
    top_lp: jax.Array, budget: int, *, interpret: bool | None = None, num_warps: int | None = None
) -> tuple[jax.Array, ...]:
    """The best-first selection of `budget` slots per row (module docstring).

    top_lp: float32 [B, L, K], each depth's top-K log-probabilities descending (-inf: no such token),
    K = min(budget, V). Returns (level, rank, parent) int32 [B, budget] and logw float32 [B, budget], the
    slots 1..budget in pop order; padding slots have logw -inf. num_warps: the program's warps (None: the
    default for the budget; `benchmarks.bench_tree --select-warps` sweeps it)."""
    _check_select(top_lp, budget)
    return _tree_select_jit(top_lp, budget=int(budget), interpret=default_interpret(interpret), num_warps=num_warps)


def tree_slots(
    top_lp: jax.Array,
    top_ids: jax.Array,
    live: jax.Array,
    root_tokens: jax.Array,
    row_ok: jax.Array,
    budget: int,
    *,
    pads: tuple[int, int, int, int] = (0, -1, 0, -1),
    interpret: bool | None = None,
) -> tuple[jax.Array, ...]:
    """`tree_select` with the tree laid out in the same kernel: the slots as a draft tree's fields.

    top_lp: float32 [B, L, K] as for `tree_select`; top_ids: int32 [B, L, K] their token ids; live: bool
    [B, L] (False: the depth has no candidates, its log-probs are read as -inf); root_tokens: int32 [B];
    row_ok: bool [B] (False: a root-only tree). pads: the (token, parent, depth, rank) of padding slots.
    Returns tokens, parents, depths, ranks int32 [B, N] and logw float32 [B, N] (N = budget + 1: slot 0 the
    root, token root_tokens, parent pads[1], depth 0, rank -1, logw 0; then the slots in pop order, padding
    after the real ones) and num_nodes int32 [B]. Equal to `tree_slots_reference`."""
    _check_select(top_lp, budget)
    batch, depth_limit, k = top_lp.shape
    if top_ids.shape != top_lp.shape:
        raise ValueError(f"top_ids must have top_lp's shape {tuple(top_lp.shape)}, got {tuple(top_ids.shape)}")
    if live.shape != (batch, depth_limit) or root_tokens.shape != (batch,) or row_ok.shape != (batch,):
        raise ValueError(
            f"live must be [B, L] = ({batch}, {depth_limit}), root_tokens and row_ok [B] = ({batch},); got "
            f"{tuple(live.shape)}, {tuple(root_tokens.shape)}, {tuple(row_ok.shape)}"
        )
    return _tree_slots_jit(
        top_lp,
        top_ids,
        live,
        root_tokens,
        row_ok,
        budget=int(budget),
        pads=tuple(int(p) for p in pads),
        interpret=default_interpret(interpret),
    )


def tree_slots_reference(top_lp, top_ids, live, root_tokens, row_ok, budget: int, *, pads=(0, -1, 0, -1)):
    """`tree_slots`' twin: `tree_select_reference` on the masked log-probs, then the layout in XLA."""
    pad_token, pad_parent, pad_depth, pad_rank = pads
    batch, depth_limit, k = top_lp.shape
    lp = jnp.where(live[..., None], top_lp.astype(jnp.float32), -jnp.inf)
    level, rank, parent, logw = tree_select_reference(lp, budget)
    real = jnp.isfinite(logw) & row_ok[:, None]
    token = jnp.take_along_axis(top_ids.reshape(batch, depth_limit * k), level * k + rank, axis=1)

    def with_root(root_value, values, pad_value):
        values = jnp.where(real, values, pad_value)
        return jnp.concatenate([jnp.broadcast_to(root_value, (batch, 1)).astype(values.dtype), values], axis=1)

    return (
        with_root(root_tokens[:, None], token.astype(jnp.int32), pad_token),
        with_root(pad_parent, parent, pad_parent),
        with_root(0, level + 1, pad_depth),
        with_root(-1, rank, pad_rank),
        with_root(0.0, logw, -jnp.inf),
        1 + real.sum(axis=1, dtype=jnp.int32),
    )


# --- the twin: the parallel level-by-level selection ----------------------------------------------------


@functools.cache
def _candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (parent position, rank) pairs with (i + 1) * (r + 1) <= budget, r < k, i < budget."""
    parent_pos, rank = [], []
    for i in range(budget):
        for r in range(min(k, budget // (i + 1))):
            parent_pos.append(i)
            rank.append(r)
    return np.array(parent_pos, dtype=np.int32), np.array(rank, dtype=np.int32)


def _sort_key(logw: jax.Array) -> jax.Array:
    # Ascending sort key for descending logw; `+ 0.0` maps -0.0 to +0.0 so both compare equal in
    # lax.sort's total order. -inf (padding) becomes +inf and sorts last.
    return -logw + 0.0


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _select_row_reference(lp: jax.Array, budget: int) -> tuple[jax.Array, ...]:
    """One row of `tree_select_reference`. lp: float32 [L, K] per-depth top-K log-probs (rank order).

    Parallel formulation (exact). The heap pops prefixes in key order, because every prefix's heap
    predecessor (its parent, or its previous sibling) has a strictly smaller key, and float32 rounding of
    `logw + lp` is monotone. The tree S is therefore the `budget` smallest keys over all prefixes, found
    level by level: C_1 = the K depth-1 prefixes; C_{l+1} = the `budget` best keys among C_l x {ranks},
    where only pairs (i, r) with (i + 1) * (r + 1) <= budget can qualify (every (i', r') <= (i, r)
    precedes (i, r)). The union of the C_l, laid out in lexicographic (DFS preorder) order of the ranks
    tuples, goes through one `lax.top_k`, whose lower-index-first tie-break is then exactly the heap's.
    Within a level the ranks-tuple order of a child is (parent's lexicographic rank, own rank), so each
    level's selection is one two-key sort; the global preorder comes from subtree sizes.
    """
    depth_limit, k = lp.shape
    pair_parent, pair_rank = (jnp.asarray(a) for a in _candidate_pairs(budget, k))
    positions = jnp.arange(budget, dtype=jnp.int32)

    # Each level holds `budget` entries in key order: logw, rank, parent (position in the level above),
    # lexrank (position in the level's lexicographic order) and lex_order (its inverse permutation).
    pad = budget - k
    logw = jnp.concatenate([lp[0], jnp.full((pad,), -jnp.inf, jnp.float32)]) + 0.0
    rank = jnp.concatenate([jnp.arange(k, dtype=jnp.int32), jnp.zeros((pad,), jnp.int32)])
    parent = jnp.zeros((budget,), jnp.int32)
    levels = [(logw, rank, parent, positions, positions)]  # level 1: lex order = rank order

    for level in range(1, depth_limit):
        prev_logw, _, _, prev_lexrank, _ = levels[-1]
        parent_logw = prev_logw[pair_parent]
        cand_logw = jnp.where(jnp.isfinite(parent_logw), parent_logw + lp[level, pair_rank], -jnp.inf)
        cand_lex = prev_lexrank[pair_parent] * k + pair_rank  # (parent lexrank, rank): distinct
        key_sorted, lex_sorted, parent_sorted, rank_sorted = lax.sort(
            (_sort_key(cand_logw), cand_lex, pair_parent, pair_rank), num_keys=2
        )
        logw = -key_sorted[:budget] + 0.0  # the exact candidate sums, no recomputation
        lex_key = lex_sorted[:budget]
        lex_order = jnp.argsort(lex_key).astype(jnp.int32)
        lexrank = jnp.zeros((budget,), jnp.int32).at[lex_order].set(positions)
        # materialise each level: keeps XLA from re-deriving (and duplicating) earlier levels
        levels.append(
            lax.optimization_barrier((logw, rank_sorted[:budget], parent_sorted[:budget], lexrank, lex_order))
        )

    slot_level, slot_rank, slot_parent, slot_logw, _ = preorder_select(levels, budget)
    return slot_level, slot_rank, slot_parent, slot_logw


def preorder_select(levels: list[tuple[jax.Array, ...]], budget: int) -> tuple[jax.Array, ...]:
    """The `budget` best keys (-logw, ranks tuple) over a row's level-by-level candidates, in the heap's pop
    order (`_select_row_reference`'s last part, and the library's path-conditioned builder's).

    levels[l]: the kept entries of depth l + 1, `budget` each in key order: (logw f32, rank i32 (in its parent's
    child list), parent i32 (position in levels[l - 1]; level 0: 0, the root), lexrank i32 (position in the
    level's lexicographic order of ranks tuples), lex_order i32 (its inverse permutation)); -inf logw: padding.
    Returns (slot_level, slot_rank, slot_parent (slot index, 0 = root), slot_logw, chosen (pool index
    level * budget + position)), each [budget], slots 1..budget in pop order (-inf logw: padding).
    """
    # Global lexicographic (DFS preorder) index of every entry, from subtree sizes: an entry's
    # preorder = its parent's + 1 + the sizes of the siblings before it (siblings are contiguous in
    # the level's lex order, by rank).
    num_levels = len(levels)
    sizes = [None] * num_levels
    sizes[-1] = jnp.ones((budget,), jnp.int32)
    for level in range(num_levels - 2, -1, -1):
        child_parent = levels[level + 1][2]
        sizes[level] = 1 + jax.ops.segment_sum(sizes[level + 1], child_parent, num_segments=budget)
    preorder = [_exclusive_cumsum(sizes[0])]  # level 1 in lex (= rank) order, root excluded
    for level in range(1, num_levels):
        _, _, parent, _, lex_order = levels[level]
        size_lex = sizes[level][lex_order]
        parent_lex = parent[lex_order]
        before = _exclusive_cumsum(size_lex)
        first = jnp.concatenate([jnp.ones((1,), bool), parent_lex[1:] != parent_lex[:-1]])
        group_base = lax.cummax(jnp.where(first, before, 0))
        pre_lex = preorder[level - 1][parent_lex] + 1 + before - group_base
        preorder.append(jnp.zeros((budget,), jnp.int32).at[lex_order].set(pre_lex))

    # Lay the pool out in preorder: lax.top_k's lower-index-first tie-break is then the ranks-tuple
    # tie-break of the heap, and top_k returns the `budget` best keys in pop order.
    pool_logw = jnp.concatenate([lv[0] for lv in levels])
    pool_pre = jnp.concatenate(preorder)
    pool_size = pool_logw.shape[0]
    by_pre_logw = jnp.full((pool_size,), -jnp.inf, jnp.float32).at[pool_pre].set(pool_logw)
    by_pre_pool = jnp.zeros((pool_size,), jnp.int32).at[pool_pre].set(jnp.arange(pool_size, dtype=jnp.int32))
    slot_logw, chosen_pre = lax.top_k(by_pre_logw, budget)  # -inf entries (padding) come last
    chosen = by_pre_pool[chosen_pre]  # pool index (= level * budget + position) of slots 1..budget
    slot_level = chosen // budget
    slot_rank = jnp.concatenate([lv[1] for lv in levels])[chosen]
    parent_pool = jnp.concatenate([lv[2] + (lvl - 1) * budget for lvl, lv in enumerate(levels)])[chosen]
    slot_of_pool = jnp.zeros((pool_size,), jnp.int32).at[chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    slot_parent = jnp.where(slot_level > 0, slot_of_pool[jnp.maximum(parent_pool, 0)], 0)
    return slot_level, slot_rank, slot_parent, slot_logw, chosen


@functools.partial(jax.jit, static_argnames=("budget",))
def tree_select_reference(top_lp: jax.Array, budget: int) -> tuple[jax.Array, ...]:
    """`tree_select`'s twin (same arguments and results): the parallel level-by-level formulation in XLA
    (`_select_row_reference`), vmapped over rows."""
    return jax.vmap(functools.partial(_select_row_reference, budget=budget))(top_lp.astype(jnp.float32))
