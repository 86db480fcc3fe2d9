"""Grouped (MoE) INT4 matmul for prefill-sized calls as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel.

  y[a] = x[a] @ W[e(a)]^T,  x bf16 [A, K] rows sorted by expert (group_sizes int32 [E]),  W INT4 group-32 as
  `quant.Int4Weight` stores it (packed int32 [L, E, N, K / 8]: the codes c = q + 8, element k of a word in
  bits 4k..4k+3; scale [L, E, N, K / 32]),  y bf16 [A, N] (float32 accumulation).

Why: the Triton grouped kernel (`decode_matmul.grouped_matmul`) dequantises each weight tile into shared
memory and dots it at 63-69 TFLOP/s on a 2,048-token K2.6 chunk; the tensor cores do 990. Here the weights
reach the tensor cores through the registers, as wgmma's A operand, dequantised on the way.

Kernel (`plgpu.kernel`, grid (row tiles, N / 128), three warpgroups a CTA):
  operands  "swap A/B": the weight rows are wgmma's M (two compute warpgroups of 64 rows: a CTA owns 128
            output columns of one expert), the tile's token rows its N (block_m = 64 or 128), K the
            contraction. Per K step (block_k elements) a memory warpgroup TMA-loads the expert's INT4 tile
            [128, block_k], the tile's x rows [block_m, block_k] and the scales [block_k / 32, 128] into a ring
            of `stages` shared-memory slots. Each compute warpgroup then, for each 32-wide scale group j of
            the step: loads its [64, 32] codes (WGMMA_UPCAST_4X: 8 nibbles a thread), widens them to int8,
            maps the stored code to q = c - 8 with one XOR (the int8 of the signed nibble v is c or c - 16;
            v ^ -8 == c - 8), converts to bf16, multiplies by its rows' scales (a row vector, broadcast) and
            issues wgmma(acc, W_j [64, 32] registers, x_j^T [32, block_m]); the step's wgmmas run while the
            next group is dequantised. acc = y^T [64, block_m] float32.
  tiles     per expert, row tiles of block_m from its first row rounded down to a multiple of 8 (a TMA into
            the 8-row-tiled x slot starts at a multiple of 8; `decode_matmul.row_tiles(align=8)`): an expert of
            up to block_m - 7
            rows is one tile, so its weights stream once. A tile computes all its block_m rows (rows of the
            neighbouring experts, or zeros past A, computed and never kept). Each tile's [block_m, 128] output
            goes to its own slot of a tile-major buffer [T, block_m, N] (TMA store), and the wrapper gathers
            every row from its tile (one XLA gather, [A, N]). T <= A // block_m + E + 1 (`max_row_tiles`).
  grid      (row tiles, N / 128) with the column blocks fastest: the CTAs of one tile run side by side and read
            its x rows from L2 (x re-read from HBM per column block would be 16 x A x K x 2 bytes at N = 2,048).
  scales    the layer's scales transposed per call to [E, K / 32, N] (a row of 128 columns is one TMA box
            row; a warpgroup's 64 scales of group j load as one row vector).
  layer     with every layer's experts stacked ([L, E, N, K / 8]), the tile table carries the layer and the
            codes are read in place (no per-call copy of a layer's experts).

Constraints (ValueError otherwise): x bf16 [A, K]; N % 128 == 0; K % block_k == 0; block_k a multiple of 64
(the x tile's 64-byte swizzle spans 32 elements, one scale group); block_m in (64, 128).

Interpret mode (CPU; `interpret=None` picks it there): jax 0.11's interpreter takes no wgmma operand from the
registers, so there each group's dequantised tile is staged through shared memory (`a_smem`) and read from
there: the same values. Start the process with NPROC=8 on a machine with fewer than 4 cores (the warpgroups
run as threads that block in host callbacks).

`grouped_int4_matmul_reference` is the twin (`decode_matmul.grouped_matmul_reference`: each row against its
expert's dequantised weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.decode_matmul import grouped_matmul_reference, max_row_tiles, row_tile_index, row_tiles
from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, feed_ring, layer_index
from ddtree_kernels.quant import INT4_GROUP, Int4Weight
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret

BLOCK_N = 128  # output columns (weight rows) per CTA: two compute warpgroups of 64, wgmma's M
WG_ROWS = 64
BLOCK_MS = (64, 128)  # token rows per tile: wgmma's N
DEFAULT_BLOCK_M = 64  # 2.998 against 3.783 ms for 128 at a 2,048-token K2.6 chunk (gate, efb2e2f)
ROW_ALIGN = 8  # a tile's first row: the x slot is tiled by 8 rows, and a TMA box starts on a whole tile
DEFAULT_BLOCK_K = 256  # the widest K step; narrower where K needs it (`grouped_int4_matmul`)
# shared memory a CTA may plan: the ring and the output tiles (barriers and Mosaic's own scratch below the rest)
SMEM_BUDGET = SMEM_LIMIT_BYTES - 8 * 1024
_X_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))  # bf16: 32 elements = 64 bytes
_W_TRANSFORMS = (plgpu.TilingTransform((8, 32)),)  # int4: 32 elements = 16 bytes, one 128-byte tile of 8 rows


def stage_bytes(block_m: int, block_k: int, scale_bytes: int = 2) -> int:
    """One ring slot: the INT4 tile [128, block_k], the x tile [block_m, block_k] bf16, the scales [block_k / 32,
    128] (bf16, or float32: scale_bytes 4)."""
    return BLOCK_N * block_k // 2 + block_m * block_k * 2 + (block_k // INT4_GROUP) * BLOCK_N * scale_bytes


def _fixed_bytes(block_m: int, interpret: bool) -> int:
    """Outside the ring: the two output tiles [block_m, 64] bf16 (interpret mode: also the staged A tiles [2, 64,
    32] bf16)."""
    return 2 * block_m * WG_ROWS * 2 + (2 * WG_ROWS * INT4_GROUP * 2 if interpret else 0)


def smem_bytes(block_m: int, block_k: int, stages: int, interpret: bool = False, scale_bytes: int = 2) -> int:
    """A CTA's shared memory: the ring and `_fixed_bytes`."""
    return stages * stage_bytes(block_m, block_k, scale_bytes) + _fixed_bytes(block_m, interpret)


def fit_stages(block_m: int, block_k: int, k: int, interpret: bool = False, scale_bytes: int = 2) -> int:
    """The most ring slots (<= 4, <= the K steps) that fit SMEM_BUDGET."""
    room = (SMEM_BUDGET - _fixed_bytes(block_m, interpret)) // stage_bytes(block_m, block_k, scale_bytes)
    return max(1, min(4, k // block_k, room))


def _dequantize(codes, scale):
    """codes int4 [64, 32] as loaded (the stored nibble c read as a signed v: c or c - 16), scale [64] ->
    (c - 8) * scale in bf16 [64, 32]."""
    q = codes.astype(jnp.int8) ^ jnp.int8(-8)  # v ^ 0b1111_1000 == c - 8 for both signs of v
    if scale.dtype == jnp.bfloat16:
        return q.astype(jnp.bfloat16) * lax.broadcast_in_dim(scale, q.shape, [0])
    return (q.astype(jnp.float32) * lax.broadcast_in_dim(scale.astype(jnp.float32), q.shape, [0])).astype(jnp.bfloat16)


def _kernel(
    tiles_ref,
    x_ref,
    w_ref,
    s_ref,
    o_ref,
    w_smem,
    x_smem,
    s_smem,
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
    #   x_ref bf16 [A_pad, K] (A in whole 8-row tiles, zeros past A); w_ref int4 [L, E, N, K] the stored codes; s_ref [E, K / 32, N] the layer's
    #   scales transposed; o_ref bf16 [T, block_m, N] each tile's rows.
    # SMEM: w_smem int4 [stages, 128, block_k]; x_smem bf16 [stages, block_m, block_k]; s_smem [stages,
    #   block_k / 32, 128]; o_smem bf16 [2, block_m, 64] each compute warpgroup's y tile; loaded[stages] (3 TMA
    #   arrivals); consumed[stages] (2: each compute warpgroup's wgmmas on the slot done); interpret mode only:
    #   a_smem bf16 [2, 64, 32] each warpgroup's dequantised group.
    column_block, tile, wg = lax.axis_index("n"), lax.axis_index("tile"), lax.axis_index("wg")
    expert, count, layer = tiles_ref[0, tile], tiles_ref[2, tile], tiles_ref[3, tile]
    first = pl.multiple_of(tiles_ref[1, tile], ROW_ALIGN)
    n0 = column_block * BLOCK_N
    groups = block_k // INT4_GROUP

    @pl.when((count > 0) & (wg == 2))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(i, slot):
            cols = pl.ds(i * block_k, block_k)
            barrier = loaded.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[layer, expert, pl.ds(n0, BLOCK_N), cols], w_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(first, block_m), cols], x_smem.at[slot], barrier)
            plgpu.copy_gmem_to_smem(
                s_ref.at[expert, pl.ds(i * groups, groups), pl.ds(n0, BLOCK_N)], s_smem.at[slot], barrier
            )

        feed_ring(load, k_steps, stages, consumed)

    @pl.when((count > 0) & (wg < 2))
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)

        def product(acc_ref):  # acc_ref f32 [64, block_m]: y^T of this warpgroup's 64 columns
            @pl.loop(0, k_steps)
            def _step(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(loaded.at[slot])
                for j in range(groups):
                    span = pl.ds(j * INT4_GROUP, INT4_GROUP)
                    x_group = x_smem.at[slot, :, span].transpose((1, 0))  # [32, block_m]
                    if interpret:
                        codes = w_smem.at[slot, rows, span][...]
                        scale = s_smem.at[slot, j, rows][...]
                        a_smem[0].at[wg][...] = _dequantize(codes, scale)
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, a_smem[0].at[wg], x_group)
                    else:
                        codes = plgpu.load(w_smem.at[slot, rows, span], layout=plgpu.Layout.WGMMA_UPCAST_4X)
                        codes = plgpu.layout_cast(codes, plgpu.Layout.WGMMA)
                        scale = plgpu.load(s_smem.at[slot, j, rows], layout=plgpu.Layout.WGMMA.reduce(1))
                        plgpu.wgmma(acc_ref, _dequantize(codes, scale), x_group)
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
        plgpu.copy_smem_to_gmem(out, o_ref.at[tile, :, pl.ds(n0 + wg * WG_ROWS, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "stages", "deferred_release", "interpret"))
def _grouped_int4(x, packed, scale, group_sizes, layer, *, block_m, block_k, stages, deferred_release, interpret):
    rows, k = x.shape
    num_layers, experts, n, _ = packed.shape
    layer = layer_index(layer, num_layers)
    group_sizes = group_sizes.astype(jnp.int32)
    # the stored words as int4 codes [L, E, N, K] (element k of a word in bits 4k..4k+3, XLA's int4 order)
    codes = lax.bitcast_convert_type(packed, jnp.int4).reshape(num_layers, experts, n, k)
    scale_t = jnp.swapaxes(lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False), 1, 2)  # [E, K / 32, N]
    if scale_t.dtype not in (jnp.bfloat16, jnp.float32):
        scale_t = scale_t.astype(jnp.float32)
    num_tiles = max_row_tiles(rows, experts, block_m)
    table = row_tiles(group_sizes, block_m, num_tiles, align=ROW_ALIGN)
    table = jnp.concatenate([table, jnp.broadcast_to(layer, (1, num_tiles))])
    # the rows in whole 8-row TMA tiles (no copy when A is a multiple of 8); compiled, the last tile's TMA past
    # them reads zeros, while the interpreter's slice would clamp and shift: there, room for the whole tile
    padded = pl.cdiv(rows, ROW_ALIGN) * ROW_ALIGN + (block_m if interpret else 0)
    x_in = jnp.pad(x, ((0, padded - rows), (0, 0)))
    kernel = functools.partial(
        _kernel,
        block_m=block_m,
        block_k=block_k,
        k_steps=k // block_k,
        stages=stages,
        deferred_release=deferred_release,
        interpret=interpret,
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, block_m, n), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((stages, BLOCK_N, block_k), jnp.int4, transforms=_W_TRANSFORMS),
            plgpu.SMEM((stages, block_m, block_k), jnp.bfloat16, transforms=_X_TRANSFORMS),
            plgpu.SMEM((stages, block_k // INT4_GROUP, BLOCK_N), scale_t.dtype),
            plgpu.SMEM((2, block_m, WG_ROWS), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        )
        + ((plgpu.SMEM((2, WG_ROWS, INT4_GROUP), jnp.bfloat16),) if interpret else ()),
        grid=(num_tiles, n // BLOCK_N),  # the last grid axis is CUDA's x, launched fastest
        grid_names=("tile", "n"),
        num_threads=3,
        thread_name="wg",
        interpret=INTERPRET_PARAMS if interpret else None,
    )(table, x_in, codes, scale_t)
    return out.reshape(num_tiles * block_m, n)[row_tile_index(group_sizes, rows, block_m, align=ROW_ALIGN)]


def grouped_int4_matmul(
    x: jax.Array,
    weight: Int4Weight,
    group_sizes: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_k: int | None = None,
    stages: int | None = None,
    deferred_release: bool = False,
    interpret: bool | None = None,
) -> jax.Array:
    """Rows of x [A, K] bf16 sorted by expert (group_sizes int32 [E], summing to A) against INT4 expert weights
    [E, N, K] (or every layer's [L, E, N, K] with `layer`, an int or int32 scalar: read in place) -> bf16
    [A, N], row a = x[a] @ W[e(a)]^T; on the Mosaic GPU backend (Hopper), the weights dequantised in the
    registers (module docstring). block_m: token rows per tile (64 or 128; a prefill chunk's 2,048 tokens x
    top-8 over 384 experts is ~43 rows an expert); block_k: K elements per pipeline step (None: the largest of
    256 / 128 / 64 dividing K); stages: ring slots (None: as many as fit); deferred_release: a compute
    warpgroup leaves each step's wgmmas in flight into the next step and releases the step's slot one step
    later (`wgmma_wait(groups)`; needs 2 slots and 2 K steps), instead of waiting for them before the next
    step's dequantisation; interpret: Mosaic GPU interpret mode (None: on the CPU backend)."""
    if not isinstance(weight, Int4Weight):
        raise ValueError(f"grouped_int4_matmul takes an Int4Weight, got {type(weight).__name__}")
    if layer is None:
        if weight.packed.ndim != 3:
            raise ValueError(
                f"grouped_int4_matmul takes expert weights [E, N, K], got shape {weight.shape} "
                "(all layers' [L, E, N, K]: pass layer=)"
            )
        weight = jax.tree.map(lambda a: a[None], weight)
        layer = 0
    elif weight.packed.ndim != 4:
        raise ValueError(f"with layer= grouped_int4_matmul takes [L, E, N, K] weights, got shape {weight.shape}")
    _, experts, n, k = weight.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [A, K] with K = {k}, got {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if group_sizes.shape != (experts,):
        raise ValueError(f"group_sizes must have one entry per expert ({experts},), got {group_sizes.shape}")
    if n % BLOCK_N:
        raise ValueError(f"N = {n} must be a multiple of {BLOCK_N} (the weights are never padded)")
    if block_k is None:
        block_k = next((b for b in (DEFAULT_BLOCK_K, 128, 64) if k % b == 0), DEFAULT_BLOCK_K)
    if block_m not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {block_m}")
    if block_k % 64 or k % block_k:
        raise ValueError(f"block_k = {block_k} must be a multiple of 64 dividing K = {k}")
    interpret = default_interpret(interpret)
    # the scales as the kernel takes them: bf16 or float32 (other dtypes are widened to float32)
    scale_bytes = 2 if weight.scale.dtype == jnp.bfloat16 else 4
    if stages is None:
        stages = fit_stages(block_m, block_k, k, interpret, scale_bytes)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if deferred_release and (stages < 2 or k // block_k < 2):
        deferred_release = False  # one slot, or one K step: nothing to overlap
    nbytes = smem_bytes(block_m, block_k, stages, interpret, scale_bytes)
    if nbytes > SMEM_BUDGET:
        raise ValueError(
            f"stages = {stages} at block_m = {block_m}, block_k = {block_k} take {nbytes} bytes of shared memory, "
            f"over {SMEM_BUDGET}"
        )
    return _grouped_int4(
        x,
        weight.packed,
        weight.scale,
        group_sizes,
        jnp.asarray(layer, jnp.int32),
        block_m=block_m,
        block_k=block_k,
        stages=stages,
        deferred_release=deferred_release,
        interpret=interpret,
    )


def grouped_int4_matmul_reference(x: jax.Array, weight: Int4Weight, group_sizes: jax.Array, *, layer=None):
    """The twin: each row against its expert's dequantised weights, in x's dtype."""
    return grouped_matmul_reference(x, weight, group_sizes, layer=layer)
