"""GQA tree-verify attention as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel.

  out[b, t, h] = softmax_s(scale * q[b, t, h] . k[b, s, h // G]  where mask[b, t, s] and s < kv_lengths[b])
                 @ v[b, s, h // G]

The semantics of `tree_attention.tree_attention_reference((q,), (k,), v, mask)`: T tree queries per batch row
(decode: T = 1), G = Hq / Hkv query heads sharing each of the Hkv KV heads, against the row's KV cache of
capacity S (prefix + the tree's own slots, any dense bool mask).

Kernel (`plgpu.kernel`, grid (row block, key split, B * Hkv), flash-decoding; after `mla_attention_mgpu`):
  rows        the T tree queries x G query heads of ONE KV head of one batch row, flattened (row = t * G + g,
              the wrapper transposes the queries to [B, Hkv, rows, D] and pads them to whole CTAs), taken 64
              at a time (one wgmma M tile per compute warpgroup); a CTA holds up to 2 x 64 rows (Qwen3-8B,
              G = 4: T = 17 -> 68 rows, one CTA; T = 65 -> 260 rows, 3 CTAs; decode T = 1 -> 4 rows, one
              compute warpgroup), so every key block of that KV head is read from memory once per CTA and
              feeds both QK^T and PV of all its rows;
  memory WG   TMA-loads the CTA's query tiles and row table once, then the split's key blocks (K of
              `block_kv` keys x D with the packed mask words; V on its own barrier, so QK^T starts before V
              lands) into a ring of `stages` shared-memory slots, reusing a slot once every compute WG
              consumed it;
  compute WGs warpgroup w takes rows 64 w .. 64 w + 63 of the CTA: scores [64, block_kv] (wgmma, float32),
              the mask from the bit words, online softmax in base 2 (float32), P (bf16) @ V (wgmma,
              accumulated in registers, 64 x D float32); a warpgroup whose 64 rows are all padding (the
              last CTA of an odd tile count) only observes the blocks;
  splits      the key blocks of row b (ceil(kv_lengths[b] / block_kv) of them: a mostly empty cache is not
              streamed) are dealt to the `splits` CTAs of its (row block, KV head) in contiguous runs of
              ceil(blocks / splits), computed in the kernel from kv_lengths[b] (`_split_range`); `splits` is
              static, by default enough CTAs to fill the 132 SMs once at >= MIN_BLOCKS_PER_SPLIT blocks a
              split of a full cache (`split_plan`);
  outputs     each split writes its normalised bf16 output and float32 log2-sum-exp per row (-inf: no key
              seen); a jnp epilogue merges the splits by log-sum-exp (skipped for one split) and transposes
              back to [B, T, Hq, D].
The mask is passed as bit words: word[b, w, s] holds mask[b, 32 w + i, s] (and s < kv_lengths[b]) in bit i,
so a key block costs 4 bytes a key per 32 tree queries against 4 D bytes of K + V, and any dense mask is
exact (prefix, tree ancestors, ragged lengths).

Shared memory (bf16; `smem_plan`): resident the query tiles 64 x D per compute WG (reused for the output),
the row table i32 [2, WGs, 64] and the log-sum-exp f32 [WGs, 64]; per stage K + V 2 x block_kv x D plus the
mask words i32 [W, block_kv] (W = ceil(T / 32)); up to MAX_STAGES = 4 stages. Qwen3-8B (D = 128, block_kv
64, 2 compute WGs, W = 1): 33.5 KiB + 4 stages x 32.25 KiB = 162.5 KiB (block_kv 128: 2 stages x 64.5 KiB,
the same bytes in flight); the embedded pair (D = 64) at T = 17 (1 WG): 8.75 + 4 x 16.25 = 73.75 KiB, at
T = 65 (2 WGs, W = 3): 17.5 + 4 x 16.75 = 84.5 KiB. Registers: compute WGs 232 a thread (accumulator
64 x D float32 + scores 64 x block_kv), memory WG 40.

Constraints (ValueError otherwise): bf16 q, k, v; Hq a multiple of Hkv; head dim D in (64, 128) (keys and
values alike); block_kv in (64, 128) (the value wgmma contracts over the keys, which must be a multiple of 64
at the 128-byte swizzle: 32 fails to lower); num_splits >= 1. T, G and S are free: TMA tiles every tiled axis
by 8 and reads whole key blocks, so the wrapper pads the query rows to whole CTAs (zeros, dropped after) and
a capacity S that is not a multiple of block_kv to whole blocks. That pad copies the cache: callers should
allocate caches in whole key blocks (the engine allocates them in whole 128-row blocks; the benchmark in
whole 64-key blocks). kv_lengths is clipped to [0, S]; the keys past kv_lengths[b] in the last key block row
b reads are read with weight exactly 0, so V must be finite there (a zero-initialised or previously written
cache is); the blocks after it are never read and may hold anything.

Interpret mode (CPU; `interpret=None` picks it there) runs the same kernel with the departure jax 0.11's
interpreter needs (`mosaic_common.accumulate`, as in `mla_attention_mgpu`): the probabilities reach the value wgmma
through shared memory (p_smem [WGs, 64, block_kv]), not registers, and that product is added instead of
accumulated in place. The interpreter runs a CTA's warpgroups as threads blocked inside host callbacks: start
the process with NPROC=64 (`mosaic_common.INTERPRET_NPROC`), or waiting warpgroups can starve the others (a hang).

`gqa_tree_attention_reference` is the twin (`tree_attention_reference`, plain XLA).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, accumulate, merge_splits, pack_mask, row_bits
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret
from ddtree_kernels.tree_attention import tree_attention_reference, visible_lengths

BLOCK_M = 64  # rows per compute warpgroup: one wgmma M tile
MAX_COMPUTE_WGS = 2  # compute warpgroups per CTA (232 registers each beside a 40-register memory WG)
HEAD_DIMS = (64, 128)
BLOCK_KVS = (64, 128)  # 32: the value wgmma needs K (keys) a multiple of 64 at a 128-byte swizzle
NUM_SMS = 132  # H200
MAX_STAGES = 4
MIN_BLOCKS_PER_SPLIT = 2  # a split shorter than this pays its query load and merge for too few keys
SMEM_BUDGET = SMEM_LIMIT_BYTES - 4 * 1024  # leave room for the barriers
LOG2E = math.log2(math.e)
_TILED = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def row_plan(rows: int) -> tuple[int, int]:
    """(compute warpgroups per CTA, row blocks): rows = G * T in 64-row tiles, up to 2 tiles a CTA."""
    tiles = pl.cdiv(rows, BLOCK_M)
    wgs = min(MAX_COMPUTE_WGS, tiles)
    return wgs, pl.cdiv(tiles, wgs)


def smem_plan(head_dim: int, block_kv: int, compute_wgs: int, num_words: int, interpret: bool) -> tuple[int, int]:
    """(stages, shared-memory bytes): as many K + V (+ mask word) slots as fit beside the resident tiles."""
    resident = compute_wgs * BLOCK_M * (head_dim * 2 + 2 * 4 + 4)  # queries / output, row table, lse
    if interpret:
        resident += compute_wgs * BLOCK_M * block_kv * 2  # p_smem
    per_stage = 2 * block_kv * head_dim * 2 + num_words * block_kv * 4
    stages = min(MAX_STAGES, (SMEM_BUDGET - resident) // per_stage)
    return stages, resident + stages * per_stage


def split_plan(
    batch: int, kv_heads: int, rows: int, capacity: int, block_kv: int, num_splits: int | None
) -> tuple[int, int]:
    """(splits, key blocks per split of a full cache). By default enough CTAs (row blocks x splits x B x Hkv)
    to fill the SMs once, at >= MIN_BLOCKS_PER_SPLIT key blocks a split. At run time row b deals its
    ceil(kv_lengths[b] / block_kv) blocks to the splits in runs of ceil(blocks / splits)."""
    _, row_blocks = row_plan(rows)
    total = pl.cdiv(capacity, block_kv)
    if num_splits is None:
        num_splits = max(1, NUM_SMS // (row_blocks * kv_heads * batch))
        num_splits = min(num_splits, max(1, total // MIN_BLOCKS_PER_SPLIT))
    per_split = pl.cdiv(total, max(1, min(num_splits, total)))
    return pl.cdiv(total, per_split), per_split


def _kernel(
    lengths_ref,
    rows_ref,
    q_ref,
    k_ref,
    v_ref,
    words_ref,
    o_ref,
    lse_ref,
    *,
    q_smem,
    rows_smem,
    lse_smem,
    k_smem,
    v_smem,
    words_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    consumed_barriers,
    p_smem=None,
    rows: int,
    kv_heads: int,
    splits: int,
    compute_wgs: int,
    block_kv: int,
    stages: int,
    num_words: int,
    scale_log2: float,
):
    # GMEM: lengths_ref i32 [B] kv_lengths (this CTA's key blocks: `_split_range`);
    #   rows_ref i32 [2, R_pad / 64, 64] per row r = t * G + g: the bit (1 << t % 32) and the word (t // 32)
    #   of its tree query (bit 0: padding row); q_ref bf16 [B, Hkv, R_pad, D] the queries by KV head
    #   (R_pad: the rows in whole CTAs, zeros past G * T); k_ref, v_ref bf16 [B, S_pad, Hkv, D] the cache
    #   (S_pad: whole key blocks); words_ref i32 [B, W, S_pad] the packed mask; o_ref bf16
    #   [B, Hkv, splits, R_pad, D] each split's normalised output; lse_ref f32 [B, Hkv, splits, R_pad] its
    #   log2-sum-exp (-inf: no key seen).
    # SMEM: q_smem [WGs, 64, D] each compute WG's queries, then its output; rows_smem i32 [2, WGs, 64] the
    #   CTA's row table; lse_smem f32 [WGs, 64]; per slot: k_smem [stages, block_kv, D],
    #   v_smem [stages, block_kv, D], words_smem i32 [stages, W, block_kv]; interpret mode only:
    #   p_smem [WGs, 64, block_kv] each compute WG's probabilities (see `mosaic_common.accumulate`).
    row_block, split, bh = lax.axis_index("rows"), lax.axis_index("split"), lax.axis_index("heads")
    b, kv = lax.div(bh, kv_heads), lax.rem(bh, kv_heads)
    wg = lax.axis_index("wg")
    cta_r0 = row_block * (compute_wgs * BLOCK_M)
    first_block, num_blocks = _split_range(
        lengths_ref[b], split, splits=splits, block_kv=block_kv, key_blocks=k_ref.shape[1] // block_kv
    )

    @pl.when(wg == compute_wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        for w in range(compute_wgs):
            rows_w = pl.ds(cta_r0 + w * BLOCK_M, BLOCK_M)
            plgpu.copy_gmem_to_smem(q_ref.at[b, kv, rows_w], q_smem.at[w], q_barrier)
        tiles = pl.ds(row_block * compute_wgs, compute_wgs)
        plgpu.copy_gmem_to_smem(rows_ref.at[:, tiles], rows_smem, q_barrier)

        def load(i, slot):
            keys = pl.ds((first_block + i) * block_kv, block_kv)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv], k_smem.at[slot], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(words_ref.at[b, :, keys], words_smem.at[slot], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv], v_smem.at[slot], v_barriers.at[slot])

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

    @pl.when(wg < compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        r0 = cta_r0 + wg * BLOCK_M
        plgpu.barrier_wait(q_barrier)
        # per-row vectors (2 registers a thread), broadcast to the tile inside the loop: hoisted [64, block_kv]
        # tiles would hold block_kv / 2 registers each for the whole loop
        row_bit = plgpu.load(rows_smem.at[0, wg], layout=plgpu.Layout.WGMMA.reduce(1))
        row_word = plgpu.load(rows_smem.at[1, wg], layout=plgpu.Layout.WGMMA.reduce(1)) if num_words > 1 else None
        queries = q_smem.at[wg]
        p_stage = None if p_smem is None else p_smem.at[wg]
        tile = (BLOCK_M, block_kv)

        def body(i, carry):
            acc, m, l = carry  # acc f32 [64, D]; m (running max, base 2, scaled) and l (sum) f32 [64]
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_barriers.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, queries, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC(tile, jnp.float32))
            word = None
            for w in range(num_words):
                col = plgpu.load(words_smem.at[slot, w], layout=plgpu.Layout.WGMMA.reduce(0))
                col = lax.broadcast_in_dim(col, tile, [1])
                word = col if word is None else jnp.where(lax.broadcast_in_dim(row_word, tile, [0]) == w, col, word)
            visible = (word & lax.broadcast_in_dim(row_bit, tile, [0])) != 0
            s = jnp.where(visible, s * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            base = jnp.maximum(m_new, -1e30)  # finite: rows that saw nothing yet get p = 0, not NaN
            alpha = jnp.exp2(m - base)
            p = jnp.exp2(s - lax.broadcast_in_dim(base, tile, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_barriers.at[slot])
            acc = accumulate(acc, p.astype(v_smem.dtype), v_smem.at[slot], p_stage)
            plgpu.barrier_arrive(consumed_barriers.at[slot])
            return acc, m_new, l

        def observe(i, _):
            """A block of a warpgroup whose rows are all padding: observe its barriers, no math."""
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_barriers.at[slot])
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_arrive(consumed_barriers.at[slot])

        init = (
            plgpu.layout_cast(jnp.zeros((BLOCK_M, q_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        if compute_wgs > 1:  # only the second warpgroup of the last CTA can be all padding
            steps = jnp.where(r0 < rows, num_blocks, 0)
            acc, m, l = lax.fori_loop(0, steps, body, init)
            lax.fori_loop(steps, num_blocks, observe, None)
        else:
            acc, m, l = lax.fori_loop(0, num_blocks, body, init)
        # the query tile is free once the loop's wgmmas are done: it holds the output
        inv = 1.0 / jnp.maximum(l, 1e-30)  # l = 0 only where acc = 0
        queries[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(queries.dtype)
        lse_smem.at[wg][...] = m + jnp.log(l) * (1.0 / math.log(2.0))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(queries, o_ref.at[b, kv, split, pl.ds(r0, BLOCK_M)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, kv, split, pl.ds(r0, BLOCK_M)])
        plgpu.wait_smem_to_gmem(0)


def _split_range(length, split, *, splits: int, block_kv: int, key_blocks: int):
    """(first key block, block count) of `split` for a row of `length` keys (int32, traced; in the kernel
    scalars): the row's ceil(length / block_kv) blocks (clipped to [0, key_blocks]) in runs of
    ceil(blocks / splits); trailing splits may be empty. Every operand is >= 0, so lax.div is the floor. The length
    is clipped before the rounding add (a traced length near 2^31 overflowed it: no block read, zeros out)."""
    length = jnp.clip(length, 0, key_blocks * block_kv)
    blocks = lax.div(length + (block_kv - 1), block_kv)
    per = lax.div(blocks + (splits - 1), splits)
    first = split * per
    return first, jnp.minimum(jnp.maximum(blocks - first, 0), per)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_splits", "interpret"))
def _gqa_tree_attention(q, k, v, mask, kv_lengths, *, scale, block_kv, num_splits, interpret):
    batch, steps, q_heads, head_dim = q.shape
    capacity, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    kv_lengths = kv_lengths.astype(jnp.int32)  # clipped to [0, S] in the kernel (`_split_range`)
    if capacity % block_kv:
        # TMA tiles the cache's key axis by 8 and reads whole key blocks (mla_attention_mgpu's first H200 run
        # refused a ragged S): pad to whole blocks (zeros: finite, never visible). This copies the cache:
        # callers should allocate capacities in whole key blocks.
        extra = pl.cdiv(capacity, block_kv) * block_kv - capacity
        k = jnp.pad(k, ((0, 0), (0, extra), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, extra), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, extra)))
        capacity += extra
    rows = steps * group
    compute_wgs, row_blocks = row_plan(rows)
    rows_pad = row_blocks * compute_wgs * BLOCK_M
    splits, _ = split_plan(batch, kv_heads, rows, capacity, block_kv, num_splits)
    num_words = pl.cdiv(steps, 32)
    stages, _ = smem_plan(head_dim, block_kv, compute_wgs, num_words, interpret)
    dtype = q.dtype

    # [B, T, Hq, D] -> [B, Hkv, T * G, D] (row = t * G + g), zero rows to whole CTAs (every TMA box in bounds)
    q_rows = q.reshape(batch, steps, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows.reshape(batch, kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    words = pack_mask(mask, kv_lengths, num_words)
    row_table = jnp.asarray(row_bits(steps, group, rows_pad).reshape(2, rows_pad // BLOCK_M, BLOCK_M))

    scratch = dict(
        q_smem=plgpu.SMEM((compute_wgs, BLOCK_M, head_dim), dtype, **_TILED),
        rows_smem=plgpu.SMEM((2, compute_wgs, BLOCK_M), jnp.int32),
        lse_smem=plgpu.SMEM((compute_wgs, BLOCK_M), jnp.float32),
        k_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, **_TILED),
        v_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, **_TILED),
        words_smem=plgpu.SMEM((stages, num_words, block_kv), jnp.int32),
        q_barrier=plgpu.Barrier(num_arrivals=compute_wgs + 1),
        k_barriers=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        v_barriers=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        consumed_barriers=plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=stages),
    )
    if interpret:
        p_cols = min(block_kv, 64)
        p_transforms = (plgpu.TilingTransform((8, p_cols)), plgpu.SwizzleTransform(2 * p_cols))
        scratch["p_smem"] = plgpu.SMEM((compute_wgs, BLOCK_M, block_kv), dtype, transforms=p_transforms)
    kernel = functools.partial(
        _kernel,
        rows=rows,
        kv_heads=kv_heads,
        splits=splits,
        compute_wgs=compute_wgs,
        block_kv=block_kv,
        stages=stages,
        num_words=num_words,
        scale_log2=scale * LOG2E,
    )
    partial, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(row_blocks, splits, batch * kv_heads),
        grid_names=("rows", "split", "heads"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=INTERPRET_PARAMS if interpret else None,
    )(kv_lengths, row_table, q_rows, k, v, words)
    partial = partial[:, :, :, :rows]
    if splits == 1:  # already normalised; rows that saw no key are 0
        out = partial[:, :, 0].astype(jnp.float32)
    else:  # log-sum-exp merge of the splits (base 2); rows that saw no key come out zero
        out = merge_splits(partial, lse[:, :, :, :rows], axis=2)
    out = out.reshape(batch, kv_heads, steps, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, steps, q_heads, head_dim).astype(dtype)


def _check(q, k, v, mask, kv_lengths, block_kv, num_splits) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got {q.shape}")
    batch, steps, q_heads, head_dim = q.shape
    if k.ndim != 4 or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must be [B, S, Hkv, D] with B = {batch}, D = {head_dim}, got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must be [B, S, Hkv, D] = {k.shape} (as k), got {v.shape}")
    capacity, kv_heads = k.shape[1], k.shape[2]
    if min(batch, steps, capacity) < 1:  # an empty batch, tree or cache failed deep in the plan (a division by 0)
        raise ValueError(f"B, T and S must be >= 1, got B = {batch}, T = {steps}, S = {capacity}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"Hq = {q_heads} must be a multiple of Hkv = {kv_heads}")
    if mask.shape != (batch, steps, capacity):
        raise ValueError(f"mask must be [B, T, S] = {(batch, steps, capacity)}, got {mask.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {x.dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {HEAD_DIMS}, got {head_dim}")
    if block_kv not in BLOCK_KVS:
        raise ValueError(f"block_kv must be one of {BLOCK_KVS}, got {block_kv}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if kv_lengths is not None and kv_lengths.shape != (batch,):
        raise ValueError(f"kv_lengths must be [B] = ({batch},), got {kv_lengths.shape}")
    compute_wgs, _ = row_plan(steps * (q_heads // kv_heads))
    stages, _ = smem_plan(head_dim, block_kv, compute_wgs, pl.cdiv(steps, 32), interpret=True)
    if stages < 2:
        raise ValueError(f"T = {steps} leaves {stages} K/V stage(s) at D = {head_dim}, block_kv = {block_kv}")


def gqa_tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    kv_lengths: jax.Array | None = None,
    block_kv: int = 64,
    num_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """GQA tree-verify attention on the Mosaic GPU backend (Hopper).

    Args:
      q: bf16 [B, T, Hq, D] the tree queries (D in (64, 128)).
      k, v: bf16 [B, S, Hkv, D] the KV cache (Hq a multiple of Hkv; S best a multiple of block_kv, else the
        wrapper pads, i.e. copies, the cache).
      mask: bool [B, T, S], True where tree query t may attend key s.
      scale: softmax scale (default D ** -0.5); kv_lengths: int32 [B], keys >= it are never read nor seen
        (default `visible_lengths(mask)`).
      block_kv: keys per pipelined block (64 or 128); num_splits: key splits per (row block, KV head,
        batch row) (default `split_plan`: fill the SMs).
      interpret: Mosaic GPU interpret mode (default: on the CPU backend).
    Returns:
      bf16 [B, T, Hq, D] (softmax and sums in float32); rows with no visible key are 0.
    """
    _check(q, k, v, mask, kv_lengths, block_kv, num_splits)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kv_lengths = visible_lengths(mask) if kv_lengths is None else kv_lengths
    return _gqa_tree_attention(
        q,
        k,
        v,
        mask.astype(bool),
        kv_lengths,
        scale=scale,
        block_kv=block_kv,
        num_splits=num_splits,
        interpret=default_interpret(interpret),
    )


def gqa_tree_attention_reference(q, k, v, mask, *, scale=None, kv_lengths=None):
    """The twin in plain XLA: `tree_attention_reference((q,), (k,), v, mask)` (keys >= kv_lengths hidden)."""
    if kv_lengths is not None:
        mask = mask & (jnp.arange(mask.shape[-1])[None, None, :] < kv_lengths[:, None, None])
    return tree_attention_reference((q,), (k,), v, mask, scale=scale)
