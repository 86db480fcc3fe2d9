"""Absorbed-MLA tree-verify attention as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel.

  out[b, t, h] = softmax_s(scale * (q_latent[b, t, h] . latent[b, s] + q_rope[b, t, h] . rope_key[b, s])
                           where mask[b, t, s] and s < kv_lengths[b]) @ latent[b, s]

The semantics of `tree_attention.tree_attention_reference((q_latent, q_rope), (latent, rope_key), None,
mask)`: one shared KV head, scores over 512 + 64 dims, values the 512-dim latent.

Kernel (`plgpu.kernel`, grid (row block, key split, B), three warpgroups per CTA; flash-decoding):
  rows        the T tree queries x H heads of a batch row, flattened (row = t * H + h) and taken 64 at
              a time (one wgmma M tile; the zero rows past T * H come from TMA's out-of-bounds fill);
  memory WG   TMA-loads the CTA's queries once, then the key split's blocks of `block_kv` keys (latent,
              rope part and the packed mask words) into a ring of `stages` shared-memory slots;
  compute WGs both compute the block's scores [64, block_kv] (wgmma over 512 + 64 dims) and the online
              softmax; WG w then accumulates P @ latent[:, 256 w : 256 (w + 1)] (wgmma, the same latent
              tile as the values), so each latent block is read from memory once for both products and
              a 64 x 256 float32 accumulator fits a warpgroup's registers;
  outputs     each split writes its normalised bf16 output and float32 log2-sum-exp per row; a jnp
              epilogue merges the splits.
split_scores=True (opt-in: on one H200 5.7-7.3% faster at N = 65 with 64 heads, 1-3% slower at N = 17, even with 8
heads; BENCHMARKS.md): each compute warpgroup scores only
its half of the block's keys ([64, block_kv / 2] over 512 + 64 dims; by default both score all of them, a
third of the tensor-core work done twice); the two exchange their row maxima, then their halves of P (bf16)
and row sums, through shared memory under two barriers a block, and each multiplies the whole P by its half of
the value columns. P lives in the rope queries' tile, which is tiled by half a key block so each half is whole
tiles; compiled, the rope queries are loaded into registers first (the register operand of their wgmma) and P
is loaded back into registers for the value wgmma (a shared-memory operand must match the latent's swizzle).
overlap=True (opt-in; on one H200 15-37% slower): FA3's intra-warpgroup overlap, block i's scores issued with
block i - 1's value product and block i's softmax run while that product is in flight.
alternate=True (opt-in; on one H200 12-19% slower, BENCHMARKS.md): FlashMLA's schedule. The key blocks go in pairs; compute warpgroup 0
scores the first, warpgroup 1 the second (each score computed once, as split_scores, but with no lock step on
the scores). WG 0 publishes its P and row max through shared memory; WG 1, its scores issued meanwhile, continues
the online softmax from WG 0's max and publishes its P and max; both then multiply both blocks' P by their half
of the values. One exchange tile (the rope queries', freed once both hold them in registers) is enough: WG 1
reads WG 0's P into registers before writing its own, and WG 0 writes the next pair's only after reading WG 1's.
The mask is passed as bit words: word[b, w, s] holds mask[b, 32 w + i, s] (and s < kv_lengths[b]) in bit
i, so a key block costs 4 bytes a key per 32 tree queries against 1,152 bytes of latent + rope, and any
dense mask is exact (prefix, tree ancestors, ragged lengths).

Constraints (ValueError otherwise): head dims 512 (latent) and 64 (rope), one KV head, bf16 inputs,
block_kv 64 (the value product contracts over the block's keys, and wgmma at the 128-byte swizzle needs a
multiple of 64: block_kv 32 runs in interpret mode but does not lower for the GPU, "K must be a multiple of
64"); T up to ~600 (its mask words share the pipeline's shared memory: a ValueError beyond). S and T * H are free (T * H is padded to a multiple of 8 for TMA's tiling; TMA
fills the rows past it with zeros and drops out-of-bounds stores); keys in the last block past kv_lengths are read (with weight exactly 0), so the
cache must hold finite values there (zero-initialised caches do).

Why not all H * T rows in one CTA (issue #20's first sketch): the value accumulator is [rows, 512] float32,
and a warpgroup holds at most 64 x 256 of it (128 registers a thread); 64 rows use the two compute
warpgroups' register budget (232 each, as FlashAttention-3). The row blocks of a split run side by side
(grid axis 0 varies fastest), so their reads of the same key blocks meet in L2.

Interpret mode (CPU; `interpret=None` picks it there) runs the same kernel with two departures that jax
0.11's interpreter needs (`mosaic_common.accumulate`): the probabilities reach the value wgmma through shared memory,
not registers, and that product is added instead of accumulated in place. The interpreter runs a CTA's
three warpgroups as threads blocked inside host callbacks: start the process with NPROC=64
(`mosaic_common.INTERPRET_NPROC`), or two waiting warpgroups can starve the third (a hang).

Under a layer scan (the models' decode step) two things would repeat in every layer: slicing the layer's cache
out of the stacked caches (a copy, since a kernel takes each operand as one buffer) and packing the mask. So
`layer=` reads layer l of stacked caches [L, B, S, 1, ...] in place (TMA from lat_ref[l, b, keys]), and
`packed_mask=` takes the caller's `pack_tree_mask(mask)`, packed once a step.

`mla_tree_attention_reference` is the twin (`tree_attention_reference`, plain XLA).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.head_projections import merge_up
from ddtree_kernels.mosaic_common import (
    INTERPRET_PARAMS,
    accumulate,
    accumulate_from_smem,
    layer_index,
    merge_splits,
    pack_mask,
    row_bits,
)
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret
from ddtree_kernels.tree_attention import tree_attention_reference, visible_lengths

LATENT_DIM = 512
ROPE_DIM = 64
BLOCK_M = 64  # rows per CTA: one wgmma M tile
BLOCK_KV = 64  # keys per pipelined block (the only size that lowers: module docstring)
HALF = LATENT_DIM // 2  # value columns per compute warpgroup
NUM_SMS = 132  # H200
MAX_STAGES = 4
DEFAULT_OVERLAP = False  # FA3's intra-warpgroup overlap (`mla_tree_attention(overlap=)`): 15-37% slower on the H200
SMEM_BUDGET = SMEM_LIMIT_BYTES - 4 * 1024  # leave room for barriers and the small tiles
LOG2E = math.log2(math.e)


def _stages(block_kv: int, num_words: int = 1, split_scores: bool = False, alternate: bool = False) -> int:
    """Key-block slots in shared memory: as many as fit beside the query tile (at most MAX_STAGES); a stage
    holds the block's latent + rope keys and its `num_words` mask words (T / 32 of them). split_scores adds
    the exchanged row statistics f32 [2, 2, 64]; its probabilities [64, block_kv] reuse the rope queries'
    tile (held in registers once loaded), which a separate buffer would push past the shared memory (the CPU
    lowering of that form asked for 235,584 bytes)."""
    resident = 2 * BLOCK_M * (LATENT_DIM + ROPE_DIM) + (4 * 4 * BLOCK_M if split_scores else 0)
    resident += 2 * 4 * BLOCK_M if alternate else 0  # the pair's row maxima (P: the rope queries' tile)
    per_stage = 2 * block_kv * (LATENT_DIM + ROPE_DIM) + 4 * num_words * block_kv
    return min(MAX_STAGES, (SMEM_BUDGET - resident) // per_stage)


def _kernel(
    lengths_ref,
    layer_ref,
    rows_ref,
    ql_ref,
    qr_ref,
    lat_ref,
    rope_ref,
    words_ref,
    o_ref,
    lse_ref,
    ql_smem,
    qr_smem,
    rows_smem,
    lat_smem,
    rope_smem,
    words_smem,
    lse_smem,
    q_barrier,
    kv_barriers,
    consumed_barriers,
    done_barrier,
    *extra,
    block_kv: int,
    blocks_per_split: int,
    capacity: int,
    num_layers: int,
    stages: int,
    num_words: int,
    scale_log2: float,
    split_scores: bool,
    overlap: bool,
    alternate: bool,
    interpret: bool,
):
    # GMEM: lengths_ref i32 [B] keys visible to the row (clamped into [0, S] here); rows_ref i32 [2, R_pad] per
    #   row: the bit (1 << t % 32) and the word (t // 32) of its tree query (bit 0: padding row); ql_ref [B, R, 512],
    #   qr_ref [B, R, 64] queries (row = t * H + h); layer_ref i32 [1] the layer read
    #   (as `lax.dynamic_index_in_dim`: negative from the end, then clamped here); lat_ref [L, B, S, 512],
    #   rope_ref [L, B, S, 64] the caches of every layer (L = 1 for one layer's), read in place;
    #   words_ref i32 [B, W, S_pad] the packed mask (S_pad: S in whole key blocks); o_ref bf16
    #   [B, splits, R, 512] each split's normalised output; lse_ref f32 [B, splits, R_pad] its log2-sum-exp
    #   (-inf: no key seen).
    # SMEM: ql_smem [2, 64, 256] (the two column halves), qr_smem [64, 64], rows_smem i32 [2, 64];
    #   per slot: lat_smem [stages, 2, block_kv, 256], rope_smem [stages, block_kv, 64],
    #   words_smem i32 [stages, W, block_kv]; lse_smem f32 [64]; interpret mode only: p_smem [2, 64, block_kv]
    #   each compute warpgroup's probabilities (see `mosaic_common.accumulate`). extra, split_scores:
    #   stat_smem f32 [2, 2, 64] (row max, row sum) x warpgroup; exchange_barriers [2] (max, then P and sums);
    #   interpret mode: p_smem [64, block_kv] (compiled: P is qr_smem's tile), each warpgroup writing its half
    #   of the keys. extra, alternate: stat_smem f32 [2, 64] (the row max after each block of the pair);
    #   exchange_barriers [2] (WG 0's P and max ready; WG 1's); interpret mode: p_x [64, block_kv] the exchanged P
    #   (compiled: qr_smem's tile), p_smem [2, 64, block_kv] each warpgroup's staged P.
    stat_smem = exchange_barriers = p_smem = p_x = None
    if alternate:
        stat_smem, exchange_barriers, *rest = extra
        assert block_kv == ROPE_DIM, (block_kv, ROPE_DIM)
        p_x, p_smem = rest if interpret else (qr_smem, None)
    elif split_scores:  # compiled: P takes the rope queries' tile once they are in registers
        stat_smem, exchange_barriers, *rest = extra
        # P [64, block_kv] in the rope queries' [64, 64] tile: the same shape while block_kv == ROPE_DIM == 64
        assert block_kv == ROPE_DIM, (block_kv, ROPE_DIM)
        p_smem = rest[0] if interpret else qr_smem
    elif interpret:
        (p_smem,) = extra
    row_block, split, b = lax.axis_index("rows"), lax.axis_index("split"), lax.axis_index("batch")
    # the split's key blocks and the layer, from scalars: done here, not as XLA fusions beside every call
    layer = layer_index(layer_ref[0], num_layers)
    wg = lax.axis_index("wg")
    r0 = row_block * BLOCK_M
    first_key = split * (blocks_per_split * block_kv)
    kv_length = jnp.clip(lengths_ref[b], 0, capacity)
    num_blocks = jnp.clip(lax.div(kv_length - first_key + (block_kv - 1), block_kv), 0, blocks_per_split)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        rows = pl.ds(r0, BLOCK_M)
        for half in range(2):
            plgpu.copy_gmem_to_smem(ql_ref.at[b, rows, pl.ds(half * HALF, HALF)], ql_smem.at[half], q_barrier)
        plgpu.copy_gmem_to_smem(qr_ref.at[b, rows], qr_smem, q_barrier)
        plgpu.copy_gmem_to_smem(rows_ref.at[:, rows], rows_smem, q_barrier)

        def load(i, slot):
            keys = pl.ds(first_key + i * block_kv, block_kv)
            barrier = kv_barriers.at[slot]
            for half in range(2):
                plgpu.copy_gmem_to_smem(
                    lat_ref.at[layer, b, keys, pl.ds(half * HALF, HALF)], lat_smem.at[slot, half], barrier
                )
            plgpu.copy_gmem_to_smem(rope_ref.at[layer, b, keys], rope_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(words_ref.at[b, :, keys], words_smem.at[slot], barrier)

        for i in range(stages):

            @pl.when(i < num_blocks)
            def _prologue():
                load(i, i)

        @pl.loop(stages, jnp.maximum(num_blocks, stages))
        def _steady(i):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(consumed_barriers.at[slot])
            load(i, slot)

        # observe the consumption of the last blocks too (every phase of a barrier is observed by each of
        # its waiters; interpret mode checks it)
        @pl.loop(jnp.maximum(num_blocks - stages, 0), num_blocks)
        def _drain(i):
            plgpu.barrier_wait(consumed_barriers.at[lax.rem(i, stages)])

    def _when(cond):
        """pl.when for a traced condition; a plain `if` for a static one (split_scores' per-warpgroup bodies)."""
        if isinstance(cond, bool):
            return lambda f: f() if cond else None
        return pl.when(cond)

    def _compute(w):
        # w: the compute warpgroup, traced (one body for both) or a static 0 / 1 (split_scores: one body each)
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_barrier)
        # per-row vectors (2 registers a thread), broadcast to the tile inside the loop: hoisted [64, block_kv]
        # tiles would hold 32 registers each for the whole loop
        row_bit = plgpu.load(rows_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
        row_word = plgpu.load(rows_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1)) if num_words > 1 else None
        # compiled split_scores: the rope queries [64, 64] as the register operand of their wgmma (32 registers
        # a thread), their tile then free for P (the first P is written after both warpgroups pass the first
        # exchange barrier, so after both loaded them)
        in_registers = (split_scores or alternate) and not interpret
        q_rope_tile = plgpu.load(qr_smem, layout=plgpu.Layout.WGMMA) if in_registers else qr_smem
        # split_scores: this warpgroup scores only its half of each key block's keys (no score computed twice)
        keys = pl.ds(w * (block_kv // 2), block_kv // 2) if split_scores else pl.ds(0, block_kv)
        tile = (BLOCK_M, keys.size)
        row_stat = plgpu.Layout.WGMMA.reduce(1)

        def issue_scores(acc_ref, slot):
            """The block's scores [64, keys] into acc_ref: three wgmmas (two latent halves, the rope part)."""
            for half in range(2):
                plgpu.wgmma(acc_ref, ql_smem.at[half], lat_smem.at[slot, half, keys].transpose((1, 0)))
            plgpu.wgmma(acc_ref, q_rope_tile, rope_smem.at[slot, keys].transpose((1, 0)))

        def block_scores(slot):
            def scores(acc_ref):
                issue_scores(acc_ref, slot)
                return acc_ref[...]

            return pl.run_scoped(scores, plgpu.ACC(tile, jnp.float32))

        def visible_scores(s, slot):
            """Raw scores -> scale * log2(e) * s where the mask words let the row see the key, else -inf."""
            word = None
            for wd in range(num_words):
                col = plgpu.load(words_smem.at[slot, wd, keys], layout=plgpu.Layout.WGMMA.reduce(0))
                col = lax.broadcast_in_dim(col, tile, [1])
                word = col if word is None else jnp.where(lax.broadcast_in_dim(row_word, tile, [0]) == wd, col, word)
            visible = (word & lax.broadcast_in_dim(row_bit, tile, [0])) != 0
            return jnp.where(visible, s * scale_log2, -jnp.inf)

        def online_softmax(s, m, l):
            """One block's online-softmax update (no split_scores): s [64, keys] (visible_scores), running row
            max m and sum l [64] -> (p bf16 [64, keys], m_new, l_new, alpha [64]: the factor for the accumulator)."""
            m_new = jnp.maximum(m, s.max(axis=1))
            base = jnp.maximum(m_new, -1e30)  # finite: rows that saw nothing yet get p = 0, not NaN
            alpha = jnp.exp2(m - base)
            p = jnp.exp2(s - lax.broadcast_in_dim(base, tile, [0]))
            return p.astype(lat_smem.dtype), m_new, l * alpha + p.sum(axis=1), alpha

        def body(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(kv_barriers.at[slot])

            s = visible_scores(block_scores(slot), slot)
            block_max = s.max(axis=1)
            if split_scores:  # the block's row maxima over both halves: exchanged through shared memory
                stat_smem.at[0, w][...] = block_max
                plgpu.barrier_arrive(exchange_barriers.at[0])
                plgpu.barrier_wait(exchange_barriers.at[0])
                block_max = jnp.maximum(
                    plgpu.load(stat_smem.at[0, 0], layout=row_stat), plgpu.load(stat_smem.at[0, 1], layout=row_stat)
                )
            m_new = jnp.maximum(m, block_max)
            base = jnp.maximum(m_new, -1e30)  # finite: rows that saw nothing yet get p = 0, not NaN
            alpha = jnp.exp2(m - base)
            p = jnp.exp2(s - lax.broadcast_in_dim(base, tile, [0]))
            if split_scores:  # both halves of P and of its row sums, in one order in both warpgroups
                stat_smem.at[1, w][...] = p.sum(axis=1)
                p_smem.at[:, keys][...] = p.astype(p_smem.dtype)
                # the other warpgroup reads P: compiled with plgpu.load, in interpret mode as a wgmma operand (the
                # async proxy, which needs this fence)
                plgpu.commit_smem()
                plgpu.barrier_arrive(exchange_barriers.at[1])
                plgpu.barrier_wait(exchange_barriers.at[1])
                p_sum = plgpu.load(stat_smem.at[1, 0], layout=row_stat) + plgpu.load(
                    stat_smem.at[1, 1], layout=row_stat
                )
            else:
                p_sum = p.sum(axis=1)
            l = l * alpha + p_sum
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if split_scores:
                # index by the traced warpgroup (== w): a static index captured by the wgmma's run_state does
                # not lower ("Shaped arrays must be represented by ir.Values")
                acc = accumulate_from_smem(acc, p_smem, lat_smem.at[slot, wg], interpret=interpret)
            else:
                p_stage = None if p_smem is None else p_smem.at[w]
                acc = accumulate(acc, p.astype(lat_smem.dtype), lat_smem.at[slot, w], p_stage)
            plgpu.barrier_arrive(consumed_barriers.at[slot])
            return acc, m_new, l

        init = (
            plgpu.layout_cast(jnp.zeros((BLOCK_M, HALF), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_stat),
            plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_stat),
        )

        def overlapped_loop(init):
            """The loop with FA3's intra-warpgroup overlap (`overlap`): block i's scores are issued together with
            block i - 1's value product, and block i's softmax runs while that product is still in flight. The
            accumulator is rescaled by block i's alpha once the product has landed, so P of block i - 1 (held in
            the registers, the product's A operand) was computed against the running max it is added under."""
            acc0, m0, l0 = init
            p_stage = None if p_smem is None else p_smem.at[w]

            def pipeline():
                plgpu.barrier_wait(kv_barriers.at[0])
                p0, m1, l1, _ = online_softmax(visible_scores(block_scores(0), 0), m0, l0)

                def step(i, carry):
                    acc, p, m, l = carry
                    slot, prev = lax.rem(i, stages), lax.rem(i + stages - 1, stages)
                    plgpu.barrier_wait(kv_barriers.at[slot])
                    if interpret:  # the same order, one product at a time (no register operand, no run_state)
                        s = block_scores(slot)
                        acc = accumulate(acc, p, lat_smem.at[prev, w], p_stage)
                        p, m, l, alpha = online_softmax(visible_scores(s, slot), m, l)
                    else:

                        def overlapped(refs):
                            acc_ref, s_ref, p_ref, m_ref, l_ref, alpha_ref = refs
                            issue_scores(s_ref, slot)  # three wgmma groups
                            plgpu.wgmma(acc_ref, p_ref[...], lat_smem.at[prev, w])  # the fourth
                            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # the scores landed; P @ V in flight
                            update = online_softmax(visible_scores(s, slot), m_ref[...], l_ref[...])
                            p_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = update

                        zeros = plgpu.layout_cast(jnp.zeros(tile, jnp.float32), plgpu.Layout.WGMMA)
                        state = (plgpu.ACC.init(acc), plgpu.ACC.init(zeros), p, m, l, m)
                        acc, _, p, m, l, alpha = pl.run_state(overlapped)(state)  # waits for the product
                    plgpu.barrier_arrive(consumed_barriers.at[prev])
                    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p, m, l

                acc, p, m, l = lax.fori_loop(1, num_blocks, step, (acc0, p0, m1, l1))
                last = lax.rem(num_blocks - 1, stages)
                acc = accumulate(acc, p, lat_smem.at[last, w], p_stage)
                plgpu.barrier_arrive(consumed_barriers.at[last])
                return acc, m, l

            return lax.cond(num_blocks > 0, pipeline, lambda: init)

        def alternate_loop(init):
            """`alternate`: the key blocks in pairs, warpgroup 0 scoring the first and warpgroup 1 the second, so each
            score is computed once and neither warpgroup waits for the other's scores. WG 0 publishes its P and
            row max; WG 1 (its scores issued meanwhile) continues the online softmax from WG 0's max, publishes its
            P and max, and both multiply both P by their half of the values. One exchange tile suffices: WG 1 reads
            WG 0's P into registers before it writes its own, and WG 0 writes the next pair's P only after reading
            WG 1's. P is summed as rounded to bf16 (the values multiplied), so both warpgroups keep equal sums."""
            stat_first, stat_second = stat_smem.at[0], stat_smem.at[1]
            p_stage = None if p_smem is None else p_smem.at[w]
            minus_inf = plgpu.layout_cast(jnp.full(tile, -jnp.inf, jnp.float32), plgpu.Layout.WGMMA)

            def rows_of(v):
                return lax.broadcast_in_dim(v, tile, [0])

            def load_p():
                return p_x[...] if interpret else plgpu.load(p_x, layout=plgpu.Layout.WGMMA)

            def pv(acc, alpha, p, slot):  # acc * alpha + p @ values[slot, this warpgroup's half]
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                return accumulate(acc, p, lat_smem.at[slot, wg], p_stage)

            def pair(j, carry):
                acc, m, l = carry
                first = 2 * j
                has_second = first + 1 < num_blocks
                slot0, slot1 = lax.rem(first, stages), lax.rem(first + 1, stages)
                if w == 0:
                    plgpu.barrier_wait(kv_barriers.at[slot0])
                    s0 = visible_scores(block_scores(slot0), slot0)
                    m0 = jnp.maximum(m, s0.max(axis=1))
                    base0 = jnp.maximum(m0, -1e30)  # finite: rows that saw nothing yet get p = 0, not NaN
                    p0 = jnp.exp2(s0 - rows_of(base0)).astype(lat_smem.dtype)
                    stat_first[...] = m0
                    p_x[...] = p0
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(exchange_barriers.at[0])
                    alpha0 = jnp.exp2(m - base0)
                    acc = pv(acc, alpha0, p0, slot0)
                    l = l * alpha0 + p0.astype(jnp.float32).sum(axis=1)
                    plgpu.barrier_arrive(consumed_barriers.at[slot0])
                    plgpu.barrier_wait(exchange_barriers.at[1])

                    def second():
                        m1 = plgpu.load(stat_second, layout=row_stat)
                        alpha1 = jnp.exp2(m0 - jnp.maximum(m1, -1e30))
                        p1 = load_p()
                        plgpu.barrier_wait(kv_barriers.at[slot1])
                        acc1 = pv(acc, alpha1, p1, slot1)
                        plgpu.barrier_arrive(consumed_barriers.at[slot1])
                        return acc1, m1, l * alpha1 + p1.astype(jnp.float32).sum(axis=1)

                    return lax.cond(has_second, second, lambda: (acc, m0, l))

                def scores_second():
                    plgpu.barrier_wait(kv_barriers.at[slot1])
                    return visible_scores(block_scores(slot1), slot1)

                s1 = lax.cond(has_second, scores_second, lambda: minus_inf)  # issued before WG 0's P is in
                plgpu.barrier_wait(exchange_barriers.at[0])
                m0 = plgpu.load(stat_first, layout=row_stat)
                p0 = load_p()
                base0 = jnp.maximum(m0, -1e30)
                m1 = jnp.maximum(m0, s1.max(axis=1))
                base1 = jnp.maximum(m1, -1e30)
                p1 = jnp.exp2(s1 - rows_of(base1)).astype(lat_smem.dtype)  # zeros without a second block
                stat_second[...] = m1
                p_x[...] = p1
                plgpu.commit_smem()
                plgpu.barrier_arrive(exchange_barriers.at[1])
                alpha0, alpha1 = jnp.exp2(m - base0), jnp.exp2(m0 - base1)
                plgpu.barrier_wait(kv_barriers.at[slot0])
                acc = pv(acc, alpha0, p0, slot0)
                plgpu.barrier_arrive(consumed_barriers.at[slot0])
                l = l * alpha0 + p0.astype(jnp.float32).sum(axis=1)

                def second():
                    acc1 = pv(acc, alpha1, p1, slot1)
                    plgpu.barrier_arrive(consumed_barriers.at[slot1])
                    return acc1, l * alpha1 + p1.astype(jnp.float32).sum(axis=1)

                acc, l = lax.cond(has_second, second, lambda: (acc, l))
                return acc, m1, l

            return lax.fori_loop(0, (num_blocks + 1) // 2, pair, init)

        if alternate:
            # both warpgroups hold their rope queries in registers before the tile takes P (done_barrier's first
            # phase; its second is the one below)
            plgpu.barrier_arrive(done_barrier)
            plgpu.barrier_wait(done_barrier)
            acc, m, l = alternate_loop(init)
        elif overlap and not split_scores:
            acc, m, l = overlapped_loop(init)
        else:
            acc, m, l = lax.fori_loop(0, num_blocks, body, init)
        # both warpgroups are done reading the query tile before it holds the output
        plgpu.barrier_arrive(done_barrier)
        plgpu.barrier_wait(done_barrier)
        inv = 1.0 / jnp.maximum(l, 1e-30)  # l = 0 only where acc = 0
        ql_smem.at[w][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(ql_smem.dtype)

        @_when(w == 0)
        def _lse():
            lse_smem[...] = m + jnp.log(l) * (1.0 / math.log(2.0))

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ql_smem.at[w], o_ref.at[b, split, pl.ds(r0, BLOCK_M), pl.ds(w * HALF, HALF)])

        @_when(w == 0)
        def _store_lse():
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(r0, BLOCK_M)])

        plgpu.wait_smem_to_gmem(0)

    if split_scores or alternate:
        for w in range(2):
            pl.when(wg == w)(functools.partial(_compute, w))
    else:
        pl.when(wg < 2)(functools.partial(_compute, wg))


def _extra_scratch(split_scores: bool, alternate: bool, interpret: bool, block_kv: int, dtype) -> tuple:
    """The kernel's `extra` scratch (its GMEM / SMEM comment). Interpret mode: P in buffers of its own (the rope
    queries stay in shared memory there: no register operand)."""
    p_tiled = dict(transforms=(plgpu.TilingTransform((8, block_kv)), plgpu.SwizzleTransform(2 * block_kv)))
    p_half_tiled = dict(transforms=(plgpu.TilingTransform((8, block_kv // 2)), plgpu.SwizzleTransform(block_kv)))
    staged = (plgpu.SMEM((2, BLOCK_M, block_kv), dtype, **p_tiled),) if interpret else ()
    if alternate:
        exchanged = (plgpu.SMEM((BLOCK_M, block_kv), dtype, **p_tiled),) if interpret else ()
        stats = (plgpu.SMEM((2, BLOCK_M), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=2))
        return stats + exchanged + staged
    if split_scores:
        halves = (plgpu.SMEM((BLOCK_M, block_kv), dtype, **p_half_tiled),) if interpret else ()
        return (plgpu.SMEM((2, 2, BLOCK_M), jnp.float32), plgpu.Barrier(num_arrivals=2, num_barriers=2)) + halves
    return staged


def split_plan(batch: int, rows: int, capacity: int, block_kv: int, num_splits: int | None) -> tuple[int, int]:
    """(splits, key blocks per split): by default enough CTAs (row blocks x splits x B) to fill the SMs once."""
    row_blocks = pl.cdiv(rows, BLOCK_M)
    total = pl.cdiv(capacity, block_kv)
    if num_splits is None:
        num_splits = max(1, NUM_SMS // (row_blocks * batch))
    per_split = pl.cdiv(total, max(1, min(num_splits, total)))
    return pl.cdiv(total, per_split), per_split


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_kv",
        "num_splits",
        "split_scores",
        "overlap",
        "alternate",
        "up_offset",
        "up_width",
        "interpret",
    ),
)
def _mla_tree_attention(
    q_latent,
    q_rope,
    latent,
    rope_key,
    mask,
    kv_lengths,
    layer,
    words,
    up_weight,
    up_layer,
    *,
    scale,
    up_offset,
    up_width,
    block_kv,
    num_splits,
    split_scores,
    overlap,
    alternate,
    interpret,
):
    # latent [L, B, S, 1, 512], rope_key [L, B, S, 1, 64]: every layer's caches; layer int32 [] the one read
    batch, steps, heads, _ = q_latent.shape
    num_layers, capacity = latent.shape[0], latent.shape[2]
    if capacity % block_kv:
        # The TMA copies tile the cache's key axis by 8 and read whole blocks: the first GPU run (H200,
        # ae031d5) refused S = context + 17 ("dimension 1 must have size smaller or a multiple of its tiling
        # 8"). Pad the keys to whole blocks (zeros: finite, never visible). This copies the cache: callers
        # should allocate capacities in whole key blocks (the benchmark does).
        extra = pl.cdiv(capacity, block_kv) * block_kv - capacity
        # (the public entry refuses this for stacked caches: it would copy every layer's)
        latent = jnp.pad(latent, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))
        rope_key = jnp.pad(rope_key, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, extra)))
        words = None if words is None else jnp.pad(words, ((0, 0), (0, 0), (0, extra)))  # zeros: never visible
        capacity += extra
    rows = steps * heads
    # TMA tiles the flattened query / output rows by 8 (the first model-level GPU run, T * H = 28, was refused
    # "dimension 1 must have size smaller or a multiple of its tiling 8"): zero rows pad them, dropped after
    tma_rows = pl.cdiv(rows, 8) * 8
    row_blocks = pl.cdiv(rows, BLOCK_M)
    rows_pad = row_blocks * BLOCK_M
    splits, per_split = split_plan(batch, rows, capacity, block_kv, num_splits)
    num_words = pl.cdiv(steps, 32)
    stages = _stages(block_kv, num_words, split_scores, alternate)
    dtype = q_latent.dtype

    kv_lengths = kv_lengths.astype(jnp.int32)  # clamped into [0, capacity] by the kernel (no block past S is read)
    # TMA needs 16-byte row strides: the capacity is whole key blocks by now (padded above), so are the words
    # words: the caller's `pack_tree_mask` (one packing for many calls, e.g. every layer of a step) or packed here
    words = pack_mask(mask, kv_lengths, num_words) if words is None else words
    row_table = jnp.asarray(row_bits(steps, heads, rows_pad))

    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    p_half_tiled = dict(transforms=(plgpu.TilingTransform((8, block_kv // 2)), plgpu.SwizzleTransform(block_kv)))
    kernel = functools.partial(
        _kernel,
        block_kv=block_kv,
        blocks_per_split=per_split,
        capacity=capacity,
        num_layers=num_layers,
        stages=stages,
        num_words=num_words,
        scale_log2=scale * LOG2E,
        split_scores=split_scores,
        overlap=overlap,
        alternate=alternate,
        interpret=interpret,
    )
    partial, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, splits, tma_rows, LATENT_DIM), dtype),
            jax.ShapeDtypeStruct((batch, splits, rows_pad), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((2, BLOCK_M, HALF), dtype, **tiled),
            # split_scores: tiled by half a key block, so each warpgroup's half of P (which reuses it) is whole tiles
            plgpu.SMEM((BLOCK_M, ROPE_DIM), dtype, **(p_half_tiled if split_scores else tiled)),
            plgpu.SMEM((2, BLOCK_M), jnp.int32),
            plgpu.SMEM((stages, 2, block_kv, HALF), dtype, **tiled),
            plgpu.SMEM((stages, block_kv, ROPE_DIM), dtype, **tiled),
            plgpu.SMEM((stages, num_words, block_kv), jnp.int32),
            plgpu.SMEM((BLOCK_M,), jnp.float32),
            plgpu.Barrier(num_arrivals=4),
            plgpu.Barrier(num_arrivals=4, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        )
        + _extra_scratch(split_scores, alternate, interpret, block_kv, dtype),
        grid=(row_blocks, splits, batch),
        grid_names=("rows", "split", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=INTERPRET_PARAMS if interpret else None,
    )(
        kv_lengths,
        jnp.asarray(layer, jnp.int32).reshape(1),
        row_table,
        jnp.pad(q_latent.reshape(batch, rows, LATENT_DIM), ((0, 0), (0, tma_rows - rows), (0, 0))),
        jnp.pad(q_rope.reshape(batch, rows, ROPE_DIM), ((0, 0), (0, tma_rows - rows), (0, 0))),
        latent.reshape(num_layers, batch, capacity, LATENT_DIM),
        rope_key.reshape(num_layers, batch, capacity, ROPE_DIM),
        words,
    )
    if up_weight is not None:  # the merge and each head's up-projection in one launch (`head_projections.merge_up`)
        out = merge_up(
            partial,
            lse,
            up_weight,
            up_layer,
            rows=rows,
            heads=heads,
            offset=up_offset,
            width=up_width,
            interpret=interpret,
        )
        return out.reshape(batch, steps, heads, up_width)
    out = merge_splits(partial[:, :, :rows], lse[:, :, :rows], axis=1)  # rows that saw no key: zero
    return out.reshape(batch, steps, heads, LATENT_DIM).astype(dtype)


class PackedTreeMask(NamedTuple):
    """A tree mask in the kernel's form (`pack_tree_mask`): words int32 [B, ceil(T / 32), S], bit i of word w
    set where tree query 32 w + i sees key s (and s < kv_lengths[b]); kv_lengths int32 [B]."""

    words: jax.Array
    kv_lengths: jax.Array


def pack_tree_mask(mask: jax.Array, kv_lengths: jax.Array | None = None) -> PackedTreeMask:
    """mask bool [B, T, S] (and kv_lengths int32 [B], default `visible_lengths(mask)`) -> the kernel's form,
    for a caller that attends under one mask many times (every layer of a step): packed once, passed to each
    call as `mla_tree_attention(..., packed_mask=)`. Inside a layer scan XLA does not hoist the packing out of
    the loop by itself (one H200 profile: a 2 us packing in every layer)."""
    if mask.ndim != 3:
        raise ValueError(f"mask must be [B, T, S], got {mask.shape}")
    kv_lengths = visible_lengths(mask) if kv_lengths is None else kv_lengths
    kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, mask.shape[-1])
    return PackedTreeMask(pack_mask(mask.astype(bool), kv_lengths, pl.cdiv(mask.shape[1], 32)), kv_lengths)


def mla_tree_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    rope_key: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    kv_lengths: jax.Array | None = None,
    block_kv: int = BLOCK_KV,
    num_splits: int | None = None,
    split_scores: bool = False,
    overlap: bool = DEFAULT_OVERLAP,
    alternate: bool = False,
    layer: jax.Array | int | None = None,
    packed_mask: PackedTreeMask | None = None,
    up_weight: jax.Array | None = None,
    up_layer: jax.Array | int | None = None,
    up_offset: int = 0,
    up_width: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Absorbed-MLA tree-verify attention on the Mosaic GPU backend (Hopper).

    Args:
      q_latent: bf16 [B, T, H, 512] queries absorbed into the latent space; q_rope: bf16 [B, T, H, 64].
      latent: bf16 [B, S, 1, 512] the latent cache (keys and values); rope_key: bf16 [B, S, 1, 64].
      mask: bool [B, T, S], True where tree query t may attend key s.
      scale: softmax scale (default (512 + 64) ** -0.5); kv_lengths: int32 [B], keys >= it are never
        seen (default `visible_lengths(mask)`).
      block_kv: keys per pipelined block (64); num_splits: key splits per row (default: fill the SMs).
      split_scores: each compute warpgroup scores half of each key block's keys (not all of them, as by
        default) and the two exchange row maxima, sums and P through shared memory: a third fewer tensor-core
        FLOPs a block, two warpgroup barriers more (module docstring).
      overlap: (excludes split_scores) each compute warpgroup issues a block's scores together with the previous
        block's value product and runs the block's softmax while that product is in flight (FA3's
        intra-warpgroup overlap; module docstring).
      alternate: the key blocks in pairs, compute warpgroup 0 scoring the first and 1 the second (each score once,
        no lock step), P and row maxima exchanged through shared memory, both warpgroups multiplying both blocks'
        P by their value half (FlashMLA's schedule; module docstring). Excludes split_scores and overlap.
      layer: with every layer's caches stacked, latent [L, B, S, 1, 512] and rope_key [L, B, S, 1, 64], the
        layer to read (int32 scalar, may be traced: a layer scan's counter; as `lax.dynamic_index_in_dim` reads
        it: negative from the end, then clamped into [0, L)). The kernel
        reads that layer in place: slicing it out first copies the layer's cache on every call, since a
        kernel takes each operand as one buffer (on one H200, a 4,224-row shard cache: 4.8 MB a layer, in
        a `loop_dynamic_slice_fusion` beside the kernel). S must then be whole key blocks (else a ValueError:
        padding would copy every layer).
      packed_mask: `pack_tree_mask(mask)` (with its kv_lengths), computed once by a caller that makes many
        calls under one mask: the kernel then reads its words, not mask's values (mask still gives the shapes);
        kv_lengths must then be None.
      up_weight: each head's up-projection applied to its output in the splits' merge (absorbed MLA's W_UV:
        one launch for both, `head_projections.merge_up`, instead of the merge's reductions and a product in XLA):
        a bf16 [H x stride, 512] weight in HF's [out, in] layout, head h's rows h x stride + up_offset ..
        + up_width (DeepSeek-V3's kv_b_proj: stride nope + v, up_offset nope, up_width v); with up_layer (an
        int32 scalar, may be traced) every layer's [L, H x stride, 512], that layer read in place. The merged
        output stays float32 into the product (no bf16 rounding between them).
      interpret: Mosaic GPU interpret mode (default: on the CPU backend).
    Returns:
      bf16 [B, T, H, 512] (softmax and sums in float32); rows with no visible key are 0. With up_weight:
      bf16 [B, T, H, up_width], the product of that output with each head's up-projection rows.
    """
    stacked = layer is not None
    if stacked:
        if latent.ndim != 5 or rope_key.ndim != 5:
            raise ValueError(
                f"with layer= latent and rope_key are every layer's caches [L, B, S, 1, ...], got {latent.shape} "
                f"and {rope_key.shape}"
            )
        if latent.shape[2] % block_kv:
            raise ValueError(
                f"with layer= the cache rows S = {latent.shape[2]} must be a multiple of block_kv = {block_kv} "
                "(padding would copy every layer's cache)"
            )
        if rope_key.shape[0] != latent.shape[0]:
            raise ValueError(f"latent and rope_key must stack the same layers, got {latent.shape} and {rope_key.shape}")
        if jnp.ndim(layer) != 0:
            raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
        stack_latent, stack_rope = latent, rope_key
        # one layer's shapes, for the checks below (no slice of the stacks is ever computed)
        latent, rope_key = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (latent, rope_key))
    if q_latent.ndim != 4 or q_latent.shape[-1] != LATENT_DIM:
        raise ValueError(f"q_latent must be [B, T, H, {LATENT_DIM}], got {q_latent.shape}")
    batch, steps, heads, _ = q_latent.shape
    if q_rope.shape != (batch, steps, heads, ROPE_DIM):
        raise ValueError(
            f"q_rope must be [B, T, H, {ROPE_DIM}] = {(batch, steps, heads, ROPE_DIM)}, got {q_rope.shape}"
        )
    if latent.ndim != 4 or latent.shape[0] != batch or latent.shape[2:] != (1, LATENT_DIM):
        raise ValueError(f"latent must be [B, S, 1, {LATENT_DIM}] with B = {batch}, got {latent.shape}")
    capacity = latent.shape[1]
    if min(batch, steps, heads, capacity) < 1:  # were an obscure zero-size reduction error
        raise ValueError(f"B, T, H and S must be >= 1, got B = {batch}, T = {steps}, H = {heads}, S = {capacity}")
    if rope_key.shape != (batch, capacity, 1, ROPE_DIM):
        raise ValueError(
            f"rope_key must be [B, S, 1, {ROPE_DIM}] = {(batch, capacity, 1, ROPE_DIM)}, got {rope_key.shape}"
        )
    if mask.shape != (batch, steps, capacity):
        raise ValueError(f"mask must be [B, T, S] = {(batch, steps, capacity)}, got {mask.shape}")
    for name, x in (("q_latent", q_latent), ("q_rope", q_rope), ("latent", latent), ("rope_key", rope_key)):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {x.dtype}")
    if block_kv != BLOCK_KV:
        raise ValueError(
            f"block_kv must be 64 (wgmma contracts the value product over whole 64-key tiles), got {block_kv}"
        )
    if alternate and (split_scores or overlap):
        raise ValueError(
            f"alternate excludes split_scores and overlap (got split_scores={split_scores}, overlap={overlap})"
        )
    if overlap and split_scores:
        raise ValueError("overlap and split_scores exclude each other (overlap is a schedule of the default path)")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if _stages(block_kv, -(-steps // 32), split_scores, alternate) < 2:
        raise ValueError(
            f"T = {steps} tree queries need {-(-steps // 32)} mask words a key: fewer than 2 pipeline stages of "
            f"{block_kv} keys fit in shared memory (the kernel is for decode / verify steps: T <= ~600)"
        )
    if kv_lengths is not None and kv_lengths.shape != (batch,):
        raise ValueError(f"kv_lengths must be [B] = ({batch},), got {kv_lengths.shape}")
    words = None
    if packed_mask is not None:
        if kv_lengths is not None:
            raise ValueError("pass kv_lengths through pack_tree_mask, not beside packed_mask")
        words, kv_lengths = packed_mask
        if words.shape != (batch, -(-steps // 32), capacity) or kv_lengths.shape != (batch,):
            raise ValueError(
                f"packed_mask must be pack_tree_mask of a [B, T, S] = {(batch, steps, capacity)} mask: words "
                f"{(batch, -(-steps // 32), capacity)}, kv_lengths ({batch},); got {words.shape}, {kv_lengths.shape}"
            )
    if up_weight is not None:
        _check_up(up_weight, up_layer, heads, up_offset, up_width)
    elif up_layer is not None or up_width is not None or up_offset:
        raise ValueError("up_layer, up_offset and up_width go with up_weight (the up-projection applied in the merge)")
    scale = (LATENT_DIM + ROPE_DIM) ** -0.5 if scale is None else float(scale)
    kv_lengths = visible_lengths(mask) if kv_lengths is None else kv_lengths
    return _mla_tree_attention(
        q_latent,
        q_rope,
        stack_latent if stacked else latent[None],
        stack_rope if stacked else rope_key[None],
        mask.astype(bool),
        kv_lengths,
        jnp.asarray(layer if stacked else 0, jnp.int32),
        words,
        up_weight,
        None if up_layer is None else jnp.asarray(up_layer, jnp.int32),
        scale=scale,
        up_offset=int(up_offset),
        up_width=None if up_width is None else int(up_width),
        block_kv=block_kv,
        num_splits=num_splits,
        split_scores=bool(split_scores),
        overlap=bool(overlap),
        alternate=bool(alternate),
        interpret=default_interpret(interpret),
    )


def _check_up(up_weight, up_layer, heads: int, up_offset: int, up_width: int | None) -> None:
    if up_width is None:
        raise ValueError("up_width (each head's output columns) must be given with up_weight")
    if up_weight.dtype != jnp.bfloat16:
        raise ValueError(f"up_weight must be bfloat16, got {up_weight.dtype}")
    want = 2 if up_layer is None else 3
    if up_weight.ndim != want or up_weight.shape[-1] != LATENT_DIM or up_weight.shape[-2] % heads:
        form = "[H x stride, 512]" if up_layer is None else "every layer's [L, H x stride, 512] (with up_layer)"
        raise ValueError(f"up_weight must be {form} with H = {heads}, got shape {up_weight.shape}")
    if up_layer is not None and (jnp.ndim(up_layer) != 0 or not jnp.issubdtype(jnp.result_type(up_layer), jnp.integer)):
        raise ValueError(f"up_layer must be an integer scalar, got {up_layer!r}")
    stride = up_weight.shape[-2] // heads
    if up_offset < 0 or up_width < 1 or up_offset + up_width > stride:
        raise ValueError(f"up_offset {up_offset} + up_width {up_width} must lie in each head's {stride} rows")
    if up_width % 32:
        raise ValueError(f"up_width must be a multiple of 32 (the merge's column blocks), got {up_width}")


def mla_tree_attention_reference(
    q_latent, q_rope, latent, rope_key, mask, *, scale=None, kv_lengths=None, up_weight=None, up_offset=0, up_width=None
):
    """The twin in plain XLA: `tree_attention_reference` over (latent, rope) parts, values the latent; with
    up_weight (one layer's [H x stride, 512]) each head's rows up_offset .. + up_width applied after
    (float32), as `mla_tree_attention(up_weight=)`."""
    if kv_lengths is not None:
        mask = mask & (jnp.arange(mask.shape[-1])[None, None, :] < kv_lengths[:, None, None])
    scale = (LATENT_DIM + ROPE_DIM) ** -0.5 if scale is None else scale
    if up_weight is None:
        return tree_attention_reference((q_latent, q_rope), (latent, rope_key), None, mask, scale=scale)
    if up_weight.ndim != 2 or up_width is None or up_weight.shape[0] % q_latent.shape[2]:
        raise ValueError(
            f"up_weight must be one layer's [H x stride, D] with H = {q_latent.shape[2]} and up_width given, got shape "
            f"{up_weight.shape} and up_width {up_width}"
        )
    q = (q_latent.astype(jnp.float32), q_rope.astype(jnp.float32))
    k = (latent.astype(jnp.float32), rope_key.astype(jnp.float32))
    out = tree_attention_reference(q, k, None, mask, scale=scale)  # float32 [B, T, H, 512]
    heads = q_latent.shape[2]
    per_head = up_weight.reshape(heads, -1, q_latent.shape[-1])[:, up_offset : up_offset + up_width].astype(jnp.float32)
    return jnp.einsum("bthr,hvr->bthv", out, per_head, precision="highest").astype(q_latent.dtype)
