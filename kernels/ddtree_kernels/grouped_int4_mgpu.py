"""Grouped (MoE) INT4 matmul as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel: prefill-sized calls, and a decode form.

  y[a] = x[a] @ W[e(a)]^T,  x bf16 [A, K] rows sorted by expert (group_sizes int32 [E]),  W INT4 group-32 as
  `quant.Int4Weight` stores it (packed int32 [L, E, N, K / 8]: the codes c = q + 8, element k of a word in
  bits 4k..4k+3; scale [L, E, N, K / 32]),  y bf16 [A, N] (float32 accumulation).

Why: the Triton grouped kernel (`decode_matmul.grouped_matmul`) dequantises each weight tile into shared
memory and dots it at 63-69 TFLOP/s on a 2,048-token K2.6 chunk; the tensor cores do 990. Here the weights
reach the tensor cores through the registers, as wgmma's A operand, dequantised on the way.

Kernel (`plgpu.kernel`, grid (row tiles, K splits, N / 128), three warpgroups a CTA):
  operands  "swap A/B": the weight rows are wgmma's M (two compute warpgroups of 64 rows: a CTA owns 128
            output columns of one expert), the tile's token rows its N (block_m = 8 ... 128), K the
            contraction. Per K step (block_k elements) a memory warpgroup TMA-loads the expert's INT4 tile
            [128, block_k], the tile's x rows [block_m, block_k] and the scales as stored [128, block_k / 32]
            into a ring of `stages` shared-memory slots. Each compute warpgroup then transposes its [64, block_k /
            32] scales through the registers into its own [block_k / 32, 64] buffer (two, used in turn; a
            warpgroup barrier before they are read), and for each 32-wide scale group j of the step: loads its
            [64, 32] codes (WGMMA_UPCAST_4X: 8 nibbles a thread), widens them to int8, maps the stored code to
            q = c - 8 with one XOR (the int8 of the signed nibble v is c or c - 16; v ^ -8 == c - 8), converts
            to bf16, multiplies by its rows' scales (row j of its buffer, a row vector, broadcast) and issues
            wgmma(acc, W_j [64, 32] registers, x_j^T [32, block_m]); the step's wgmmas run while the next group
            is dequantised. acc = y^T [64, block_m] float32.
  tiles     per expert, row tiles of block_m from its first row rounded down to a multiple of 8 (a TMA into
            the 8-row-tiled x slot starts at a multiple of 8; `decode_matmul.row_tiles(align=8)`): an expert of
            up to block_m - 7
            rows is one tile, so its weights stream once. A tile computes all its block_m rows (rows of the
            neighbouring experts, or zeros past A, computed and never kept). Each tile's [block_m, 128] output
            goes to its own slot of a tile-major buffer [T, block_m, N] (TMA store), and the wrapper gathers
            every row from its tile (one XLA gather, [A, N]). T <= A // block_m + E + 1 (`max_row_tiles`).
  K splits  `k_splits` CTAs share a tile's K (each its K / k_splits), writing float32 partial sums [S, T,
            block_m, N] that the wrapper adds: for calls of few tiles, so that their weights stream on every SM.
  grid      (row tiles, K splits, N / 128) with the column blocks fastest: the CTAs of one tile run side by
            side and read its x rows from L2 (x re-read from HBM per column block would be 16 x A x K x 2 bytes
            at N = 2,048).
  scales    read in place, as `Int4Weight` stores them ([L, E, N, K / 32]; a step's [128, block_k / 32] box has
            16-byte rows at block_k 256): no per-call copy (the first version transposed the layer's scales in
            XLA every call, 352 MB a K2.6 projection). block_k is therefore a multiple of 256 (the [64, block_k
            / 32] register tile is whole 8-column tiles).
  layer     with every layer's experts stacked ([L, E, N, K / 8]), the tile table carries the layer and the
            codes and scales are read in place (no per-call copy of a layer's experts).

The decode form, `gathered_int4_matmul(x [A, K], weight, experts [A])`: each (token, expert) assignment is its
own tile of 8 rows (wgmma's smallest N; the 8-row block of x around its row, only that row kept), so there is no
sort, no group table and no gather of weights; K is split (`decode_k_splits`) until the grid covers the SMs.
For the few assignments of a decode step (the K2.6 TP8 shard at one token: 8 experts x 2 x 256 gate / up rows
and 7,168 down rows, ~22 MB of codes).

Constraints (ValueError otherwise): x bf16 [A, K]; N % 128 == 0; block_k a multiple of 256 and K of block_k x
k_splits; block_m in (8, 16, 32, 64, 128).

Interpret mode (CPU; `interpret=None` picks it there): jax 0.11's interpreter takes no wgmma operand from the
registers, so there each group's dequantised tile is staged through shared memory (`a_smem`) and read from
there: the same values. Start the process with NPROC=64 (`mosaic_common.INTERPRET_NPROC`: the
warpgroups run as threads that block in host callbacks).

`grouped_int4_matmul_reference` is the twin (`decode_matmul.grouped_matmul_reference`: each row against its
expert's dequantised weights); `gathered_int4_matmul_reference` the decode form's.
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
from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, feed_ring, layer_index
from ddtree_kernels.quant import INT4_GROUP, Int4Weight
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret

BLOCK_N = 128  # output columns (weight rows) per CTA: two compute warpgroups of 64, wgmma's M
WG_ROWS = 64
BLOCK_MS = (8, 16, 32, 64, 128)  # token rows per tile: wgmma's N (8 - 32: decode, `gathered_int4_matmul`)
DEFAULT_BLOCK_M = 64  # 2.998 against 3.783 ms for 128 at a 2,048-token K2.6 chunk (gate, efb2e2f)
ROW_ALIGN = 8  # a tile's first row: the x slot is tiled by 8 rows, and a TMA box starts on a whole tile
DEFAULT_BLOCK_K = 256  # K elements per pipeline step
SCALE_STEP = 256  # block_k's multiple: a step's scales [64, block_k / 32], read in place, are whole 8-column tiles
NUM_SMS = 132  # H200: `decode_k_splits` fills them
# shared memory a CTA may plan: the ring and the output tiles (barriers and Mosaic's own scratch below the rest)
SMEM_BUDGET = SMEM_LIMIT_BYTES - 8 * 1024
_X_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))  # bf16: 32 elements = 64 bytes
_W_TRANSFORMS = (plgpu.TilingTransform((8, 32)),)  # int4: 32 elements = 16 bytes, one 128-byte tile of 8 rows


def stage_bytes(block_m: int, block_k: int, scale_bytes: int = 2) -> int:
    """One ring slot: the INT4 tile [128, block_k], the x tile [block_m, block_k] bf16, the scales [block_k / 32,
    128] (bf16, or float32: scale_bytes 4)."""
    return BLOCK_N * block_k // 2 + block_m * block_k * 2 + (block_k // INT4_GROUP) * BLOCK_N * scale_bytes


def _fixed_bytes(
    block_m: int, interpret: bool, block_k: int = DEFAULT_BLOCK_K, scale_bytes: int = 2, out_bytes: int = 2
) -> int:
    """Outside the ring: the two output tiles [block_m, 64] (bf16, or float32 partial sums: out_bytes 4), each
    compute warpgroup's two transposed scale tiles [block_k / 32, 64] (scales read in place), and in interpret
    mode the staged A tiles [2, 64, 32] bf16."""
    transposed_scales = 2 * 2 * (block_k // INT4_GROUP) * WG_ROWS * scale_bytes
    staged = 2 * WG_ROWS * INT4_GROUP * 2 if interpret else 0
    return 2 * block_m * WG_ROWS * out_bytes + transposed_scales + staged


def smem_bytes(
    block_m: int, block_k: int, stages: int, interpret: bool = False, scale_bytes: int = 2, out_bytes: int = 2
) -> int:
    """A CTA's shared memory: the ring and `_fixed_bytes`."""
    fixed = _fixed_bytes(block_m, interpret, block_k, scale_bytes, out_bytes)
    return stages * stage_bytes(block_m, block_k, scale_bytes) + fixed


def fit_stages(
    block_m: int, block_k: int, k: int, interpret: bool = False, scale_bytes: int = 2, out_bytes: int = 2
) -> int:
    """The most ring slots (<= 4, <= the K steps) that fit SMEM_BUDGET."""
    fixed = _fixed_bytes(block_m, interpret, block_k, scale_bytes, out_bytes)
    room = (SMEM_BUDGET - fixed) // stage_bytes(block_m, block_k, scale_bytes)
    return max(1, min(4, k // block_k, room))


def _dequantize(codes, scale):
    """codes int4 [64, 32] as loaded (the stored nibble c read as a signed v: c or c - 16), scale [64] ->
    (c - 8) * scale in bf16 [64, 32]."""
    q = codes.astype(jnp.int8) ^ jnp.int8(-8)  # v ^ 0b1111_1000 == c - 8 for both signs of v
    if scale.dtype == jnp.bfloat16:
        return q.astype(jnp.bfloat16) * lax.broadcast_in_dim(scale, q.shape, [0])
    return (q.astype(jnp.float32) * lax.broadcast_in_dim(scale.astype(jnp.float32), q.shape, [0])).astype(jnp.bfloat16)


def transposed_scales(s_smem, st_smem, wg, step, slot, *, interpret: bool):
    """Compute warpgroup wg's scales of pipeline step `step` (in ring slot `slot`), s_smem [stages, 128, groups] as
    stored (a row's groups side by side) -> its [groups, 64] buffer of st_smem [2 (wg), 2, groups, 64] (buffers
    used in turn by step), so group j's 64 scales are one row; fenced for the warpgroup's threads."""
    rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)
    buffer = st_smem.at[wg, lax.rem(step, 2)]
    if interpret:
        buffer.transpose((1, 0))[...] = s_smem.at[slot, rows][...]
    else:
        stored = plgpu.load(s_smem.at[slot, rows], layout=plgpu.Layout.WGMMA)
        buffer.transpose((1, 0))[...] = plgpu.layout_cast(stored, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()  # a warpgroup barrier: every thread's writes seen before any reads a row
    return buffer


def issue_step_wgmmas(acc_ref, w_smem, x_smem, scales, slot, wg, groups: int, a_smem, *, interpret: bool):
    """Compute warpgroup wg's wgmmas of one pipeline step: for each 32-wide scale group j, its [64, 32] codes of
    w_smem[slot] dequantised with row j of `scales` (`transposed_scales`) against x_smem[slot]'s group j,
    transposed: acc_ref f32 [64, block_m] += W_j x_j^T. Interpret mode stages each W_j through a_smem[wg]."""
    rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)
    for j in range(groups):
        span = pl.ds(j * INT4_GROUP, INT4_GROUP)
        x_group = x_smem.at[slot, :, span].transpose((1, 0))  # [32, block_m]
        if interpret:
            codes = w_smem.at[slot, rows, span][...]
            a_smem.at[wg][...] = _dequantize(codes, scales.at[j][...])
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, a_smem.at[wg], x_group)
        else:
            codes = plgpu.load(w_smem.at[slot, rows, span], layout=plgpu.Layout.WGMMA_UPCAST_4X)
            codes = plgpu.layout_cast(codes, plgpu.Layout.WGMMA)
            scale = plgpu.load(scales.at[j], layout=plgpu.Layout.WGMMA.reduce(1))
            plgpu.wgmma(acc_ref, _dequantize(codes, scale), x_group)


def _kernel(
    tiles_ref,
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
    block_k: int,
    k_steps: int,
    stages: int,
    deferred_release: bool,
    interpret: bool,
):
    # GMEM: tiles_ref i32 [4, T] (expert, first row (a multiple of 8), rows, layer) of each tile (rows 0: unused);
    #   x_ref bf16 [A_pad, K] (A in whole 8-row tiles, zeros past A); w_ref int4 [L, E, N, K] the stored codes;
    #   s_ref [L, E, N, K / 32] the stored scales, read in place; o_ref [S, T, block_m, N] each K split's rows of
    #   each tile (bf16 at S = 1, float32 partial sums above).
    # SMEM: w_smem int4 [stages, 128, block_k]; x_smem bf16 [stages, block_m, block_k]; s_smem [stages, 128,
    #   block_k / 32] the scales as stored; st_smem [2, 2, block_k / 32, 64] each compute warpgroup's scales
    #   transposed, two buffers used in turn; o_smem [2, block_m, 64] each compute warpgroup's y tile;
    #   loaded[stages] (3 TMA arrivals); consumed[stages] (2: each compute warpgroup's wgmmas on the slot done);
    #   interpret mode only: a_smem bf16 [2, 64, 32] each warpgroup's dequantised group.
    column_block, tile, split, wg = (lax.axis_index(name) for name in ("n", "tile", "split", "wg"))
    expert, count, layer = tiles_ref[0, tile], tiles_ref[2, tile], tiles_ref[3, tile]
    first = pl.multiple_of(tiles_ref[1, tile], ROW_ALIGN)
    n0 = column_block * BLOCK_N
    groups = block_k // INT4_GROUP
    step0 = split * k_steps  # this K split's first step

    @pl.when((count > 0) & (wg == 2))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(i, slot):
            step = step0 + i
            cols = pl.ds(step * block_k, block_k)
            barrier = loaded.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[layer, expert, pl.ds(n0, BLOCK_N), cols], w_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(first, block_m), cols], x_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(
                s_ref.at[layer, expert, pl.ds(n0, BLOCK_N), pl.ds(step * groups, groups)], s_smem.at[slot], barrier
            )

        feed_ring(load, k_steps, stages, consumed)

    @pl.when((count > 0) & (wg < 2))
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def product(acc_ref):  # acc_ref f32 [64, block_m]: y^T of this warpgroup's 64 columns
            @pl.loop(0, k_steps)
            def _step(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(loaded.at[slot])
                scales = transposed_scales(s_smem, st_smem, wg, i, slot, interpret=interpret)
                staged = a_smem[0] if interpret else None
                issue_step_wgmmas(acc_ref, w_smem, x_smem, scales, slot, wg, groups, staged, interpret=interpret)
                if deferred_release:  # this step's wgmmas stay in flight; the previous step's are done
                    plgpu.wgmma_wait(groups)

                    @pl.when(i > 0)
                    def _release_previous():
                        plgpu.barrier_arrive(consumed.at[lax.rem(i + stages - 1, stages)])

                else:
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])

            if deferred_release:
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[(k_steps - 1) % stages])
            return acc_ref[...]

        acc = pl.run_scoped(product, plgpu.ACC((WG_ROWS, block_m), jnp.float32))
        out = o_smem.at[wg]  # [block_m, 64]
        # y^T [64, block_m] in registers -> the transposed layout, whose 2-element vectors run along y's rows
        out.transpose((1, 0))[...] = plgpu.layout_cast(acc.astype(out.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, o_ref.at[split, tile, :, pl.ds(n0 + wg * WG_ROWS, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_k", "stages", "k_splits", "deferred_release", "interpret")
)
def _grouped_int4(x, packed, scale, table, index, *, block_m, block_k, stages, k_splits, deferred_release, interpret):
    """x [A, K] bf16, the stored codes / scales of every layer [L, E, N, K / 8] / [L, E, N, K / 32], table i32 [4,
    T] the tiles (expert, first row, rows, layer), index i32 [A'] each output row's place in the tile-major buffer
    [T * block_m] -> bf16 [A', N]."""
    rows, k = x.shape
    num_layers, experts, n, _ = packed.shape
    num_tiles = table.shape[1]
    # the stored words as int4 codes [L, E, N, K] (element k of a word in bits 4k..4k+3, XLA's int4 order)
    codes = lax.bitcast_convert_type(packed, jnp.int4).reshape(num_layers, experts, n, k)
    if scale.dtype not in (jnp.bfloat16, jnp.float32):
        scale = scale.astype(jnp.float32)
    # the rows in whole 8-row TMA tiles (no copy when A is a multiple of 8); compiled, the last tile's TMA past
    # them reads zeros, while the interpreter's slice would clamp and shift: there, room for the whole tile
    padded = pl.cdiv(rows, ROW_ALIGN) * ROW_ALIGN + (block_m if interpret else 0)
    x_in = jnp.pad(x, ((0, padded - rows), (0, 0)))
    out_dtype = jnp.bfloat16 if k_splits == 1 else jnp.float32
    kernel = functools.partial(
        _kernel,
        block_m=block_m,
        block_k=block_k,
        k_steps=k // block_k // k_splits,
        stages=stages,
        deferred_release=deferred_release,
        interpret=interpret,
    )
    groups = block_k // INT4_GROUP
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_splits, num_tiles, block_m, n), out_dtype),
        scratch_types=(
            plgpu.SMEM((stages, BLOCK_N, block_k), jnp.int4, transforms=_W_TRANSFORMS),
            plgpu.SMEM((stages, block_m, block_k), jnp.bfloat16, transforms=_X_TRANSFORMS),
            plgpu.SMEM((stages, BLOCK_N, groups), scale.dtype),
            plgpu.SMEM((2, 2, groups, WG_ROWS), scale.dtype),
            plgpu.SMEM((2, block_m, WG_ROWS), out_dtype),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        )
        + ((plgpu.SMEM((2, WG_ROWS, INT4_GROUP), jnp.bfloat16),) if interpret else ()),
        grid=(num_tiles, k_splits, n // BLOCK_N),  # the last grid axis is CUDA's x, launched fastest
        grid_names=("tile", "split", "n"),
        num_threads=3,
        thread_name="wg",
        interpret=INTERPRET_PARAMS if interpret else None,
    )(table, x_in, codes, scale)
    out = out.reshape(k_splits, num_tiles * block_m, n)[:, index]
    return (out[0] if k_splits == 1 else out.sum(0)).astype(jnp.bfloat16)


def _check_weight(weight: Int4Weight, layer):
    """-> (the weights as every layer's [L, E, N, K], layer): one layer's [E, N, K] gets L = 1."""
    if not isinstance(weight, Int4Weight):
        raise ValueError(f"the Mosaic grouped INT4 kernels take an Int4Weight, got {type(weight).__name__}")
    weight.check_layout("the expert weights")
    if layer is None:
        if weight.packed.ndim != 3:
            raise ValueError(
                f"expert weights must be [E, N, K], got shape {weight.shape} (all layers' [L, E, N, K]: pass layer=)"
            )
        return jax.tree.map(lambda a: a[None], weight), 0
    if weight.packed.ndim != 4:
        raise ValueError(f"with layer= the expert weights must be [L, E, N, K], got shape {weight.shape}")
    return weight, layer


def _plan(x, weight, block_m, block_k, stages, k_splits, interpret):
    """Checks the shapes and options -> (block_k, stages, interpret)."""
    _, _, n, k = weight.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [A, K] with K = {k}, got {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if n % BLOCK_N:
        raise ValueError(f"N = {n} must be a multiple of {BLOCK_N} (the weights are never padded)")
    if block_m not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {block_m}")
    if k_splits < 1:
        raise ValueError(f"k_splits must be >= 1, got {k_splits}")
    if block_k is None:
        block_k = DEFAULT_BLOCK_K
    if block_k % SCALE_STEP or k % (block_k * k_splits):
        raise ValueError(
            f"block_k = {block_k} must be a multiple of {SCALE_STEP} (the scales of a K step are read in place as "
            f"[64, block_k / 32] tiles of whole 8-column tiles) and K = {k} a multiple of block_k x k_splits = "
            f"{block_k} x {k_splits}"
        )
    interpret = default_interpret(interpret)
    # the scales as the kernel takes them: bf16 or float32 (other dtypes are widened to float32)
    scale_bytes = 2 if weight.scale.dtype == jnp.bfloat16 else 4
    out_bytes = 2 if k_splits == 1 else 4
    steps = k // block_k // k_splits
    if stages is None:
        stages = fit_stages(block_m, block_k, steps * block_k, interpret, scale_bytes, out_bytes)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    nbytes = smem_bytes(block_m, block_k, stages, interpret, scale_bytes, out_bytes)
    if nbytes > SMEM_BUDGET:
        raise ValueError(
            f"stages = {stages} at block_m = {block_m}, block_k = {block_k} take {nbytes} bytes of shared memory, "
            f"over {SMEM_BUDGET}"
        )
    return block_k, stages, interpret


def grouped_int4_matmul(
    x: jax.Array,
    weight: Int4Weight,
    group_sizes: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_k: int | None = None,
    stages: int | None = None,
    k_splits: int = 1,
    deferred_release: bool = False,
    interpret: bool | None = None,
) -> jax.Array:
    """Rows of x [A, K] bf16 sorted by expert (group_sizes int32 [E], summing to A) against INT4 expert weights
    [E, N, K] (or every layer's [L, E, N, K] with `layer`, an int or int32 scalar: read in place) -> bf16
    [A, N], row a = x[a] @ W[e(a)]^T; on the Mosaic GPU backend (Hopper), the weights dequantised in the
    registers (module docstring). block_m: token rows per tile (8 - 128; a prefill chunk's 2,048 tokens x
    top-8 over 384 experts is ~43 rows an expert); block_k: K elements per pipeline step (a multiple of 256,
    default 256); stages: ring slots (None: as many as fit); k_splits: CTAs a tile's K is split over (float32
    partial sums, added after; for few tiles); deferred_release: a compute warpgroup leaves each step's wgmmas
    in flight into the next step and releases the step's slot one step later (`wgmma_wait(groups)`; needs 2
    slots and 2 K steps), instead of waiting for them before the next step's dequantisation; interpret: Mosaic
    GPU interpret mode (None: on the CPU backend)."""
    weight, layer = _check_weight(weight, layer)
    num_layers, experts, _, _ = weight.shape
    if group_sizes.shape != (experts,):
        raise ValueError(f"group_sizes must have one entry per expert ({experts},), got {group_sizes.shape}")
    check_group_sizes(group_sizes, x.shape[0])
    block_k, stages, interpret = _plan(x, weight, block_m, block_k, stages, k_splits, interpret)
    if deferred_release and (stages < 2 or x.shape[1] // block_k // k_splits < 2):
        deferred_release = False  # one slot, or one K step: nothing to overlap
    rows = x.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    num_tiles = max_row_tiles(rows, experts, block_m)
    table = row_tiles(group_sizes, block_m, num_tiles, align=ROW_ALIGN)
    layer = layer_index(jnp.asarray(layer, jnp.int32), num_layers)
    table = jnp.concatenate([table, jnp.broadcast_to(layer, (1, num_tiles))])
    index = row_tile_index(group_sizes, rows, block_m, align=ROW_ALIGN)
    return _grouped_int4(
        x,
        weight.packed,
        weight.scale,
        table,
        index,
        block_m=block_m,
        block_k=block_k,
        stages=stages,
        k_splits=k_splits,
        deferred_release=deferred_release,
        interpret=interpret,
    )


def decode_k_splits(assignments: int, n: int, k: int, block_k: int = DEFAULT_BLOCK_K, num_sms: int = NUM_SMS) -> int:
    """`gathered_int4_matmul`'s default K splits: the fewest (dividing K's steps) that give the grid's tiles x
    column blocks at least one CTA per SM (the H200's 132), so that a few experts' weights stream on every SM."""
    steps = k // block_k
    ctas = assignments * (n // BLOCK_N)
    for splits in range(1, steps + 1):
        if steps % splits == 0 and ctas * splits >= num_sms:
            return splits
    return steps


def gathered_int4_matmul(
    x: jax.Array,
    weight: Int4Weight,
    experts: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    k_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Decode form: row a of x [A, K] bf16 (one row per (token, expert) assignment, in any order) against expert
    experts[a] (int32 [A]) of the INT4 weights [E, N, K] (or every layer's, with `layer`) -> bf16 [A, N]. No sort
    and no gather of weights: each assignment is its own 8-row tile (wgmma's smallest N: the tile holds the
    8-row block of x around row a, and only row a is kept), its expert's codes and scales read in place, K split
    over `k_splits` CTAs (default `decode_k_splits`: enough CTAs to cover the SMs). For the few assignments of a
    decode step (K2.6 at one token: 8), where the sorted form's tables and the models' gather path cost more
    launches than the product. Experts are clamped into [0, E) (a traced id is never checked)."""
    weight, layer = _check_weight(weight, layer)
    num_layers, num_experts, n, k = weight.shape
    assignments = x.shape[0] if x.ndim == 2 else -1
    if experts.shape != (assignments,):
        raise ValueError(f"experts must be int32 [A] = ({assignments},), one per row of x, got {experts.shape}")
    if k_splits is None:
        k_splits = decode_k_splits(assignments, n, k, block_k or DEFAULT_BLOCK_K)
    block_k, stages, interpret = _plan(x, weight, ROW_ALIGN, block_k, stages, k_splits, interpret)
    tile = jnp.arange(assignments, dtype=jnp.int32)
    layer = layer_index(jnp.asarray(layer, jnp.int32), num_layers)
    table = jnp.stack(
        [
            jnp.clip(experts.astype(jnp.int32), 0, num_experts - 1),
            tile // ROW_ALIGN * ROW_ALIGN,
            jnp.ones_like(tile),
            jnp.broadcast_to(layer, tile.shape),
        ]
    )
    return _grouped_int4(
        x,
        weight.packed,
        weight.scale,
        table,
        tile * ROW_ALIGN + tile % ROW_ALIGN,
        block_m=ROW_ALIGN,
        block_k=block_k,
        stages=stages,
        k_splits=k_splits,
        deferred_release=False,
        interpret=interpret,
    )


def gathered_int4_matmul_reference(x: jax.Array, weight: Int4Weight, experts: jax.Array, *, layer=None):
    """The decode form's twin: each row against its expert's dequantised weights, float32 sums, bf16 out."""
    dense = weight.dequantize(jnp.float32)
    dense = dense if layer is None else dense[layer]
    w = dense[jnp.clip(experts, 0, dense.shape[0] - 1)]  # [A, N, K]
    return jnp.einsum("ak,ank->an", x.astype(jnp.float32), w).astype(jnp.bfloat16)


def grouped_int4_matmul_reference(x: jax.Array, weight: Int4Weight, group_sizes: jax.Array, *, layer=None):
    """The twin: each row against its expert's dequantised weights, in x's dtype."""
    return grouped_matmul_reference(x, weight, group_sizes, layer=layer)
