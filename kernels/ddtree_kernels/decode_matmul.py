"""Weight-streaming matmul for decode and verify: skinny activations against large weights.

  y = x @ W^T,  x [M, K] (bf16 / f32, M = batch x tokens, 1 .. a few hundred),  W [N, K] ("out, in",
  the HF layout the loader keeps) as a plain array, an INT4 pack-quantized weight or a block-FP8
  weight (`ddtree_kernels.quant`), dequantised in registers.

Why a kernel: at M <= ~256 every weight byte is used M times, so the matmul is a stream of W through
HBM; plain XLA reaches a fraction of the bandwidth at these shapes (BENCHMARKS.md, "Matmul").

Grid (N tiles, K splits, M tiles). Each program streams one [BN, K / splits] stripe of W in [BN, BK]
tiles and multiplies it against the matching [BM, BK] activation tile (tensor-core dot, float32
accumulation); the K splits (split-K, chosen so that the grid fills the GPU) are summed by XLA. The
activation is padded to [M_pad, K_pad] (cheap); W is never copied or padded: its edges are masked loads.

INT4 (compressed-tensors pack-quantized, group 32): word w of row n holds elements 8w .. 8w + 7 in its
nibbles (code + 8). The kernel unpacks a [BN, BK / 8] tile of words into 8 "planes" (plane j = nibble
j = elements 8w + j) and contracts plane j with the activation's elements 8w + j, which the wrapper
lays out plane-major ([8, M_pad, K_pad / 8]) beforehand; the group scale of element 8w + j is scale
[n, w // 4], the same for every plane. No [N, K] bf16 copy ever exists.

Block FP8 (DeepSeek-V3 style): float8_e4m3fn [N, K] with float32 scales per 128 x 128 block; tiles
are 128-aligned in K and divide 128 in N, so each tile has one scale.

`matmul_reference` is the twin: dequantise to x's dtype and contract (the XLA path of the models'
`linear`). Precision: float32 activations are computed at float32 in both (`tiling`); tile sizes shrink
for 4-byte operands so that a program fits the shared memory (`fit_tiling`).

The grouped (MoE) variant, `grouped_matmul`: rows sorted by expert against stacked experts [E, N, K] (or
every layer's, [L, E, N, K], with `layer=`: read in place, no per-layer copy). Grid (N tiles, K splits,
row tiles); a table of (expert, first row, rows, layer) per row tile, built without loops
(`row_tiles`); tiling in `GroupedTiles` (defaults from `bench_matmul.py --grouped-sweep`). Twin:
`grouped_matmul_reference`.
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

from ddtree_kernels.mosaic_common import layer_index
from ddtree_kernels.quant import FP8_BLOCK, INT4_GROUP, Fp8BlockWeight, Int4Weight, dense
from ddtree_kernels.tiling import TARGET_PROGRAMS, default_interpret, dot_precision, fits, pipelined_bytes

BLOCK_N = 64  # output columns per program
BLOCK_K = 256  # contraction elements per tile (a multiple of 8 * 32 for INT4, of 128 for FP8)
NUM_STAGES = 3  # Triton pipeline stages of the plain kernel


def _weight_kind(weight) -> str:
    return "int4" if isinstance(weight, Int4Weight) else "fp8" if isinstance(weight, Fp8BlockWeight) else "dense"


def _min_block_k(kind: str) -> int:
    return {"int4": 8 * INT4_GROUP, "fp8": FP8_BLOCK, "dense": 16}[kind]


def stage_tiles(kind: str, x_dtype, weight_dtype, scale_dtype, block_m: int, block_n: int, block_k: int):
    """The tiles one K step of a program loads ((shape, dtype) pairs: what `tiling.pipelined_bytes`
    counts): the activation tile (INT4: its 8 planes) and the weight tile in its stored format (INT4: the
    packed words and the group scales; FP8: float8 values)."""
    if kind == "int4":
        return [
            ((8, block_m, block_k // 8), x_dtype),
            ((block_n, block_k // 8), jnp.int32),
            ((block_n, block_k // INT4_GROUP), scale_dtype),
        ]
    return [((block_m, block_k), x_dtype), ((block_n, block_k), weight_dtype)]


def resident_tiles(kind: str, x_dtype, block_n: int, block_k: int, one_dot: bool) -> list:
    """The tiles a program holds once beside its pipeline: with `one_dot` (INT4), the dequantised weight tile
    [block_n, block_k] in the activations' dtype, which Triton stages through shared memory for the one dot.
    On one H200 (b1a8ad7, bf16, 64-row tiles) one-dot tilings of 128 x 512 at 2 stages and 256 x 256 at 3 each
    asked for 294,912 bytes, 88 and 84 KiB above their stages alone (200 and 204 KiB): without this tile the
    estimate passed both and the kernels failed with RESOURCE_EXHAUSTED. The tile counted here is 128 KiB for
    both, so the estimate is an upper bound (40 / 44 KiB above those requests)."""
    return [((block_n, block_k), x_dtype)] if one_dot and kind == "int4" else []


def fit_tiling(
    kind: str,
    x_dtype,
    weight_dtype,
    scale_dtype,
    block_m: int,
    block_n: int,
    block_k: int,
    num_stages: int,
    one_dot: bool = False,
) -> tuple[int, int]:
    """(block_k, num_stages) that fit the shared memory, from the requested ones: fewer stages first (down
    to 2), then halved K steps (down to the format's minimum), then a single stage. 4-byte operands (float32
    activations or weights) and one-dot INT4 tilings need this; the bf16 / INT4 / FP8 defaults fit as they are."""

    def nbytes(bk, stages):
        return pipelined_bytes(
            stage_tiles(kind, x_dtype, weight_dtype, scale_dtype, block_m, block_n, bk),
            stages,
            resident_tiles(kind, x_dtype, block_n, bk, one_dot),
        )

    stages = num_stages
    while stages > 2 and not fits(nbytes(block_k, stages)):
        stages -= 1
    while block_k > _min_block_k(kind) and block_k % 2 == 0 and not fits(nbytes(block_k, stages)):
        if kind == "fp8":  # FP8 steps are one 128-wide scale block
            break
        block_k //= 2
    if not fits(nbytes(block_k, stages)):
        stages = 1
    return block_k, stages


def _block_m(rows: int) -> int:
    """Rows per program: the tensor-core minimum 16, up to 64; larger M is tiled."""
    return min(64, max(16, 1 << max(0, (rows - 1).bit_length())))


def _plan(rows: int, n: int, k: int, block_k: int) -> tuple[int, int, int, int]:
    """(block_m, m_tiles, splits, k_per_split)."""
    block_m = _block_m(rows)
    m_tiles = pl.cdiv(rows, block_m)
    n_tiles = pl.cdiv(n, BLOCK_N)
    k_tiles = pl.cdiv(k, block_k)
    splits = max(1, min(pl.cdiv(TARGET_PROGRAMS, n_tiles * m_tiles), k_tiles // 2 or 1))
    return (block_m, m_tiles) + _split_k(k_tiles, splits, block_k)


def _split_k(k_tiles: int, splits: int, block_k: int) -> tuple[int, int]:
    """(splits, k_per_split): K tiles dealt to `splits` splits, as many whole tiles each; the split count
    shrinks where rounding leaves a split empty."""
    k_per_split = pl.cdiv(k_tiles, splits) * block_k
    return pl.cdiv(k_tiles * block_k, k_per_split), k_per_split


def _dot_t(x, w, precision):
    """x [BM, BK] . w [BN, BK]^T -> f32 [BM, BN] (tensor cores; `dot_precision`: IEEE for float32)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dense_kernel(x_ref, w_ref, o_ref, *, n: int, k: int, block_m: int, block_k: int, k_per_split: int, precision):
    # x_ref: [M_pad, K_pad] activation (zero padded); w_ref: [N, K] weight; o_ref: [BM, BN] f32 partial
    n_tile, split, m_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = n_tile * BLOCK_N + jnp.arange(BLOCK_N)

    def body(i, acc):
        k0 = split * k_per_split + i * block_k
        cols = k0 + jnp.arange(block_k)
        x = x_ref[pl.ds(m_tile * block_m, block_m), pl.ds(k0, block_k)]
        w = plgpu.load(
            w_ref.at[pl.ds(n_tile * BLOCK_N, BLOCK_N), pl.ds(k0, block_k)],
            mask=(rows < n)[:, None] & (cols < k)[None, :],
            other=0.0,
        )
        return acc + _dot_t(x, w.astype(x.dtype), precision)

    o_ref[...] = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, BLOCK_N), jnp.float32))


def _int4_kernel(
    x_ref, packed_ref, scale_ref, o_ref, *, n: int, k: int, block_m: int, block_k: int, k_per_split: int, precision
):
    # x_ref: [8, M_pad, K_pad / 8] plane-major activation; packed_ref: i32 [N, K / 8]; scale_ref: [N, K / 32]
    n_tile, split, m_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = n_tile * BLOCK_N + jnp.arange(BLOCK_N)
    words, groups = block_k // 8, block_k // INT4_GROUP

    def body(i, acc):
        k0 = split * k_per_split + i * block_k
        row_ok = (rows < n)[:, None]
        word = k0 // 8 + jnp.arange(words)
        packed = plgpu.load(
            packed_ref.at[pl.ds(n_tile * BLOCK_N, BLOCK_N), pl.ds(k0 // 8, words)],
            mask=row_ok & (word < k // 8)[None, :],
            other=0,
        )
        group = k0 // INT4_GROUP + jnp.arange(groups)
        scale = plgpu.load(
            scale_ref.at[pl.ds(n_tile * BLOCK_N, BLOCK_N), pl.ds(k0 // INT4_GROUP, groups)],
            mask=row_ok & (group < k // INT4_GROUP)[None, :],
            other=0.0,
        ).astype(jnp.float32)
        scale = jnp.broadcast_to(scale[:, :, None], (BLOCK_N, groups, INT4_GROUP // 8)).reshape(BLOCK_N, words)
        for plane in range(8):
            codes = (packed >> (4 * plane)) & 0xF
            w = ((codes - 8).astype(jnp.float32) * scale).astype(x_ref.dtype)
            x = x_ref[plane, pl.ds(m_tile * block_m, block_m), pl.ds(k0 // 8, words)]
            acc = acc + _dot_t(x, w, precision)
        return acc

    o_ref[...] = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, BLOCK_N), jnp.float32))


def _fp8_kernel(
    x_ref, w_ref, scale_ref, o_ref, *, n: int, k: int, block_m: int, block_k: int, k_per_split: int, precision
):
    # x_ref: [M_pad, K_pad]; w_ref: float8_e4m3fn [N, K]; scale_ref: f32 [ceil(N / 128), ceil(K / 128)]
    n_tile, split, m_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = n_tile * BLOCK_N + jnp.arange(BLOCK_N)
    scale_rows, scale_cols = scale_ref.shape

    def body(i, acc):
        k0 = split * k_per_split + i * block_k
        cols = k0 + jnp.arange(block_k)
        w = plgpu.load(
            w_ref.at[pl.ds(n_tile * BLOCK_N, BLOCK_N), pl.ds(k0, block_k)],
            mask=(rows < n)[:, None] & (cols < k)[None, :],
            other=0.0,
        ).astype(jnp.float32)
        block_row = jnp.minimum((n_tile * BLOCK_N) // FP8_BLOCK, scale_rows - 1)
        block_col = jnp.minimum(k0 // FP8_BLOCK, scale_cols - 1)
        w = (w * scale_ref[block_row, block_col]).astype(x_ref.dtype)
        x = x_ref[pl.ds(m_tile * block_m, block_m), pl.ds(k0, block_k)]
        return acc + _dot_t(x, w, precision)

    o_ref[...] = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, BLOCK_N), jnp.float32))


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _matmul_2d(x, weight, *, interpret: bool):
    rows, k = x.shape
    n = weight.shape[-2]
    precision = dot_precision(x.dtype)
    kind = _weight_kind(weight)
    block_k = FP8_BLOCK if kind == "fp8" else BLOCK_K  # FP8: one scale per tile
    block_k, num_stages = fit_tiling(
        kind, x.dtype, _stored_dtype(weight), _scale_dtype(weight), _block_m(rows), BLOCK_N, block_k, NUM_STAGES
    )
    block_m, m_tiles, splits, k_per_split = _plan(rows, n, k, block_k)
    m_pad, k_pad = m_tiles * block_m, splits * k_per_split
    x_pad = jnp.pad(x, ((0, m_pad - rows), (0, k_pad - k)))
    n_tiles = pl.cdiv(n, BLOCK_N)
    params = dict(n=n, k=k, block_m=block_m, block_k=block_k, k_per_split=k_per_split, precision=precision)
    if isinstance(weight, Int4Weight):
        planes = x_pad.reshape(m_pad, k_pad // 8, 8).transpose(2, 0, 1)  # [8, M_pad, K_pad / 8]
        kernel, inputs = functools.partial(_int4_kernel, **params), (planes, weight.packed, weight.scale)
    elif isinstance(weight, Fp8BlockWeight):
        kernel, inputs = functools.partial(_fp8_kernel, **params), (x_pad, weight.weight, weight.scale_inv)
    else:
        kernel, inputs = functools.partial(_dense_kernel, **params), (x_pad, weight)
    partial = pl.pallas_call(
        kernel,
        grid=(n_tiles, splits, m_tiles),
        in_specs=[_whole(a.shape) for a in inputs],
        out_specs=pl.BlockSpec((None, block_m, BLOCK_N), lambda j, s, i: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, n_tiles * BLOCK_N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=num_stages),
        interpret=interpret,
        name="decode_matmul_" + type(weight).__name__.lower()
        if not isinstance(weight, jax.Array)
        else "decode_matmul_dense",
    )(*inputs)
    return partial.sum(axis=0)[:rows, :n].astype(x.dtype)


def _stored_dtype(weight):
    return (
        jnp.int32
        if isinstance(weight, Int4Weight)
        else (weight.weight if isinstance(weight, Fp8BlockWeight) else weight).dtype
    )


def _scale_dtype(weight):
    return weight.scale.dtype if isinstance(weight, Int4Weight) else jnp.float32


def matmul(x: jax.Array, weight, *, interpret: bool | None = None) -> jax.Array:
    """x [..., K] (bf16 / f32) @ weight^T -> [..., N] in x's dtype; weight [N, K] array, Int4Weight
    ([N, K / 8] words, [N, K / 32] scales) or Fp8BlockWeight. Same contract as `matmul_reference`;
    float32 x is computed at float32 (the package's precision contract, `tiling`)."""
    shape = weight.shape
    if len(shape) != 2:
        raise ValueError(f"matmul takes one [N, K] weight, got shape {shape} (stacked weights: index the layer first)")
    if x.shape[-1] != shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {shape[1]}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    if isinstance(weight, Int4Weight) and shape[1] % INT4_GROUP:
        raise ValueError(f"INT4 weights need K % {INT4_GROUP} == 0, got K = {shape[1]}")
    lead = x.shape[:-1]
    out = _matmul_2d(x.reshape(-1, shape[1]), weight, interpret=default_interpret(interpret))
    return out.reshape(lead + (shape[0],))


def matmul_reference(x: jax.Array, weight) -> jax.Array:
    """The twin: dequantise to x's dtype and contract ([..., K] -> [..., N], x's dtype) at
    `dot_precision(x.dtype)`: the models' "xla" linear."""
    return jnp.einsum("...i,oi->...o", x, dense(weight, x.dtype), precision=dot_precision(x.dtype))


# --- the grouped (MoE) variant: rows sorted by expert, each expert's weights streamed once per row tile ---------


# The grouped kernel's defaults, from `benchmarks/bench_matmul.py --grouped-sweep` (one H200, K2.6 INT4 gate
# [2048, 7168] and down [7168, 2048] at T = 1 and 9 tokens x top-8, 2026-12-01): 128 columns, 256-wide K
# steps and 4 K splits took 97 / 80 / 476 / 459 us (gate T 1, down T 1, gate T 9, down T 9) where 64
# columns with the fill-the-GPU split rule took 116 / 87 / 560 / 459; the best single tiling per case
# took at most 12% less time than this one.
GROUPED_BLOCK_N = 128
DECODE_SPLITS = 4  # K splits while the step has at most DECODE_ROWS rows (decode and tree verify)
DECODE_ROWS = 512

# How the grouped kernel turns an INT4 nibble c into its bf16-activation dot's weight (c - 8) * scale:
# "convert": integer subtract, int -> float32 convert, scale, float32 -> bf16 convert;
# "magic_bf16": c OR 0x4300 read as a bf16 is 128 + c exactly (no int -> float conversion), then (v - 136) * scale
#   in bf16: with bf16 scales the same rounding as "convert" (the exact product rounded once to bf16), so the same
#   bits; the kernel takes it only for bf16 activations and bf16 scales (the checkpoints' dtype), else "convert".
# Measured (`bench_matmul --grouped-tiles dequant`, one H200, one TP8 shard's experts at 9 / 17 / 65 tokens, four
# runs): "magic_bf16" was faster than "convert" in 16 of 24 same-run pairs at the default tilings (57 of 72 over
# every tiling, median 0.93x the time), a gain smaller than the up-to-18% spread of one tiling between runs; a third
# form, float32 weights (no weight conversion) and a TF32 dot, took 1.5-2.5x longer at the defaults (twice the
# weight tile's shared-memory bytes) and was removed.
DEQUANT_MODES = ("convert", "magic_bf16")
BF16_MAGIC = 0x4300  # bf16 bits of 128.0: OR a nibble c into them -> the bf16 128 + c


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """The grouped kernel's tiling. block_n: output columns per program; block_k: contraction elements per
    step (INT4: a multiple of 256; FP8: 128, one scale per tile); splits: K splits (split-K), None =
    DECODE_SPLITS up to DECODE_ROWS rows, else 1 (the f32 partial sums are splits x rows x N: small only
    at decode sizes); num_warps / num_stages: Triton's. one_dot (INT4 only): each K step is one dot of
    K = block_k (the tile's 8 nibble planes dequantised side by side into one [block_n, block_k] tile, the
    activations laid out to match: within each block_k tile plane-major) instead of 8 dots of K = block_k / 8,
    one per plane (the default: no relayout of the activations). dequant (INT4, bf16 activations, per-plane
    dots): how a nibble c becomes the weight (c - 8) * scale, see DEQUANT_MODES; float32 activations always take
    "convert"."""

    block_n: int = GROUPED_BLOCK_N
    block_k: int = BLOCK_K
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    one_dot: bool = False
    dequant: str = "convert"

    def check(self, kind: str) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        need = {"int4": 8 * INT4_GROUP, "fp8": FP8_BLOCK, "dense": 16}[kind]
        if self.block_k % need or (kind == "fp8" and self.block_k != FP8_BLOCK):
            raise ValueError(
                f"block_k {self.block_k} does not suit {kind} weights (a multiple of {need}"
                + (f", exactly {FP8_BLOCK}" if kind == "fp8" else "")
                + ")"
            )
        if kind == "fp8" and FP8_BLOCK % self.block_n:
            raise ValueError(f"block_n {self.block_n} must divide {FP8_BLOCK} for FP8 weights")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits must be >= 1 or None, got {self.splits}")
        if self.one_dot and kind != "int4":
            raise ValueError(f"one_dot applies to INT4 weights only, got {kind} weights")
        if self.dequant not in DEQUANT_MODES:
            raise ValueError(f"dequant must be one of {DEQUANT_MODES}, got {self.dequant!r}")
        if self.dequant != "convert" and (kind != "int4" or self.one_dot):
            raise ValueError(
                f"dequant {self.dequant!r} applies to INT4 weights with per-plane dots (one_dot=False), got "
                f"{kind} weights, one_dot={self.one_dot}"
            )


def _grouped_kernel(
    tile_ref,
    *refs,
    kind: str,
    n: int,
    k: int,
    block_m: int,
    block_n: int,
    block_k: int,
    k_per_split: int,
    precision,
    one_dot: bool = False,
    dequant: str = "convert",
    gathered: bool = False,
):
    # tile_ref: i32 [4, T]: (expert, first row, rows, layer) of each row tile (rows 0 = unused tile)
    # row_ref (gathered only): i32 [A_pad]: the row of x each sorted row reads (padding: 0)
    # x_ref: [R, K_pad], R = A_pad rows grouped by expert, or (gathered) any R rows read through row_ref
    #   ([8, R, K_pad / 8] plane-major for INT4; with one_dot [R, K_pad], each block_k tile's columns plane-major:
    #   column j * block_k / 8 + w holds k = 8 w + j)
    # weights, L stacked layers: [L, E, N, K] array | (packed i32 [L, E, N, K / 8], scale [L, E, N, K / 32])
    #   | (f8 [L, E, N, K], f32 scales [L, E, N / 128, K / 128]); the tile's layer is read in place
    # o_ref: f32 [S, A_pad, N_pad] partial sums per K split, written at the tile's (sorted) rows
    row_ref, x_ref, *weight_refs, o_ref = refs if gathered else (None, *refs)
    n_tile, split, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert, first, count = tile_ref[0, tile], tile_ref[1, tile], tile_ref[2, tile]
    # the layer as `a[layer]` reads it (negative from the end), clamped: a traced one cannot be checked
    layer = layer_index(tile_ref[3, tile], weight_refs[0].shape[0])
    rows = n_tile * block_n + jnp.arange(block_n)
    row_ok = (rows < n)[:, None]
    words, groups = block_k // 8, block_k // INT4_GROUP

    def int4_tiles(packed_ref, scale_ref, k0):
        """The step's codes i32 [BN, W] and scales [BN, W] (each group's scale repeated over its 4 words)."""
        packed = plgpu.load(
            packed_ref.at[layer, expert, pl.ds(n_tile * block_n, block_n), pl.ds(k0 // 8, words)],
            mask=row_ok & ((k0 // 8 + jnp.arange(words)) < k // 8)[None, :],
            other=0,
        )
        scale = plgpu.load(
            scale_ref.at[layer, expert, pl.ds(n_tile * block_n, block_n), pl.ds(k0 // INT4_GROUP, groups)],
            mask=row_ok & ((k0 // INT4_GROUP + jnp.arange(groups)) < k // INT4_GROUP)[None, :],
            other=0.0,
        ).astype(x_ref.dtype if dequant == "magic_bf16" else jnp.float32)
        scale = jnp.broadcast_to(scale[:, :, None], (block_n, groups, INT4_GROUP // 8)).reshape(block_n, words)
        return packed, scale

    def int4_plane_dots(packed, scale, x_planes, acc):
        """acc [BM, BN] + the 8 plane dots of the step: x plane j [BM, W] . (c_j - 8) * scale [BN, W]^T."""
        for plane in range(8):
            nibble = (packed >> (4 * plane)) & 0xF
            xs = x_planes[plane]
            if dequant == "magic_bf16":  # bf16 activations (GroupedTiles.check, _grouped_2d)
                v = lax.bitcast_convert_type((nibble | BF16_MAGIC).astype(jnp.int16), jnp.bfloat16)
                w = (v - 136.0) * scale  # 128 + c - 136 = c - 8 exactly, then one rounding
            else:
                w = ((nibble - 8).astype(jnp.float32) * scale).astype(x_ref.dtype)
            acc = acc + _dot_t(xs, w, precision)
        return acc

    own_rows = (jnp.arange(block_m) < count)[:, None]  # [BM, 1]: the tile's own rows (read and stored)
    if gathered:  # [BM, 1]: the x row of each of the tile's rows (0 past its own: in bounds, not read)
        source_rows = jnp.where(own_rows[:, 0], row_ref[pl.ds(first, block_m)], 0)[:, None]

    def x_tile(col0, width: int, plane=None):
        """The tile's rows [BM, width] of x's columns col0 .. col0 + width (of one plane of the INT4 layout); rows
        past the tile's own (another expert's, or padding) are not read (zeros: their outputs are not stored), so
        a tile of one row moves one row of activations. gathered: each row read at its row_ref entry (one indexed
        load: the rows need not be copied into expert order first)."""
        lead = () if plane is None else (jnp.int32(plane),)
        if gathered:  # all-array indices: one [BM, width] gather (interpret mode takes no slices beside arrays)
            index = lead + (source_rows, (col0 + jnp.arange(width))[None, :])
        else:
            index = lead + (pl.ds(first, block_m), pl.ds(col0, width))
        return plgpu.load(x_ref.at[index], mask=jnp.broadcast_to(own_rows, (block_m, width)), other=0.0)

    @pl.when(count > 0)
    def _():
        def body(i, acc):
            k0 = split * k_per_split + i * block_k
            if kind == "int4" and not one_dot:
                x_planes = [x_tile(k0 // 8, words, plane) for plane in range(8)]
                return int4_plane_dots(*int4_tiles(*weight_refs, k0), x_planes, acc)
            if kind == "int4":  # one_dot: the 8 planes side by side: [BN, 8, W] -> one [BN, BK] tile, one dot
                packed, scale = int4_tiles(*weight_refs, k0)
                shifts = 4 * lax.broadcasted_iota(jnp.int32, (1, 8, 1), 1)
                codes = (packed[:, None, :] >> shifts) & 0xF
                w = ((codes - 8).astype(jnp.float32) * scale[:, None, :]).astype(x_ref.dtype)
                return acc + _dot_t(x_tile(k0, block_k), w.reshape(block_n, block_k), precision)
            w_ref = weight_refs[0]
            cols = k0 + jnp.arange(block_k)
            w = plgpu.load(
                w_ref.at[layer, expert, pl.ds(n_tile * block_n, block_n), pl.ds(k0, block_k)],
                mask=row_ok & (cols < k)[None, :],
                other=0.0,
            ).astype(jnp.float32)
            if kind == "fp8":
                scale_ref = weight_refs[1]
                w = (
                    w
                    * scale_ref[
                        layer,
                        expert,
                        jnp.minimum((n_tile * block_n) // FP8_BLOCK, scale_ref.shape[2] - 1),
                        jnp.minimum(k0 // FP8_BLOCK, scale_ref.shape[3] - 1),
                    ]
                )
            return acc + _dot_t(x_tile(k0, block_k), w.astype(x_ref.dtype), precision)

        acc = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(o_ref.at[split, pl.ds(first, block_m), pl.ds(n_tile * block_n, block_n)], acc, mask=own_rows)


def _exclusive_prefix_sum(values: jax.Array) -> jax.Array:
    """int32 [E] -> [E]: the sum of the entries before each, as one [E, E] masked row sum (a parallel reduce). XLA
    compiles `jnp.cumsum` to a reduce-window; the 4-layer K2.6 shard's tree step spent ~10 us a layer in a
    reduce-window fusion (BENCHMARKS.md, the shard's profile), which this replaces at the tile table."""
    index = jnp.arange(values.shape[0])
    return jnp.where(index[None, :] < index[:, None], values[None, :], 0).sum(axis=1, dtype=values.dtype)


def _tile_counts(group_sizes: jax.Array, block_m: int, align: int):
    """Per group: its first row, its first tile's first row (the first row rounded down to a multiple of
    `align`) and its tiles (0 for a group without rows)."""
    starts = _exclusive_prefix_sum(group_sizes)
    base = starts // align * align
    tiles = jnp.where(group_sizes > 0, (starts + group_sizes - base + block_m - 1) // block_m, 0)
    return starts, base, tiles


def check_group_sizes(group_sizes, rows: int) -> None:
    """Concrete group sizes (skipped when traced) must be >= 0 and sum to the `rows` the grouped kernels tile: a
    short sum leaves rows no tile writes (garbage or NaN out), a negative size shifts every later group."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any() or int(sizes.sum()) != rows:
        raise ValueError(f"group_sizes must be >= 0 and sum to the {rows} rows, got {sizes.tolist()}")


def max_row_tiles(rows: int, experts: int, block_m: int) -> int:
    """The row tiles (`row_tiles`, align <= 8 <= block_m) `rows` rows over `experts` groups can need, at most:
    rows // block_m full tiles plus one partial tile a non-empty group, and one spare (a bound the tests
    check on random and adversarial group sizes)."""
    return rows // block_m + min(experts, rows) + 1


def row_tiles(group_sizes: jax.Array, block_m: int, max_tiles: int, align: int = 1) -> jax.Array:
    """int32 [3, max_tiles]: (expert, first row, rows of that expert in the tile) of the tiles of block_m rows
    covering each group's rows, in expert order; unused tiles have rows 0. A group's tiles start at its first
    row rounded down to a multiple of `align` (1: at its first row; the Mosaic kernel's 8-row TMA tiles need
    8), so a tile may begin with rows of the previous group. group_sizes int32 [E], rows sorted by expert."""
    starts, base, tiles_per = _tile_counts(group_sizes, block_m, align)
    tile_start = _exclusive_prefix_sum(tiles_per)  # first tile of each expert
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: one [T, E] comparison. searchsorted's default ("scan") is a log2(E)-step while loop,
    # which on GPU waits for the host at every step (~190 us a call on the H200, more than the kernel at T = 1)
    expert = jnp.clip(
        jnp.searchsorted(tile_start + tiles_per, t, side="right", method="compare_all"), 0, group_sizes.shape[0] - 1
    )
    first = base[expert] + (t - tile_start[expert]) * block_m
    low = jnp.maximum(starts[expert], first)
    high = jnp.minimum(starts[expert] + group_sizes[expert], first + block_m)
    rows = jnp.where(t < tiles_per.sum(), high - low, 0)
    return jnp.stack([expert, first, rows]).astype(jnp.int32)


def row_tile_index(group_sizes: jax.Array, rows: int, block_m: int, align: int = 1) -> jax.Array:
    """int32 [rows]: where row a sits in a tile-major buffer [max_tiles * block_m] of `row_tiles`' tiles (same
    block_m and align): its tile times block_m plus its place in the tile."""
    _, base, tiles_per = _tile_counts(group_sizes, block_m, align)
    tile_start = _exclusive_prefix_sum(tiles_per)
    expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows)
    within = jnp.arange(rows, dtype=jnp.int32) - base[expert]
    return ((tile_start[expert] + within // block_m) * block_m + within % block_m).astype(jnp.int32)


def fit_grouped_tiles(tiles: GroupedTiles, kind: str, x_dtype, weight_dtype, scale_dtype, block_m: int) -> GroupedTiles:
    """`tiles` with its K step and stages cut down (`fit_tiling`) until a program's tiles fit the shared
    memory: 4-byte operands at 128 columns and 256-wide K steps ask for more than Hopper's 227 KiB."""
    block_k, num_stages = fit_tiling(
        kind, x_dtype, weight_dtype, scale_dtype, block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.one_dot
    )
    return dataclasses.replace(tiles, block_k=block_k, num_stages=num_stages)


def _grouped_block_m(rows: int, experts: int) -> int:
    """The grouped kernel's rows per program: from the rows an expert gets on average (>= 16, <= 64)."""
    return _block_m(max(1, rows // max(1, min(experts, rows))))


def grouped_plan(rows: int, experts: int, n: int, k: int, tiles: GroupedTiles) -> tuple[int, int, int, int]:
    """(block_m, max_tiles, splits, k_per_split) for `rows` assignments over `experts` experts."""
    block_m = _grouped_block_m(rows, experts)
    max_tiles = max_row_tiles(rows, experts, block_m)
    k_tiles = pl.cdiv(k, tiles.block_k)
    if tiles.splits is None:
        splits = max(1, min(DECODE_SPLITS, k_tiles // 2)) if rows <= DECODE_ROWS else 1
    else:
        splits = min(tiles.splits, k_tiles)
    return (block_m, max_tiles) + _split_k(k_tiles, splits, tiles.block_k)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def _grouped_2d(x, weight, group_sizes, layer, row_index=None, *, interpret: bool, tiles: GroupedTiles):
    # weight: stacked [L, E, N, K] (a plain [E, N, K] arrives as L = 1, layer 0); layer: int32 [].
    # row_index: None (x [A, K] in expert order) or int32 [A] (x [R, K], sorted row a reads x[row_index[a]]) -> y [A, N]
    gathered = row_index is not None
    rows = row_index.shape[0] if gathered else x.shape[0]
    k = x.shape[1]
    experts, n = weight.shape[1], weight.shape[-2]
    kind = _weight_kind(weight)
    tiles.check(kind)
    precision = dot_precision(x.dtype)
    tiles = fit_grouped_tiles(
        tiles, kind, x.dtype, _stored_dtype(weight), _scale_dtype(weight), grouped_plan(rows, experts, n, k, tiles)[0]
    )
    block_m, max_tiles, splits, k_per_split = grouped_plan(rows, experts, n, k, tiles)
    tile_table = row_tiles(group_sizes.astype(jnp.int32), block_m, max_tiles)
    tile_table = jnp.concatenate([tile_table, jnp.broadcast_to(layer.astype(jnp.int32), (1, max_tiles))])
    k_pad = splits * k_per_split
    a_pad = rows + block_m  # a tile addresses block_m rows from its first row (it reads only its own)
    # gathered: x keeps its own rows (the kernel reads them through row_index); else padded to a_pad rows
    x_rows = x.shape[0] if gathered else a_pad
    x_pad = jnp.pad(x, ((0, x_rows - x.shape[0]), (0, k_pad - k)))
    n_tiles = pl.cdiv(n, tiles.block_n)
    one_dot = kind == "int4" and tiles.one_dot
    if one_dot:  # within each K tile plane-major (the kernel's one_dot layout)
        tiled = x_pad.reshape(x_rows, k_pad // tiles.block_k, tiles.block_k // 8, 8).transpose(0, 1, 3, 2)
        inputs = (tiled.reshape(x_rows, k_pad), weight.packed, weight.scale)
    elif kind == "int4":
        planes = x_pad.reshape(x_rows, k_pad // 8, 8).transpose(2, 0, 1)
        inputs = (planes, weight.packed, weight.scale)
    elif kind == "fp8":
        inputs = (x_pad, weight.weight, weight.scale_inv)
    else:
        inputs = (x_pad, weight)
    if gathered:  # clipped: an entry out of range (unchecked under jit) must not read outside x
        inputs = (jnp.pad(jnp.clip(row_index.astype(jnp.int32), 0, x.shape[0] - 1), (0, a_pad - rows)),) + inputs
    out = pl.pallas_call(
        functools.partial(
            _grouped_kernel,
            kind=kind,
            n=n,
            k=k,
            block_m=block_m,
            block_n=tiles.block_n,
            block_k=tiles.block_k,
            k_per_split=k_per_split,
            precision=precision,
            one_dot=one_dot,
            # magic_bf16 rounds like "convert" only with bf16 activations and bf16 scales (a float32 scale would be
            # rounded to bf16 first): any other pair takes "convert"
            dequant=tiles.dequant
            if kind == "int4" and x.dtype == jnp.bfloat16 and weight.scale.dtype == jnp.bfloat16
            else "convert",
            gathered=gathered,
        ),
        grid=(n_tiles, splits, max_tiles),
        in_specs=[_whole(tile_table.shape)] + [_whole(a.shape) for a in inputs],
        out_specs=_whole((splits, a_pad, n_tiles * tiles.block_n)),
        out_shape=jax.ShapeDtypeStruct((splits, a_pad, n_tiles * tiles.block_n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"grouped_matmul_{kind}" + ("_gathered" if gathered else ""),
    )(tile_table, *inputs)
    # rows no tile covers (the padding) hold garbage in every split: sliced off before they are read
    return out[:, :rows, :n].sum(axis=0).astype(x.dtype)


def grouped_matmul(
    x: jax.Array,
    weight,
    group_sizes: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    row_index: jax.Array | None = None,
    interpret: bool | None = None,
    tiles: GroupedTiles | None = None,
) -> jax.Array:
    """Rows of x [A, K] sorted by expert (group_sizes int32 [E], summing to A) against stacked expert
    weights [E, N, K] (array, Int4Weight or Fp8BlockWeight) -> [A, N] in x's dtype: row a is
    x[a] @ W[e(a)]^T. Each expert's weights stream once per row tile of its group; experts without
    rows are never read (the decode case: a step touches a few of 384 experts). tiles: the tiling
    (`GroupedTiles`; default `default_grouped_tiles` for the weight's format and, INT4, the call's size).

    layer: with weights of every layer stacked, [L, E, N, K], the layer to use (int32 scalar, may be
    traced: a scan's counter), read as `lax.dynamic_index_in_dim` reads it (negative from the end, then clamped
    into the stack), as the other stacked-layer kernels. The kernel reads that layer in place: slicing it out first would copy
    the layer's experts (8.4 GB for a K2.6 INT4 layer) on every call, since a Pallas call takes each
    operand as one buffer.

    row_index: int32 [A] or None. Given, x is [R, K] in any order (a MoE layer's tokens) and sorted row a is
    x[row_index[a]]: row a of the result is x[row_index[a]] @ W[e(a)]^T, the kernel reading each row in place
    (no [A, K] copy of x in expert order; entries must lie in [0, R), not checked under jit)."""
    weight, layer = _grouped_operands(x, weight, group_sizes, layer, row_index)
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    tiles = tiles or default_grouped_tiles(weight, rows)
    return _grouped_2d(
        x,
        weight,
        group_sizes,
        jnp.asarray(layer, jnp.int32),
        row_index,
        interpret=default_interpret(interpret),
        tiles=tiles,
    )


def _grouped_operands(x, weight, group_sizes, layer, row_index=None):
    """(weight stacked [L, E, N, K], layer) after the shape checks of a grouped call (a plain [E, N, K] weight
    becomes L = 1, layer 0)."""
    if row_index is not None:
        if row_index.ndim != 1 or not jnp.issubdtype(row_index.dtype, jnp.integer):
            raise ValueError(f"row_index must be integer [A], got {row_index.dtype} {row_index.shape}")
        if not isinstance(row_index, jax.core.Tracer):  # concrete: checked on the host (under a trace, jnp would stage)
            index = np.asarray(row_index)
            bad = (index < 0) | (index >= x.shape[0])
            if bad.any():
                raise ValueError(
                    f"row_index entries must lie in [0, {x.shape[0]}) (x's rows), got {int(index[np.argmax(bad)])}"
                )
    shape = weight.shape
    if layer is None:
        if len(shape) != 3:
            raise ValueError(
                f"grouped_matmul takes stacked expert weights [E, N, K], got shape {shape} "
                "(all layers' [L, E, N, K]: pass layer=)"
            )
        weight = jax.tree.map(lambda a: a[None], weight)  # L = 1: a bitcast
        layer = 0
    elif len(shape) != 4:
        raise ValueError(
            f"with layer= grouped_matmul takes every layer's expert weights [L, E, N, K], got shape {shape}"
        )
    shape = shape[-3:]
    if x.ndim != 2 or x.shape[1] != shape[2]:
        raise ValueError(f"x must be [A, K] with K = {shape[2]}, got {x.shape}")
    if group_sizes.shape != (shape[0],):
        raise ValueError(f"group_sizes must have one entry per expert ({shape[0]},), got {group_sizes.shape}")
    check_group_sizes(group_sizes, x.shape[0] if row_index is None else row_index.shape[0])
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    return weight, layer


# The INT4 prefill tiling, from `bench_matmul --grouped-sweep 2048 --grouped-tiles prefill` (one H200, b1a8ad7,
# 2026-12-03): at a 2,048-token chunk's 16,384 assignments over the 384 K2.6 INT4 experts (64-row tiles), one
# dot a K step at 128 columns, 256-wide K steps and 8 warps took 6,988 / 7,690 us (gate / down: 69 / 63
# TFLOP/s) where the decode default took 10,788 / 11,465 (45 / 42), the best of the eight tilings swept.
PREFILL_GROUPED_TILES = GroupedTiles(block_n=128, block_k=256, num_warps=8, num_stages=3, one_dot=True)


# The INT4 decode tilings of narrow experts (one TP8 shard's: 1/8 of the intermediate), from `bench_matmul
# --grouped-sweep 17 / 65 / 9,17,65 --grouped-shape shard --grouped-tiles shard` (one H200, 42f274e, 2026-12-04, 74
# tilings a case, routing uniform). gate / up [256, 7168] (the default's 2 column tiles x 4 splits leave most SMs
# idle): 64 columns, 512-wide K steps, one K step a split (14 splits) took 135.9 / 287.7 us at 17 / 65 tokens x
# top-8 where the default took 197.0 / 355.7 (the best at 65 tokens, 128 x 256 x 14, took 269.3 but 167.2 at 17).
# down [7168, 256] (one K step: nothing to split): 64 columns, 2 stages took 71.5 / 107.3 / 224.2 us at 9 / 17 / 65
# tokens where the default took 80.0 / 117.5 / 235.1, the best of 22 at each size. Both dequantise "magic_bf16"
# (`--grouped-tiles dequant`, 7a38e06: gate 101.9 / 143.9 / 263.4 -> 101.2 / 131.0 / 259.7 us, down 88.3 / 118.9 /
# 220.4 -> 76.0 / 110.7 / 216.3 at 9 / 17 / 65 tokens; same output bits; later runs: DEQUANT_MODES' comment).
NARROW_N = 512  # experts of at most this many output columns (and >= WIDE columns in) take NARROW_GROUPED_TILES
SHORT_K = 512  # experts of at most this many input columns (and >= WIDE columns out) take SHORT_K_GROUPED_TILES
WIDE = 4096  # the rules hold where they were measured (7,168 against 256); other shapes keep GroupedTiles()
NARROW_GROUPED_TILES = GroupedTiles(block_n=64, block_k=512, splits=14, dequant="magic_bf16")
SHORT_K_GROUPED_TILES = GroupedTiles(block_n=64, num_stages=2, dequant="magic_bf16")


def default_grouped_tiles(weight, rows: int | None = None) -> GroupedTiles:
    """The default tiling per weight format (FP8: 128-wide K steps, one block scale per tile) and, for INT4,
    per size: PREFILL_GROUPED_TILES where `rows` assignments fill 64-row tiles (more than 32 rows an expert
    on average: the case it was measured on, a prefill chunk); below that the decode tilings: NARROW_GROUPED_TILES
    for experts of at most NARROW_N output columns from >= WIDE inputs, SHORT_K_GROUPED_TILES for at most SHORT_K
    input columns into >= WIDE outputs (a TP8 shard's gate / up and down), else GroupedTiles()."""
    if isinstance(weight, Fp8BlockWeight):
        return GroupedTiles(block_k=FP8_BLOCK)
    if isinstance(weight, Int4Weight):
        experts, n, k = weight.shape[-3:]
        if rows is not None and _grouped_block_m(rows, experts) == 64:
            return PREFILL_GROUPED_TILES
        if n <= NARROW_N and k >= WIDE:
            return NARROW_GROUPED_TILES
        if k <= SHORT_K and n >= WIDE:
            return SHORT_K_GROUPED_TILES
    return GroupedTiles()


def grouped_matmul_reference(x: jax.Array, weight, group_sizes: jax.Array, *, layer=None) -> jax.Array:
    """The twin: each row against its expert's dequantised weights (gathered per row); layer: as in
    `grouped_matmul` (sliced out here)."""
    if layer is not None:
        weight = jax.tree.map(lambda a: a[layer], weight)
    expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
    w = dense(weight, x.dtype)[expert]  # [A, N, K]
    return jnp.einsum("ak,ank->an", x, w, preferred_element_type=jnp.float32, precision=dot_precision(x.dtype)).astype(
        x.dtype
    )
