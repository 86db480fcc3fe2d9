"""Absorbed MLA's per-head products around the attention kernel, one Triton launch each, the weight read in place.

Absorbed MLA multiplies each head's query by its W_UK before attention (q_latent = q_nope . W_UK) and each head's
merged output by its W_UV after (out = o_latent . W_UV^T); between, a split-KV kernel (`mla_attention_mgpu`) leaves
each key split's normalised output and base-2 log-sum-exp to merge. In XLA these are, at decode sizes, a transpose
of each weight every layer (the reductions want [H, r, n]), the products, and three reductions for the merge:
each a launch of 1-3 us (BENCHMARKS.md, the K2.6 TP8 shard's AR profile). Here:

  absorb(q [B, R, Dq], weight [L, H x stride, D] | [H x stride, D], layer, heads=H, q_offset, width, w_offset)
      -> out [B, R, D]:  out[b, r, d] = sum_n q[b, r, q_offset + n] * weight[layer, h * stride + w_offset + n, d]
      for n < width, h = r mod H (W_UK: q_offset 0 of q's nope + rope, w_offset 0, width nope)
  merge_up(partial [B, S, R', D], lse [B, S, R''], weight, layer, rows=R, heads=H, offset, width)
      -> out [B, R, width]:
      merged[b, r]  = sum_s 2^(lse[b, s, r] - m) partial[b, s, r] / sum_s 2^(lse[b, s, r] - m),  m = max_s lse
      out[b, r, v]  = sum_d merged[b, r, d] * weight[layer, h * stride + offset + v, d],  h = r mod H
      (W_UV: offset nope, width v; R' and R'' >= R: padding rows are never read; a row whose splits saw no key,
      lse -inf in every split, merges to 0)
  float32 throughout, out in the input's dtype.

The weight is a projection in HF's [out, in] layout whose rows are head-major blocks of `stride` rows, as
DeepSeek-V3's kv_b_proj [H x (nope + v), r]: W_UK of head h is rows h x stride .. + nope, W_UV rows h x stride +
nope .. + v. With a stacked [L, ...] weight and `layer` (int32 scalar, may be traced: a layer scan's counter) the
layer is read in place, as `lax.dynamic_index_in_dim` reads it (negative from the end, then clamped). No slice or
transpose of the weight is made. Row r of q / the output is head r mod H (rows t-major, t x H + h, as the MLA
kernel flattens them).

Cost: merge_up's program (batch row, row, block of width) reads S x D partials and block_v x D weights; absorb's
(batch row, row, block of D) reads `width` query values and width x block_d weights; the weights are L2-resident
after a head's first program. `absorb_reference` / `merge_up_reference` are the twins (jnp, float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_kernels.mosaic_common import layer_index
from ddtree_kernels.tiling import default_interpret

BLOCK_V = 32  # merge_up: output columns a program
BLOCK_S = 16  # merge_up: splits a step of the merge loop (Triton pipelines its loads 3 steps deep)
BLOCK_D = 128  # absorb: output columns a program


def _kernel(
    layer_ref,
    lse_ref,
    partial_ref,
    weight_ref,
    o_ref,
    *,
    splits: int,
    heads: int,
    stride: int,
    offset: int,
    num_layers: int,
    block_s: int,
    block_v: int,
    dim: int,
):
    # layer_ref: i32 [1]; lse_ref: f32 [B, S, R'']; partial_ref: [B, S, R', D]; weight_ref: [L, H x stride, D]
    # o_ref: [block_v] this program's output columns of row (b, r)
    b, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    steps = pl.cdiv(splits, block_s)

    def row_max(i, top):
        s = i * block_s + jnp.arange(block_s)
        part = plgpu.load(lse_ref.at[b, pl.ds(i * block_s, block_s), r], mask=s < splits, other=-jnp.inf)
        return jnp.maximum(top, jnp.max(part))

    top = lax.fori_loop(0, steps, row_max, jnp.float32(-jnp.inf))
    top = jnp.where(top > -jnp.inf, top, 0.0)  # every split empty: weights 2^-inf = 0, merged 0

    def merge(i, carry):
        acc, total = carry
        s = i * block_s + jnp.arange(block_s)
        ok = s < splits
        part_lse = plgpu.load(lse_ref.at[b, pl.ds(i * block_s, block_s), r], mask=ok, other=-jnp.inf)
        wts = jnp.exp2(part_lse - top)  # [block_s]; 0 past the end and for empty splits
        part = plgpu.load(partial_ref.at[b, pl.ds(i * block_s, block_s), r, :], mask=ok[:, None], other=0)
        acc = acc + jnp.sum(wts[:, None] * part.astype(jnp.float32), axis=0)
        return acc, total + jnp.sum(wts)

    acc, total = lax.fori_loop(0, steps, merge, (jnp.zeros((dim,), jnp.float32), jnp.float32(0.0)))
    merged = acc / jnp.maximum(total, 1e-30)
    head = lax.rem(r, heads)
    layer = layer_index(layer_ref[0], num_layers)
    rows = pl.ds(head * stride + offset + j * block_v, block_v)
    weight = plgpu.load(weight_ref.at[layer, rows, :]).astype(jnp.float32)  # [block_v, D]
    o_ref[...] = jnp.sum(weight * merged[None, :], axis=1).astype(o_ref.dtype)


def _check(partial, lse, weight, layer, rows, heads, offset, width, block_v, block_s=BLOCK_S):
    if partial.ndim != 4:
        raise ValueError(f"partial must be [B, splits, rows, D], got shape {partial.shape}")
    batch, splits, partial_rows, dim = partial.shape
    if lse.ndim != 3 or lse.shape[:2] != (batch, splits) or lse.dtype != jnp.float32:
        raise ValueError(
            f"lse must be float32 [B, splits, rows] = ({batch}, {splits}, >= rows), got {lse.shape} {lse.dtype}"
        )
    if not 1 <= rows <= min(partial_rows, lse.shape[2]):
        raise ValueError(f"rows must be 1 .. {min(partial_rows, lse.shape[2])} (partial's and lse's rows), got {rows}")
    if heads < 1 or rows % heads:
        raise ValueError(f"heads must be >= 1 and divide rows = {rows} (row r is head r mod heads), got {heads}")
    if weight.shape[-1] != dim:
        raise ValueError(f"weight's last axis must be partial's D = {dim}, got shape {weight.shape}")
    stride = _check_weight_rows(weight, layer, heads, offset, width, "offset")
    if block_v < 1 or block_v & (block_v - 1) or width % block_v:
        raise ValueError(f"block_v must be a power of two dividing width = {width}, got {block_v}")
    if block_s < 1 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two >= 1 (splits a step of the merge), got {block_s}")
    if dim & (dim - 1):
        raise ValueError(f"D must be a power of two (one program's row of the merge), got {dim}")
    return stride


def _check_weight_rows(weight, layer, heads: int, offset: int, width: int, offset_name: str) -> int:
    """The head-major weight's form ([H x stride, D], or [L, ...] with an integer scalar layer) and each head's rows
    offset .. + width inside its stride -> stride."""
    if weight.ndim != (2 if layer is None else 3):
        want = "[H x stride, D]" if layer is None else "every layer's [L, H x stride, D] (with layer=)"
        raise ValueError(f"weight must be {want}, got shape {weight.shape}")
    if weight.shape[-2] % heads:
        raise ValueError(f"weight's rows {weight.shape[-2]} must be heads x stride, heads = {heads}")
    stride = weight.shape[-2] // heads
    if offset < 0 or width < 1 or offset + width > stride:
        raise ValueError(f"{offset_name} {offset} + width {width} must lie in each head's {stride} weight rows")
    if layer is not None:
        layer = jnp.asarray(layer)
        if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got shape {layer.shape} dtype {layer.dtype}")
    return stride


def _call(kernel, layer, arrays, weight, *, grid, block: int, out_shape, num_stages: int, name: str, interpret):
    """pallas_call of `kernel` on (layer i32 [1], *arrays, weight [L, ...]) as whole blocks (the kernel indexes
    them), one [block] output block a program at (b, r, j); an unstacked weight as one layer, read at layer 0."""
    if layer is None:
        weight, layer = weight[None], 0
    inputs = (jnp.asarray(layer, jnp.int32).reshape(1), *arrays, weight)
    return pl.pallas_call(
        functools.partial(kernel, num_layers=weight.shape[0]),
        grid=grid,
        in_specs=[pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n) for a in inputs],
        out_specs=pl.BlockSpec((None, None, block), lambda b, r, j: (b, r, j)),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=num_stages),
        interpret=default_interpret(interpret),
        name=name,
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("rows", "heads", "offset", "width", "block_v", "block_s", "interpret"))
def merge_up(
    partial: jax.Array,
    lse: jax.Array,
    weight: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    rows: int,
    heads: int,
    offset: int,
    width: int,
    block_v: int = BLOCK_V,
    block_s: int = BLOCK_S,
    interpret: bool | None = None,
) -> jax.Array:
    """out [B, rows, width] (partial's dtype): the splits of each row merged by their log-sum-exp and multiplied
    by its head's weight rows (module docstring). partial [B, S, R', D] (D a power of two), lse float32 [B, S,
    R''] (base 2), weight bf16 / f32 [H x stride, D] or, with layer (an int32 scalar, may be traced), every
    layer's [L, H x stride, D]; row r is head r mod heads; head h's rows h x stride + offset .. + width."""
    stride = _check(partial, lse, weight, layer, rows, heads, offset, width, block_v, block_s)
    batch, splits, _, dim = partial.shape
    kernel = functools.partial(
        _kernel,
        splits=splits,
        heads=heads,
        stride=stride,
        offset=offset,
        block_s=min(block_s, 1 << max(0, (splits - 1).bit_length())),
        block_v=block_v,
        dim=dim,
    )
    return _call(
        kernel,
        layer,
        (lse, partial),
        weight,
        grid=(batch, rows, width // block_v),
        block=block_v,
        out_shape=jax.ShapeDtypeStruct((batch, rows, width), partial.dtype),
        num_stages=3,
        name="merge_up",
        interpret=interpret,
    )


def merge_up_reference(
    partial: jax.Array,
    lse: jax.Array,
    weight: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    rows: int,
    heads: int,
    offset: int,
    width: int,
) -> jax.Array:
    """`merge_up`'s twin in jnp (float32 merge and product, out in partial's dtype)."""
    stride = _check(partial, lse, weight, layer, rows, heads, offset, width, block_v=width & -width)
    if layer is not None:
        weight = lax.dynamic_index_in_dim(weight, layer_index(layer, weight.shape[0]), 0, keepdims=False)
    lse = lse[:, :, :rows]
    top = jnp.max(lse, axis=1, keepdims=True)
    wts = jnp.exp2(lse - jnp.where(top > -jnp.inf, top, 0.0))
    merged = jnp.einsum("bsr,bsrd->brd", wts, partial[:, :, :rows].astype(jnp.float32), precision="highest")
    merged = merged / jnp.maximum(wts.sum(axis=1), 1e-30)[..., None]
    per_head = weight.reshape(heads, stride, -1)[:, offset : offset + width].astype(jnp.float32)  # [H, width, D]
    batch = partial.shape[0]
    merged = merged.reshape(batch, rows // heads, heads, -1)
    out = jnp.einsum("bthd,hvd->bthv", merged, per_head, precision="highest")
    return out.reshape(batch, rows, width).astype(partial.dtype)


def _absorb_kernel(
    layer_ref,
    q_ref,
    weight_ref,
    o_ref,
    *,
    heads: int,
    stride: int,
    q_offset: int,
    w_offset: int,
    width: int,
    num_layers: int,
    block_d: int,
):
    # layer_ref: i32 [1]; q_ref: [B, R, Dq]; weight_ref: [L, H x stride, D]; o_ref: [block_d] this program's
    # output columns of row (b, r)
    b, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head = lax.rem(r, heads)
    layer = layer_index(layer_ref[0], num_layers)
    q = q_ref[b, r, pl.ds(q_offset, width)].astype(jnp.float32)  # [width]
    weight = weight_ref[layer, pl.ds(head * stride + w_offset, width), pl.ds(j * block_d, block_d)]
    o_ref[...] = jnp.sum(weight.astype(jnp.float32) * q[:, None], axis=0).astype(o_ref.dtype)


def _check_absorb(q, weight, layer, heads, q_offset, width, w_offset, block_d):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, rows, Dq] (row r is head r mod heads), got shape {q.shape}")
    if heads < 1 or q.shape[1] % heads:
        raise ValueError(f"heads must be >= 1 and divide q's rows {q.shape[1]}, got {heads}")
    if q_offset < 0 or width < 1 or q_offset + width > q.shape[2]:
        raise ValueError(f"q_offset {q_offset} + width {width} must lie in q's last axis {q.shape[2]}")
    if width & (width - 1):
        raise ValueError(f"width must be a power of two (one program's reduction), got {width}")
    stride = _check_weight_rows(weight, layer, heads, w_offset, width, "w_offset")
    dim = weight.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"the weight's D must be a power of two (a program's output columns), got {dim}")
    if block_d < 1 or block_d & (block_d - 1) or dim % block_d:
        raise ValueError(f"block_d must be a power of two dividing the weight's D = {dim}, got {block_d}")
    return stride


@functools.partial(jax.jit, static_argnames=("heads", "q_offset", "width", "w_offset", "block_d", "interpret"))
def absorb(
    q: jax.Array,
    weight: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    heads: int,
    q_offset: int,
    width: int,
    w_offset: int,
    block_d: int = BLOCK_D,
    interpret: bool | None = None,
) -> jax.Array:
    """out [B, R, D] (q's dtype): each row's q[q_offset : q_offset + width] times its head's weight rows
    w_offset .. + width (module docstring). q [B, R, Dq] (row r is head r mod heads), weight bf16 / f32
    [H x stride, D] or, with layer (an int32 scalar, may be traced), every layer's [L, H x stride, D]; block_d:
    output columns a program (cut to D)."""
    block_d = min(block_d, weight.shape[-1])
    stride = _check_absorb(q, weight, layer, heads, q_offset, width, w_offset, block_d)
    batch, rows, _ = q.shape
    dim = weight.shape[-1]
    kernel = functools.partial(
        _absorb_kernel, heads=heads, stride=stride, q_offset=q_offset, w_offset=w_offset, width=width, block_d=block_d
    )
    return _call(
        kernel,
        layer,
        (q,),
        weight,
        grid=(batch, rows, dim // block_d),
        block=block_d,
        out_shape=jax.ShapeDtypeStruct((batch, rows, dim), q.dtype),
        num_stages=1,
        name="absorb",
        interpret=interpret,
    )


def absorb_reference(
    q: jax.Array,
    weight: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    heads: int,
    q_offset: int,
    width: int,
    w_offset: int,
) -> jax.Array:
    """`absorb`'s twin in jnp (float32 product, out in q's dtype)."""
    stride = _check_absorb(
        q, weight, layer, heads, q_offset, width, w_offset, block_d=weight.shape[-1] & -weight.shape[-1]
    )
    if layer is not None:
        weight = lax.dynamic_index_in_dim(weight, layer_index(layer, weight.shape[0]), 0, keepdims=False)
    batch, rows, _ = q.shape
    per_head = weight.reshape(heads, stride, -1)[:, w_offset : w_offset + width].astype(jnp.float32)  # [H, n, D]
    query = q[..., q_offset : q_offset + width].astype(jnp.float32).reshape(batch, rows // heads, heads, width)
    out = jnp.einsum("bthn,hnd->bthd", query, per_head, precision="highest")
    return out.reshape(batch, rows, -1).astype(q.dtype)
