"""What the Mosaic GPU attention kernels (`mla_attention_mgpu`, `gqa_attention_mgpu`, `prefill_attention_mgpu`)
share: the P @ V accumulation with its interpret-mode form, the tree mask as bit words, each query row's bit,
the log-sum-exp merge of flash-decoding splits; and, shared with the matmul kernels (`skinny_matmul_mgpu`,
`grouped_int4_mgpu`), the memory warpgroup's TMA ring and the layer index of stacked operands read in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

INTERPRET_PARAMS = plgpu.InterpretGPUParams()
# Interpret mode runs each CTA's warpgroups as host threads that block inside callbacks (barrier waits), each
# on a thread of XLA's CPU pool (NPROC, read when the CPU client starts; default the core count). Independent
# kernel calls of one jitted function may run at once (a MoE layer's gate and up), besides the pool's other work,
# so whether a blocked warpgroup starves another depends on the scheduling: the MoE test hung at NPROC = 2 and 4
# and once in CI at 8, and passed at 3, 8, 32 and 64 here. Processes that interpret these kernels start with a pool
# far above any such count.
INTERPRET_NPROC = 64


def accumulate(acc, p, values_ref, p_smem, while_running=None):
    """acc + p @ values on the tensor cores, calling `while_running()` (if given) once the product is issued.
    Compiled (p_smem None): the FA3 idiom, a wgmma from the registers into the carried accumulator
    (`pl.run_state`, which waits for it after `while_running`). Interpret mode (jax 0.11) runs neither
    `run_state` nor a wgmma operand held in registers, so there p is staged through shared memory and the
    product goes to a fresh accumulator that is added: the same value."""
    if p_smem is None:

        def product(acc_ref):
            plgpu.wgmma(acc_ref, p, values_ref)
            if while_running is not None:
                while_running()

        return pl.run_state(product)(plgpu.ACC.init(acc))

    p_smem[...] = p
    plgpu.commit_smem()
    acc = accumulate_from_smem(acc, p_smem, values_ref, interpret=True)
    if while_running is not None:
        while_running()
    return acc


def accumulate_from_smem(acc, p_smem, values_ref, *, interpret: bool):
    """acc + p_smem @ values on the tensor cores, P already in shared memory (written, and fenced with
    `plgpu.commit_smem`, by its writers). Compiled: P loaded into registers and `accumulate`d (its wgmma waited
    before this returns, so P may be overwritten after); as a shared-memory operand P would have to match the
    values' swizzle (the MLA kernel's P, 64-byte swizzled against the latent's 128, failed Mosaic GPU's layout
    inference in a CPU lowering). Interpret mode: the shared-memory operand into a fresh accumulator, added."""

    def product(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, values_ref)
        return acc_ref[...]

    if not interpret:  # P to registers first: a shared-memory A operand must share B's swizzle, P's does not
        return accumulate(acc, plgpu.load(p_smem, layout=plgpu.Layout.WGMMA), values_ref, None)
    return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))


def pack_mask(mask: jax.Array, kv_lengths: jax.Array, num_words: int) -> jax.Array:
    """mask bool [B, T, S], kv_lengths int32 [B] -> i32 [B, W, S]: bit i of word w is mask[b, 32 w + i, s] and
    s < kv_lengths[b] (4 bytes a key per 32 tree queries; any dense mask is exact)."""
    batch, steps, capacity = mask.shape
    live = mask & (jnp.arange(capacity)[None, None, :] < kv_lengths[:, None, None])
    live = jnp.pad(live, ((0, 0), (0, 32 * num_words - steps), (0, 0))).reshape(batch, num_words, 32, capacity)
    bits = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))[None, None, :, None]
    words = jnp.sum(jnp.where(live, bits, jnp.uint32(0)), axis=2, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


def row_bits(steps: int, heads_per_step: int, rows_pad: int) -> np.ndarray:
    """i32 [2, rows_pad]: for query row r = t * heads_per_step + h, the bit 1 << (t % 32) of its tree query t
    in a `pack_mask` word and that word's index t // 32; bit 0 (never visible) past T * heads_per_step."""
    t = np.arange(rows_pad) // heads_per_step
    bit = np.where(t < steps, np.left_shift(np.uint32(1), (t % 32).astype(np.uint32)), 0).astype(np.uint32)
    return np.stack([bit.view(np.int32), (t // 32).astype(np.int32)])


def feed_ring(load, steps: int, stages: int, consumed) -> None:
    """A memory warpgroup's TMA ring over `steps` (static) pipeline steps: `load(step, slot)` issues step's copies
    into slot step % stages; the first `stages` at once, each later one once the compute warpgroups released its
    slot (`consumed[slot]`, one phase a step); then the last slots' releases are observed too (every phase of a
    barrier is observed by each of its waiters; interpret mode checks it)."""
    for i in range(min(stages, steps)):
        load(i, i)

    if steps > stages:

        @pl.loop(stages, steps)
        def _steady(i):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(consumed.at[slot])
            load(i, slot)

    @pl.loop(max(steps - stages, 0), steps)
    def _drain(i):
        plgpu.barrier_wait(consumed.at[lax.rem(i, stages)])


def layer_index(layer, num_layers: int) -> jax.Array:
    """int32 []: `layer` as `lax.dynamic_index_in_dim` reads it (what the callers slice with otherwise): a
    negative index counts from the end, then clamped into [0, num_layers)."""
    layer = jnp.asarray(layer, jnp.int32)
    return jnp.clip(jnp.where(layer < 0, layer + num_layers, layer), 0, num_layers - 1)


def merge_splits(partial: jax.Array, lse: jax.Array, axis: int) -> jax.Array:
    """The splits' normalised outputs partial [..., splits, rows, D] and their base-2 log-sum-exp lse
    [..., splits, rows] (splits at `axis` of both) -> float32 [..., rows, D]; rows that saw no key (lse -inf
    in every split) come out zero. Three reductions (the maximum, the weights' sum, the weighted sum): one
    variadic reduction of (maximum, weight sum, weighted output) measured slower on the GPU, its broadcast
    operands materialised by XLA (BENCHMARKS.md, the K2.6 TP8 shard's "Session 35" paragraph)."""
    top = jnp.max(lse, axis=axis, keepdims=True)
    weight = jnp.exp2(lse - jnp.where(top > -jnp.inf, top, 0.0))  # 0 for -inf
    total = jnp.sum(weight, axis=axis)
    out = jnp.sum(jnp.expand_dims(weight, -1) * partial.astype(jnp.float32), axis=axis)
    return out / jnp.maximum(total, 1e-30)[..., None]
