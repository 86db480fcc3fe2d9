"""Causal prefill attention with a per-row offset as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel.

  out[b, t, h] = softmax_s(scale * q[b, t, h] . k[b, s, h // G]  over s <= start[b] + t) @ v[b, s, h // G]

One prefill chunk: query t of row b sits at absolute position start[b] + t of the KV cache (which already
holds the chunk's keys), G = Hq / Hkv query heads share a KV head. The semantics of
`tree_attention.attention_reference` with mask[b, t, s] = s <= start[b] + t (`causal_prefill_attention_reference`).

Kernel (`plgpu.kernel`, FlashAttention-3 style, after jax.experimental.pallas.ops.gpu.attention_mgpu):
  grid        (Hq, query tiles, B), heads fastest (the G heads of a KV head run side by side and meet in
              L2); a tile is 2 x 64 queries and the tiles run last first (the longest rows start first, so
              the short ones fill the tail of the launch);
  compute WGs warpgroup w in {0, 1} TMA-loads its 64 queries of one head and loops over key blocks of
              `block_kv` keys: QK^T (wgmma, float32), online softmax in base 2 (float32), P (bf16) @ V
              (wgmma, accumulated in registers); a schedule barrier alternates the two warpgroups'
              softmax and tensor-core phases (ping-pong);
  memory WG   TMA-loads K and V blocks into a ring of `stages` shared-memory slots (separate K and V
              barriers: QK^T starts before V lands) and reuses a slot once both compute WGs consumed it;
  causality   start[b] is read from GMEM, so the loop bounds are dynamic: warpgroup w reads key blocks
              0 .. (start + its last query) // block_kv only (blocks above the diagonal are never loaded: a
              chunk at offset start costs ~start + T / 2 keys a query, not S); the blocks wholly below its
              first query skip the mask, only the 1-2 diagonal blocks apply s <= start + t; warpgroup 0 (the
              earlier queries) then only observes the blocks warpgroup 1 still needs (no math).
Shared memory (bf16, D = Dk = Dv = 128, block_kv 128): queries 2 x 64 x 128 (32 KiB, reused for the
output), per stage K + V 2 x 128 x 128 (64 KiB): 2 stages = 160 KiB (block_kv 64: 4 stages, 160 KiB).
Registers: compute WGs 232 a thread (accumulator 64 x Dv float32 + scores 64 x block_kv), memory WG 40.

Constraints (ValueError otherwise): bf16 q, k, v; Hq a multiple of Hkv; Dk in (64, 128, 192, 256), Dv in
(64, 128) (Dk != Dv, e.g. expanded MLA 192 / 128, uses a separate output tile) leaving >= 2 K/V stages;
block_q 64 (one wgmma M tile per warpgroup); block_kv in (64, 128); S a multiple of block_kv (TMA tiles
the key axis); scale > 0 (the running max is kept scaled). start is traced: it must satisfy start[b] >= 0
(a negative start reads as 0) and should satisfy start[b] + T <= S (keys >= S are never read). T is free:
a T that is not a multiple of 8 is padded (TMA tiles the query axis by 8); query rows past T take the
mask of row T - 1 and their stores are dropped. Keys past start[b] + T - 1 are never visible; those in
the last key block a row reads (up to the next multiple of block_kv) are read with weight exactly 0, so
V must be finite there (a zero-initialised or previously written cache is); the blocks past it are never
read and may hold anything (NaN included).

CUDA: jax's own causal kernel refuses CUDA runtimes 12.8.0 - 12.9.0 (a ptxas miscompilation of its
causal masking); this kernel masks the same way, so `causal_masking_safe()` reports such a runtime and the
library's dispatch keeps the XLA path there. Measured correct on the H200 with CUDA runtime 13.0.

Interpret mode (CPU; `interpret=None` picks it there): the same kernel, except that P reaches the value
wgmma through shared memory and that product is added instead of accumulated in place (`mosaic_common.accumulate`,
as in `mla_attention_mgpu`). The interpreter runs a CTA's three warpgroups as threads blocked in host
callbacks: start the process with NPROC=64 (`mosaic_common.INTERPRET_NPROC`) or they can starve.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, accumulate
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret
from ddtree_kernels.tree_attention import attention_reference

BLOCK_Q = 64  # queries per compute warpgroup: one wgmma M tile
KEY_DIMS = (64, 128, 192, 256)
VALUE_DIMS = (64, 128)
BLOCK_KVS = (64, 128)
MAX_STAGES = 4
SMEM_BUDGET = SMEM_LIMIT_BYTES - 4 * 1024  # room for the barriers
LOG2E = math.log2(math.e)
_TILED = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def smem_plan(key_dim: int, value_dim: int, block_kv: int, interpret: bool) -> tuple[int, int]:
    """(stages, shared-memory bytes): as many K + V slots as fit beside the query (and output) tiles."""
    resident = 2 * BLOCK_Q * key_dim * 2
    if key_dim != value_dim:
        resident += 2 * BLOCK_Q * value_dim * 2
    if interpret:
        resident += 2 * BLOCK_Q * block_kv * 2  # p_smem
    per_stage = block_kv * (key_dim + value_dim) * 2
    stages = min(MAX_STAGES, (SMEM_BUDGET - resident) // per_stage)
    return stages, resident + stages * per_stage


def _kernel(
    start_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    q_smem,
    k_smem,
    v_smem,
    q_barriers,
    k_barriers,
    v_barriers,
    k_consumed,
    v_consumed,
    schedule_barrier,
    o_smem=None,
    p_smem=None,
    steps: int,
    num_tiles: int,
    block_kv: int,
    stages: int,
    group: int,
    scale_log2: float,
):
    # GMEM: start_ref i32 [B] each row's offset; q_ref bf16 [B, T_pad, Hq, Dk]; k_ref bf16 [B, S, Hkv, Dk];
    #   v_ref bf16 [B, S, Hkv, Dv]; o_ref bf16 [B, T_pad, Hq, Dv].
    # SMEM: q_smem [2, 64, Dk] each compute WG's queries (its output too when Dk == Dv; else o_smem
    #   [2, 64, Dv]); k_smem [stages, block_kv, Dk], v_smem [stages, block_kv, Dv] the key ring;
    #   interpret mode only: p_smem [2, 64, block_kv] each compute WG's probabilities (`mosaic_common.accumulate`).
    head, b = lax.axis_index("heads"), lax.axis_index("batch")
    tile = num_tiles - 1 - lax.axis_index("tiles")  # last tile first
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, group)
    # clipped to [0, S]: past S every key is visible anyway, and a traced start near 2^31 overflowed start +
    # last_query (no key block to wait for: the compute warpgroups hung on the first one)
    start = jnp.clip(start_ref[b], 0, k_ref.shape[1])
    num_key_blocks = k_ref.shape[1] // block_kv

    def key_steps(q_base):
        """Key blocks read by the warpgroup whose first query is q_base: up to its last visible key."""
        last_query = jnp.minimum(q_base + BLOCK_Q, steps) - 1
        return jnp.minimum(lax.div(start + last_query, block_kv) + 1, num_key_blocks)

    tile_steps = key_steps(tile * 2 * BLOCK_Q + BLOCK_Q)  # warpgroup 1's: the CTA's most

    def schedule():
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(i, slot, reuse: bool):
            """K and V of key block i into `slot`, once the compute WGs consumed its previous block."""
            keys = (b, pl.ds(i * block_kv, block_kv), kv_head)
            if reuse:
                plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_barriers.at[slot])
            if reuse:
                plgpu.barrier_wait(v_consumed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_barriers.at[slot])

        for i in range(min(stages, num_key_blocks)):

            @pl.when(i < tile_steps)
            def _prologue():
                load(i, i, reuse=False)

        @pl.loop(stages, jnp.maximum(tile_steps, stages))
        def _steady(i):
            load(i, lax.rem(i, stages), reuse=True)

        # observe the consumption of the last blocks too (interpret mode checks that every phase of a
        # barrier is observed)
        @pl.loop(jnp.maximum(tile_steps - stages, 0), tile_steps)
        def _drain(i):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_base = tile * 2 * BLOCK_Q + wg * BLOCK_Q
        kv_steps = key_steps(q_base)
        # blocks wholly visible to the first query (rows past T read as row T - 1) need no mask
        first_position = start + jnp.minimum(q_base, steps - 1)
        full_steps = jnp.minimum(lax.div(first_position + 1, block_kv), kv_steps)
        queries = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, BLOCK_Q), head], queries, q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[wg])
        plgpu.barrier_wait(k_barriers.at[0])  # kv_steps >= 1: key 0 is visible to every query
        value_dim = v_smem.shape[-1]
        tile_shape = (BLOCK_Q, block_kv)
        p_stage = None if p_smem is None else p_smem.at[wg]

        pl.when(wg == 1)(schedule)

        def step(i, carry, masked):
            acc, m, l = carry  # acc f32 [64, Dv]; m (running max, base 2) and l (sum) f32 [64]
            slot = lax.rem(i, stages)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, queries, k_smem.at[slot].transpose((1, 0)))
                schedule()
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC(tile_shape, jnp.float32))  # unscaled: scale > 0 commutes with max
            plgpu.barrier_arrive(k_consumed.at[slot])
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, tile_shape, 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1, layout=plgpu.Layout.WGMMA)
                limit = start - i * block_kv + jnp.minimum(rows + q_base, steps - 1)
                s = jnp.where(cols <= limit, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)  # finite: key 0 is visible to every row
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, tile_shape, [0]))  # one FMA an element
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p = p.astype(v_smem.dtype)
            if value_dim <= 128:  # the order jax's kernel measured fastest
                acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
            plgpu.barrier_arrive(schedule_barrier)  # softmax done
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule_barrier)  # the other warpgroup is off the tensor cores

            def wait_next_keys():
                @pl.when(i + 1 < kv_steps)
                def _():
                    plgpu.barrier_wait(k_barriers.at[lax.rem(i + 1, stages)])

            acc = accumulate(acc, p, v_smem.at[slot], p_stage, wait_next_keys)
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l

        def observe(i, _):
            """A block only warpgroup 1 needs: observe its barriers and keep the schedule in step."""
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_barriers.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            schedule()
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            schedule()

        carry = (
            plgpu.layout_cast(jnp.zeros((BLOCK_Q, value_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), carry)
        acc, _, l = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True), carry)
        lax.fori_loop(kv_steps, tile_steps, observe, None)
        pl.when(wg == 0)(schedule)

        out = o_smem.at[wg] if o_smem is not None else queries
        out[...] = (acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])).astype(out.dtype)  # l >= 1
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, o_ref.at[b, pl.ds(q_base, BLOCK_Q), head])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "interpret"))
def _causal_prefill_attention(q, k, v, start, *, scale, block_kv, interpret):
    batch, steps, q_heads, key_dim = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    steps_pad = pl.cdiv(steps, 8) * 8  # TMA tiles the query axis by 8
    if steps_pad != steps:
        q = jnp.pad(q, ((0, 0), (0, steps_pad - steps), (0, 0), (0, 0)))
    tiles = pl.cdiv(steps_pad, 2 * BLOCK_Q)
    stages, _ = smem_plan(key_dim, value_dim, block_kv, interpret)
    dtype = q.dtype
    scratch = dict(
        q_smem=plgpu.SMEM((2, BLOCK_Q, key_dim), dtype, **_TILED),
        k_smem=plgpu.SMEM((stages, block_kv, key_dim), dtype, **_TILED),
        v_smem=plgpu.SMEM((stages, block_kv, value_dim), dtype, **_TILED),
        q_barriers=plgpu.Barrier(num_barriers=2),
        k_barriers=plgpu.Barrier(num_barriers=stages),
        v_barriers=plgpu.Barrier(num_barriers=stages),
        k_consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        v_consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        schedule_barrier=plgpu.Barrier(num_arrivals=2),
    )
    if key_dim != value_dim:
        scratch["o_smem"] = plgpu.SMEM((2, BLOCK_Q, value_dim), dtype, **_TILED)
    if interpret:
        scratch["p_smem"] = plgpu.SMEM((2, BLOCK_Q, block_kv), dtype, **_TILED)
    kernel = functools.partial(
        _kernel,
        steps=steps,
        num_tiles=tiles,
        block_kv=block_kv,
        stages=stages,
        group=q_heads // kv_heads,
        scale_log2=scale * LOG2E,
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, steps_pad, q_heads, value_dim), dtype),
        scratch_types=scratch,
        grid=(q_heads, tiles, batch),
        grid_names=("heads", "tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=INTERPRET_PARAMS if interpret else None,
    )(start.astype(jnp.int32), q, k, v)
    return out[:, :steps]


def _check(q, k, v, start, scale, block_q: int, block_kv: int) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, Dk], got {q.shape}")
    batch, _, q_heads, key_dim = q.shape
    if k.ndim != 4 or k.shape[0] != batch or k.shape[3] != key_dim:
        raise ValueError(f"k must be [B, S, Hkv, Dk] with B = {batch}, Dk = {key_dim}, got {k.shape}")
    capacity, kv_heads = k.shape[1], k.shape[2]
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, S, Hkv, Dv] with [B, S, Hkv] = {k.shape[:3]}, got {v.shape}")
    if min(batch, q.shape[1], capacity, kv_heads) < 1:  # Hkv = 0 was a division by zero here
        raise ValueError(f"B, T, S and Hkv must be >= 1, got {batch}, {q.shape[1]}, {capacity}, {kv_heads}")
    if q_heads % kv_heads:
        raise ValueError(f"Hq = {q_heads} must be a multiple of Hkv = {kv_heads}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {x.dtype}")
    if key_dim not in KEY_DIMS:
        raise ValueError(f"Dk must be one of {KEY_DIMS}, got {key_dim}")
    if v.shape[3] not in VALUE_DIMS:
        raise ValueError(f"Dv must be one of {VALUE_DIMS}, got {v.shape[3]}")
    if start.shape != (batch,) or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start must be an integer [B] = ({batch},), got {start.dtype}{list(start.shape)}")
    if block_q != BLOCK_Q:
        raise ValueError(f"block_q must be {BLOCK_Q} (one wgmma tile per warpgroup), got {block_q}")
    if block_kv not in BLOCK_KVS:
        raise ValueError(f"block_kv must be one of {BLOCK_KVS}, got {block_kv}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if capacity % block_kv:
        raise ValueError(f"S = {capacity} must be a multiple of block_kv = {block_kv}")
    stages, _ = smem_plan(key_dim, v.shape[3], block_kv, interpret=False)
    if stages < 2:
        raise ValueError(f"Dk = {key_dim}, Dv = {v.shape[3]} leave {stages} K/V stage(s) at block_kv = {block_kv}")


# CUDA runtimes whose ptxas miscompiles causal masking of this kind (jax's own FA3 kernel refuses them)
BAD_CUDA_RUNTIMES = (12080, 12091)  # [first, end)


@functools.cache  # the runtime does not change within a process; asked at every traced prefill layer
def causal_masking_safe() -> bool:
    """False on a CUDA runtime in BAD_CUDA_RUNTIMES (the dispatch then keeps the XLA path); True where the
    runtime cannot be read (CPU, interpret mode)."""
    try:
        from jax._src.lib import cuda_versions  # jax's own check reads the same

        version = cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 - no CUDA plugin: nothing to guard
        return True
    return version is None or not BAD_CUDA_RUNTIMES[0] <= version < BAD_CUDA_RUNTIMES[1]


def causal_prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    start: jax.Array,
    *,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_kv: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal prefill attention of one chunk on the Mosaic GPU backend (Hopper).

    Args:
      q: bf16 [B, T, Hq, Dk] the chunk's queries, query t of row b at position start[b] + t.
      k: bf16 [B, S, Hkv, Dk], v: bf16 [B, S, Hkv, Dv] the KV cache (holding the chunk's keys).
      start: int [B] (traced) each row's offset: key s is visible to query t iff s <= start[b] + t.
      scale: softmax scale (default Dk ** -0.5); block_q: queries per compute warpgroup (64);
      block_kv: keys per pipelined block (64 or 128); interpret: Mosaic GPU interpret mode (default: on
      the CPU backend).
    Returns:
      bf16 [B, T, Hq, Dv] (softmax and sums in float32).
    """
    _check(q, k, v, start, scale, block_q, block_kv)
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    return _causal_prefill_attention(
        q, k, v, start, scale=scale, block_kv=block_kv, interpret=default_interpret(interpret)
    )


def causal_prefill_attention_reference(q, k, v, start, *, scale=None):
    """The twin in plain XLA: `attention_reference` under the mask s <= start[b] + t."""
    steps, capacity = q.shape[1], k.shape[1]
    positions = start.astype(jnp.int32)[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [B, T]
    mask = jnp.arange(capacity, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    return attention_reference(q, k, v, mask, scale=scale)
