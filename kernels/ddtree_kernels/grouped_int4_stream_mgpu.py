"""Grouped (MoE) INT4 matmul at decode and tree-verify sizes, streamed: a Mosaic GPU (Hopper: TMA + wgmma) kernel
whose persistent CTAs each stream many experts' weight tiles through one TMA ring.

  y[a] = x[a] @ W[e(a)]^T,  x bf16 [A, K] rows sorted by expert (group_sizes int32 [E]),  W INT4 group-32 as
  `quant.Int4Weight` stores it (packed int32 [L, E, N, K / 8], scale [L, E, N, K / 32]),  y bf16 [A, N].

Why: at a tree's 1-2 rows an expert, a call is a stream of weight bytes (the K2.6 TP8 shard's gate at 17 tokens:
118 experts, 122 MB) and little else. The grouped kernels give each CTA (Triton program) one tile's K split, one
or two K steps: its loads have nothing of its own to overlap with, so the call's bandwidth is what the resident
CTAs keep in flight between their fixed costs (the Triton kernel: 28-58% of the copy bandwidth at these sizes,
BENCHMARKS.md). Here a fixed grid of `num_ctas` CTAs (one an SM) walks a list of work items, and each CTA's
memory warpgroup runs its TMA ring across its items without a break: the next item's tiles load while the
current one is multiplied, so each SM always has `stages` steps of bytes in flight.

Kernel (`plgpu.kernel`, grid (num_ctas,), three warpgroups a CTA):
  items     (tile, chunk, column block): a row tile of `decode_matmul.row_tiles` (align 8: an expert's rows from
            its first row rounded down to 8, block_m rows: up to block_m - 7 rows in one tile), `chunk_steps`
            consecutive K steps of block_k, and 128 output columns. The used tiles come first in the table, so
            the items are the first used x chunks x column blocks of the flattened (tile, chunk, column block)
            order, column blocks fastest; CTA c takes items c, c + num_ctas, ... (a count read from the table).
  ring      the memory warpgroup's TMA loads, step after step over all its items ([128, block_k] codes, [block_m,
            block_k] x rows, [128, block_k / 32] scales a step), `stages` slots ahead of the compute warpgroups.
  compute   per item, as `grouped_int4_mgpu`: "swap A/B" (the 128 weight rows wgmma's M over two compute
            warpgroups of 64, the tile's block_m token rows its N), each 32-column scale group dequantised in
            the registers (`grouped_int4_mgpu.issue_step_wgmmas`), acc = y^T [64, block_m] float32 over the
            item's steps; then the item's [block_m, 64] tile goes out by TMA from one of two output buffers used
            in turn (a store waits only for the one two items back), as float32 partial sums [chunks, T, block_m,
            N] that the wrapper adds (bf16 [T, block_m, N] at one chunk).
  chunks    K is cut into `chunks` (dividing K's steps) so that there are enough items for every CTA
            (`stream_plan`: ~4 an SM for the table's largest count of tiles).

Measured (one H200, the K2.6 TP8 shard's gate, BENCHMARKS.md): exact, but slower than the Triton grouped kernel at
every size swept: 122-130 / 154-178 / 317-354 us at 9 / 17 / 65 tokens against 100.6 / 131.8 / 269.5 (20-32% of
the copy bandwidth). More ring slots do not help, so the compute warpgroups, which wait for each step's wgmmas before
releasing its slot and dequantising the next, are the limit. Not routed by "auto".

Constraints (ValueError otherwise): x bf16 [A, K]; N % 128 == 0; K % 256 == 0 (block_k 256); block_m in (8, 16).

Interpret mode (CPU; `interpret=None` picks it there) stages each dequantised group through shared memory, as
`grouped_int4_mgpu` does; run with NPROC=64
(`mosaic_common.INTERPRET_NPROC`).

`streamed_int4_matmul_reference` is the twin (`decode_matmul.grouped_matmul_reference`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.decode_matmul import (
    check_group_sizes,
    grouped_matmul_reference,
    max_row_tiles,
    row_tile_index,
    row_tiles,
)
from ddtree_kernels.grouped_int4_mgpu import (
    _W_TRANSFORMS,
    _X_TRANSFORMS,
    BLOCK_N,
    NUM_SMS,
    ROW_ALIGN,
    SMEM_BUDGET,
    WG_ROWS,
    _check_weight,
    issue_step_wgmmas,
    transposed_scales,
)
from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, layer_index
from ddtree_kernels.quant import INT4_GROUP, Int4Weight
from ddtree_kernels.tiling import default_interpret

BLOCK_K = 256  # K elements a pipeline step (a step's scales [64, 8] are one 8-column tile, read in place)
STREAM_BLOCK_MS = (8, 16)  # token rows a tile (wgmma's N): 16 keeps an expert of <= 9 rows in one tile
# block_m's default: 8 up to this many rows (one token's top-8: every expert holds one row, and 8-row tiles write
# half the float32 partial sums of 16-row ones), else 16
SMALL_ROWS = 8
MAX_STAGES = 8
ITEMS_PER_CTA = 4  # `stream_plan` cuts K until the largest table gives about this many items a CTA
INTERPRET_CTAS = 4  # interpret mode's default grid: each CTA is three host threads, one after another


def stream_stage_bytes(block_m: int, scale_bytes: int = 2) -> int:
    """One ring slot: the INT4 codes [128, 256], the x rows [block_m, 256] bf16, the scales [128, 8] (bf16, or
    float32: scale_bytes 4)."""
    return BLOCK_N * BLOCK_K // 2 + block_m * BLOCK_K * 2 + BLOCK_N * (BLOCK_K // INT4_GROUP) * scale_bytes


def stream_fixed_bytes(block_m: int, interpret: bool, scale_bytes: int = 2) -> int:
    """Outside the ring: two output buffers [2 (wg), block_m, 64] float32, the transposed scales [2, 2, 8, 64],
    and in interpret mode the staged A tiles [2, 64, 32] bf16."""
    staged = 2 * WG_ROWS * INT4_GROUP * 2 if interpret else 0
    return 2 * 2 * block_m * WG_ROWS * 4 + 2 * 2 * (BLOCK_K // INT4_GROUP) * WG_ROWS * scale_bytes + staged


def stream_plan(rows: int, experts: int, n: int, k: int, block_m: int, num_ctas: int = NUM_SMS) -> int:
    """The fewest K chunks (dividing K's steps) for which the table's largest count of used tiles (`max_row_tiles`,
    less its spare) x chunks x column blocks gives ITEMS_PER_CTA items to each of num_ctas CTAs, else one step a
    chunk."""
    steps = k // BLOCK_K
    tiles = max_row_tiles(rows, experts, block_m) - 1
    column_blocks = n // BLOCK_N
    return next(
        (c for c in range(1, steps + 1) if steps % c == 0 and tiles * c * column_blocks >= ITEMS_PER_CTA * num_ctas),
        steps,
    )


def _kernel(
    tiles_ref,
    items_ref,
    x_ref,
    w_ref,
    s_ref,
    o_ref,
    w_smem,
    x_smem,
    s_smem,
    st_smem,
    o_smem,
    loaded,
    consumed,
    *a_smem,
    block_m: int,
    chunk_steps: int,
    chunks: int,
    column_blocks: int,
    num_ctas: int,
    stages: int,
    interpret: bool,
):
    # GMEM: tiles_ref i32 [4, T] (expert, first row (a multiple of 8), rows, layer), the used tiles first;
    #   items_ref i32 [1] the work items (used tiles x chunks x column blocks); x_ref bf16 [A_pad, K] (A in whole
    #   8-row tiles); w_ref int4 [L, E, N, K] the stored codes; s_ref [L, E, N, K / 32] the stored scales;
    #   o_ref [chunks, T, block_m, N] each chunk's rows of each tile (bf16 at one chunk, float32 partial sums above).
    # SMEM: w_smem int4 [stages, 128, 256]; x_smem bf16 [stages, block_m, 256]; s_smem [stages, 128, 8] (bf16 or float32);
    #   st_smem [2, 2, 8, 64] each compute warpgroup's scales transposed (two buffers used in turn);
    #   o_smem [2, 2, block_m, 64] two output buffers (used in turn) of each compute warpgroup; loaded[stages]
    #   (3 TMA arrivals); consumed[stages] (2: each compute warpgroup's wgmmas on the slot done); interpret mode
    #   only: a_smem bf16 [2, 64, 32] each warpgroup's dequantised group.
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    my_items = jnp.maximum(items_ref[0] - cta + num_ctas - 1, 0) // num_ctas  # items cta, cta + num_ctas, ...
    my_steps = my_items * chunk_steps
    groups = BLOCK_K // INT4_GROUP

    def item_of(j):
        """This CTA's j-th item -> (tile, chunk, column block)."""
        item = cta + j * num_ctas
        column_block = lax.rem(item, column_blocks)
        rest = lax.div(item, column_blocks)
        return lax.div(rest, chunks), lax.rem(rest, chunks), column_block

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(step, slot):
            """This CTA's `step`-th step (over all its items) into ring slot `slot`."""
            tile, chunk, column_block = item_of(lax.div(step, chunk_steps))
            expert, layer = tiles_ref[0, tile], tiles_ref[3, tile]
            first = pl.multiple_of(tiles_ref[1, tile], ROW_ALIGN)
            k_step = chunk * chunk_steps + lax.rem(step, chunk_steps)
            cols, columns = pl.ds(k_step * BLOCK_K, BLOCK_K), pl.ds(column_block * BLOCK_N, BLOCK_N)
            barrier = loaded.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[layer, expert, columns, cols], w_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(first, block_m), cols], x_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(
                s_ref.at[layer, expert, columns, pl.ds(k_step * groups, groups)], s_smem.at[slot], barrier
            )

        # the ring over a traced count of steps (`mosaic_common.feed_ring` with dynamic bounds): the first
        # `stages` at once, each later one once its slot is released, then the last releases observed
        @pl.loop(0, jnp.minimum(my_steps, stages))
        def _fill(step):
            load(step, step)

        @pl.loop(stages, jnp.maximum(my_steps, stages))
        def _steady(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(consumed.at[slot])
            load(step, slot)

        @pl.loop(jnp.maximum(my_steps - stages, 0), my_steps)
        def _drain(step):
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        staged = a_smem[0] if interpret else None

        @pl.loop(0, my_items)
        def _item(j):
            tile, chunk, column_block = item_of(j)

            def product(acc_ref):  # acc_ref f32 [64, block_m]: y^T of this warpgroup's 64 columns of the item
                @pl.loop(0, chunk_steps)
                def _step(i):
                    step = j * chunk_steps + i
                    slot = lax.rem(step, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    scales = transposed_scales(s_smem, st_smem, wg, step, slot, interpret=interpret)
                    issue_step_wgmmas(acc_ref, w_smem, x_smem, scales, slot, wg, groups, staged, interpret=interpret)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])

                return acc_ref[...]

            acc = pl.run_scoped(product, plgpu.ACC((WG_ROWS, block_m), jnp.float32))
            out = o_smem.at[lax.rem(j, 2), wg]  # [block_m, 64]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store of two items back has read this buffer
            out.transpose((1, 0))[...] = plgpu.layout_cast(acc.astype(out.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            columns = pl.ds(column_block * BLOCK_N + wg * WG_ROWS, WG_ROWS)
            plgpu.copy_smem_to_gmem(out, o_ref.at[chunk, tile, :, columns])

        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block_m", "chunks", "num_ctas", "stages", "interpret"))
def _streamed(x, packed, scale, table, index, *, block_m, chunks, num_ctas, stages, interpret):
    """x [A, K] bf16, the stored codes / scales of every layer [L, E, N, K / 8] / [L, E, N, K / 32], table i32 [4,
    T] the tiles (expert, first row, rows, layer; the used tiles first), index i32 [A] each row's place in the
    tile-major buffer [T * block_m] -> bf16 [A, N]."""
    rows, k = x.shape
    num_layers, experts, n, _ = packed.shape
    num_tiles = table.shape[1]
    column_blocks = n // BLOCK_N
    codes = lax.bitcast_convert_type(packed, jnp.int4).reshape(num_layers, experts, n, k)
    if scale.dtype not in (jnp.bfloat16, jnp.float32):
        scale = scale.astype(jnp.float32)
    # whole 8-row TMA tiles; the interpreter's slice of the last tile would clamp and shift: room for it there
    padded = pl.cdiv(rows, ROW_ALIGN) * ROW_ALIGN + (block_m if interpret else 0)
    x_in = jnp.pad(x, ((0, padded - rows), (0, 0)))
    items = ((table[2] > 0).sum(dtype=jnp.int32) * chunks * column_blocks).reshape(1)
    out_dtype = jnp.bfloat16 if chunks == 1 else jnp.float32
    groups = BLOCK_K // INT4_GROUP
    kernel = functools.partial(
        _kernel,
        block_m=block_m,
        chunk_steps=k // BLOCK_K // chunks,
        chunks=chunks,
        column_blocks=column_blocks,
        num_ctas=num_ctas,
        stages=stages,
        interpret=interpret,
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((chunks, num_tiles, block_m, n), out_dtype),
        scratch_types=(
            plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.int4, transforms=_W_TRANSFORMS),
            plgpu.SMEM((stages, block_m, BLOCK_K), jnp.bfloat16, transforms=_X_TRANSFORMS),
            plgpu.SMEM((stages, BLOCK_N, groups), scale.dtype),
            plgpu.SMEM((2, 2, groups, WG_ROWS), scale.dtype),
            plgpu.SMEM((2, 2, block_m, WG_ROWS), out_dtype),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        )
        + ((plgpu.SMEM((2, WG_ROWS, INT4_GROUP), jnp.bfloat16),) if interpret else ()),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        interpret=INTERPRET_PARAMS if interpret else None,
    )(table, items, x_in, codes, scale)
    # rows of unused tiles are never written: only the rows `index` names are read
    out = out.reshape(chunks, num_tiles * block_m, n)[:, index]
    return (out[0] if chunks == 1 else out.sum(0)).astype(jnp.bfloat16)


def streamed_int4_matmul(
    x: jax.Array,
    weight: Int4Weight,
    group_sizes: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    block_m: int | None = None,
    chunks: int | None = None,
    stages: int | None = None,
    num_ctas: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Rows of x [A, K] bf16 sorted by expert (group_sizes int32 [E], summing to A) against INT4 expert weights
    [E, N, K] (or every layer's [L, E, N, K] with `layer`, an int or int32 scalar: read in place) -> bf16 [A, N],
    row a = x[a] @ W[e(a)]^T, by persistent CTAs streaming their work items through one TMA ring (module
    docstring). block_m: token rows a tile (8 or 16; None: 8 up to SMALL_ROWS rows, else 16); chunks: K chunks an item (dividing K / 256; None:
    `stream_plan`); stages: ring slots (None: as many as fit, up to MAX_STAGES); num_ctas: CTAs launched at most
    (None: one an SM, NUM_SMS; INTERPRET_CTAS in interpret mode); interpret: Mosaic GPU interpret mode (None: on
    the CPU backend)."""
    weight, layer = _check_weight(weight, layer)
    num_layers, experts, n, k = weight.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [A, K] with K = {k}, got {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if group_sizes.shape != (experts,):
        raise ValueError(f"group_sizes must have one entry per expert ({experts},), got {group_sizes.shape}")
    check_group_sizes(group_sizes, x.shape[0])
    if n % BLOCK_N or k % BLOCK_K:
        raise ValueError(f"N = {n} must be a multiple of {BLOCK_N} and K = {k} of {BLOCK_K}")
    rows = x.shape[0]
    if block_m is None:
        block_m = 8 if rows <= SMALL_ROWS else 16
    if block_m not in STREAM_BLOCK_MS:
        raise ValueError(f"block_m must be one of {STREAM_BLOCK_MS}, got {block_m}")
    interpret = default_interpret(interpret)
    if num_ctas is None:
        num_ctas = INTERPRET_CTAS if interpret else NUM_SMS
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
    if chunks is None:
        chunks = stream_plan(rows, experts, n, k, block_m, num_ctas)
    elif chunks < 1 or (k // BLOCK_K) % chunks:
        raise ValueError(f"chunks must divide K's {k // BLOCK_K} steps of {BLOCK_K}, got {chunks}")
    scale_bytes = 2 if weight.scale.dtype == jnp.bfloat16 else 4
    fixed = stream_fixed_bytes(block_m, interpret, scale_bytes)
    room = (SMEM_BUDGET - fixed) // stream_stage_bytes(block_m, scale_bytes)
    stages = min(MAX_STAGES, room) if stages is None else stages
    if not 1 <= stages <= room:
        raise ValueError(f"stages must be in [1, {room}] (shared memory at block_m = {block_m}), got {stages}")
    group_sizes = group_sizes.astype(jnp.int32)
    num_tiles = max_row_tiles(rows, experts, block_m)
    table = row_tiles(group_sizes, block_m, num_tiles, align=ROW_ALIGN)
    layer = layer_index(jnp.asarray(layer, jnp.int32), num_layers)
    table = jnp.concatenate([table, jnp.broadcast_to(layer, (1, num_tiles))])
    index = row_tile_index(group_sizes, rows, block_m, align=ROW_ALIGN)
    return _streamed(
        x,
        weight.packed,
        weight.scale,
        table,
        index,
        block_m=block_m,
        chunks=chunks,
        num_ctas=max(1, min(num_ctas, num_tiles * chunks * (n // BLOCK_N))),  # no more CTAs than items
        stages=stages,
        interpret=interpret,
    )


def streamed_int4_matmul_reference(x: jax.Array, weight: Int4Weight, group_sizes: jax.Array, *, layer=None):
    """The twin: each row against its expert's dequantised weights, in x's dtype."""
    return grouped_matmul_reference(x, weight, group_sizes, layer=layer)
