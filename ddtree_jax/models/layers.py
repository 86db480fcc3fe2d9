"""Shared layers as pure functions: RMSNorm, linear ([out, in] weights), SwiGLU, rotary embeddings.

Weights keep HF's [out, in] layout and are contracted on their last axis (the layout that measured
fastest for one-token matmuls on the H200).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ddtree_jax import dispatch
from ddtree_jax.sharding.regions import context_mesh, fit_specs, shard_call
from ddtree_jax.sharding.rules import DATA, partition_spec
from ddtree_kernels.decode_matmul import matmul, matmul_reference
from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight
from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul
from ddtree_kernels.tiling import dot_precision


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] -> same dtype; statistics in float32 (as HF Qwen3RMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def contract(spec: str, a: jax.Array, b: jax.Array, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, a, b)` under the precision contract: float32 operands contracted at float32 (on
    the GPU XLA would otherwise use TF32), bf16 on the bf16 path (`ddtree_kernels.tiling.dot_precision`)."""
    return jnp.einsum(spec, a, b, precision=dot_precision(jnp.result_type(a, b)), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `layer` (int32 []) of every layer's stacked weights `stack` [L, ...] (array or quantised
    weight), not sliced out. The model's layer loops pass the routed experts this way (the grouped kernel
    reads the layer in place and "gather" indexes (layer, expert) in one gather, where a slice would copy
    the layer's experts, 8.4 GB per K2.6 INT4 layer, before every Pallas call), and the dense projections
    `dispatch.stacked_in_place` names (`linear` reads them in place, see there). Paths that need the whole
    layer anyway slice it (`get`). axes (static): one layer's logical axis names, which a dense projection
    read in place under a mesh needs (its partition spec from the rule table); None for the experts."""

    stack: Any
    layer: jax.Array
    axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    def get(self):
        return jax.tree.map(lambda a: a[self.layer], self.stack)


def _linear_in_place(x: jax.Array, weight: LayerOf) -> jax.Array:
    """x [..., in] @ weight.stack[weight.layer].T by the Mosaic skinny kernel reading the layer in place. Under a
    mesh, a per-shard program (`sharding.regions.shard_call`): x's rows split as its batch, the weight as the TP
    rule table splits it (`weight.axes`: [out, in] logical axes), x's last dimension as the weight's "in"; a
    weight split along "in" (o_proj, down projections) sums its partial products over "model"."""
    out_axis, in_axis = partition_spec(weight.axes, "tp") if weight.axes is not None else (None, None)
    lead = [DATA] + [None] * (x.ndim - 2) if x.ndim > 1 else []
    args = (x, weight.stack, weight.layer)
    specs = (PartitionSpec(*lead, in_axis), PartitionSpec(None, out_axis, in_axis), PartitionSpec())
    out_spec = PartitionSpec(*lead, out_axis)
    mesh = context_mesh()
    # an "in" axis the mesh does not divide falls back to replication (`fit_specs`, in x and the weight alike):
    # then each shard holds whole products, nothing to sum
    summed = in_axis is not None and mesh is not None and in_axis not in fit_specs(mesh, args, specs, out_spec)[2]

    def per_shard(x, stack, layer):
        flat = x.reshape(-1, x.shape[-1])
        # compiled (the dispatch sent it here for a GPU; a CPU host lowering for one must not interpret it)
        out = skinny_matmul(flat, stack, layer=layer, interpret=False).reshape(*x.shape[:-1], stack.shape[-2])
        return jax.lax.psum(out, in_axis) if summed else out

    return shard_call(per_shard, args, specs, out_spec, reduce_axes=(in_axis,) if summed else ())


def linear(x: jax.Array, weight, impl: str = "xla") -> jax.Array:
    """x [..., in] @ weight[out, in].T -> [..., out]; a quantised weight (`ddtree_kernels.quant`) is
    dequantised to x's dtype first in "xla" (`ddtree_kernels.decode_matmul.matmul_reference`); "pallas"
    streams it through `ddtree_kernels.decode_matmul.matmul` (dequantised in registers; interpret mode
    off GPU); "mosaic" a dense bf16 weight through `ddtree_kernels.skinny_matmul_mgpu.skinny_matmul` on GPU
    (else XLA); "auto": `dispatch.matmul_impl`. float32 inputs are computed at float32.

    weight may be a `LayerOf` (a layer of stacked weights, as a layer scan passes the projections
    `dispatch.stacked_in_place` names): on GPU, where the skinny kernel takes the product
    (`dispatch.matmul_in_place`), it reads the layer in place, whatever `impl` says (the scan chose it);
    anywhere else the layer is sliced out and `impl` applies."""
    if isinstance(weight, LayerOf):
        quantized = isinstance(weight.stack, (Int4Weight, Fp8BlockWeight))
        if dispatch.matmul_in_place(
            math.prod(x.shape[:-1]),
            weight.shape,
            quantized=quantized,
            bfloat16=not quantized and x.dtype == jnp.bfloat16 and weight.stack.dtype == jnp.bfloat16,
        ):
            return _linear_in_place(x, weight)
        weight = weight.get()
    quantized = isinstance(weight, (Int4Weight, Fp8BlockWeight))
    rows = math.prod(x.shape[:-1])
    choice = dispatch.matmul_impl(
        impl,
        rows=rows,
        quantized=quantized,
        weight_shape=None if quantized else weight.shape,
        bfloat16=x.dtype == jnp.bfloat16 and not quantized and weight.dtype == jnp.bfloat16,
    )
    if choice == "pallas":
        return matmul(x, weight)
    if choice == "mosaic":
        return skinny_matmul(x.reshape(rows, x.shape[-1]), weight, interpret=False).reshape(
            *x.shape[:-1], weight.shape[0]
        )
    return matmul_reference(x, weight)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, impl: str = "xla") -> jax.Array:
    """down(silu(gate(x)) * up(x)); gate/up [F, D], down [D, F]; impl: `linear`'s."""
    return linear(jax.nn.silu(linear(x, gate, impl)) * linear(x, up, impl), down, impl)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [..., head_dim] for integer positions [...] (HF's half-split layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., head_dim / 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, Dh]; cos/sin [B, T, Dh] -> x rotated (rotate_half convention), x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, :, None, :] + rotated.astype(jnp.float32) * sin[:, :, None, :]
    return out.astype(x.dtype)


def decoder_layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """{name: (shape, logical axes)} of one Qwen3-style decoder layer (the target's and the drafter's)."""
    return {
        "input_norm": ((hidden,), ("embed",)),
        "q_proj": ((heads * head_dim, hidden), ("q_heads", "embed")),
        "k_proj": ((kv_heads * head_dim, hidden), ("kv_heads", "embed")),
        "v_proj": ((kv_heads * head_dim, hidden), ("kv_heads", "embed")),
        "o_proj": ((hidden, heads * head_dim), ("embed", "q_heads")),
        "q_norm": ((head_dim,), ("head_dim",)),
        "k_norm": ((head_dim,), ("head_dim",)),
        "post_norm": ((hidden,), ("embed",)),
        "gate_proj": ((intermediate, hidden), ("mlp", "embed")),
        "up_proj": ((intermediate, hidden), ("mlp", "embed")),
        "down_proj": ((hidden, intermediate), ("embed", "mlp")),
    }


def layer_params(layers, layer: int):
    """Layer `layer`'s parameters from a stack of layers: a pytree of [L, ...] arrays (sliced here) or a tuple
    of per-layer pytrees (`unstack_layers`: indexed, no slice op)."""
    if isinstance(layers, (tuple, list)):
        return layers[layer]
    return jax.tree.map(lambda w: w[layer], layers)


def unstack_layers(layers, num_layers: int) -> tuple:
    """A stacked layer pytree ([L, ...] leaves) as a tuple of per-layer pytrees (a tuple passes through).

    Why: inside a decode while_loop, a stacked weight's per-layer slice that feeds a matmul of more than one
    row is not fused into it; XLA copies the slice out every iteration (one copy kernel per weight per
    step: 56 launches and ~85 us a step on the embedded pair). Sliced once before the loop, the loop reads
    the per-layer arrays in place. The slices are copies: the stacked and sliced weights coexist while the
    program runs."""
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    return tuple(layer_params(layers, i) for i in range(num_layers))


def restack_layers(layers):
    """The inverse of `unstack_layers`: a tuple of per-layer pytrees as one pytree of [L, ...] leaves (a
    stacked pytree passes through); what `lax.scan` over the layers needs."""
    if isinstance(layers, (tuple, list)):
        return jax.tree.map(lambda *ws: jnp.stack(ws), *layers)
    return layers


def stacked(layer_shapes: dict, num_layers: int) -> dict:
    """Adds the leading "layers" axis to every per-layer (shape, axes)."""
    return {k: ((num_layers,) + s, ("layers",) + a) for k, (s, a) in layer_shapes.items()}


def is_shape_leaf(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def axes_of(shapes: dict) -> dict:
    """The logical axis names of a {name: (shape, axes)} tree."""
    return jax.tree.map(lambda leaf: leaf[1], shapes, is_leaf=is_shape_leaf)


def init_from_shapes(shapes: dict, key: jax.Array, dtype, norm_jitter: float = 0.0) -> dict:
    """Random parameters for a {name: (shape, axes)} tree: matrices normal(0, 0.02); vectors (norm
    weights) 1, or 1 + norm_jitter * normal so that tests see them."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape_leaf)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (shape, axes), k in zip(leaves, keys):
        is_norm = len(shape) - (axes[0] == "layers") == 1
        noise = jax.random.normal(k, shape)
        out.append((1.0 + norm_jitter * noise if is_norm else 0.02 * noise).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    dim: int,
    theta: float,
    *,
    rope_type: str = "default",
    factor: float = 1.0,
    original_max: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> jax.Array:
    """float32 [dim / 2] inverse frequencies; YaRN blends interpolated and extrapolated frequencies with
    a linear ramp over the correction range of dimensions (Peng et al., YaRN, arXiv 2309.00071)."""
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    extrapolated = 1.0 / theta**exponents
    if rope_type == "default":
        return extrapolated
    interpolated = extrapolated / factor

    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    return interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight


def apply_rope_interleaved(x: jax.Array, cos_half: jax.Array, sin_half: jax.Array) -> jax.Array:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; output in half-split layout (as HF DeepSeek-V3).
    x [B, T, H, Dr]; cos_half/sin_half [B, T, Dr / 2]."""
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    c, s = cos_half[:, :, None, :], sin_half[:, :, None, :]
    return jnp.concatenate([even * c - odd * s, odd * c + even * s], axis=-1).astype(x.dtype)


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor YaRN applies to cos / sin (HF: attention_factor)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_cos_sin(positions: jax.Array, dim: int, config) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [..., dim / 2] (one entry per frequency) for a config with rope_theta, rope_type
    and the YaRN fields (rope_factor, rope_original_max_position, rope_beta_fast / slow, rope_mscale,
    rope_mscale_all_dim); YaRN's attention factor is applied to both, as HF does."""
    inv_freq = rope_inv_freq(
        dim,
        config.rope_theta,
        rope_type=config.rope_type,
        factor=config.rope_factor,
        original_max=config.rope_original_max_position,
        beta_fast=config.rope_beta_fast,
        beta_slow=config.rope_beta_slow,
    )
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    scale = 1.0
    if config.rope_type == "yarn":
        scale = yarn_attention_factor(config.rope_factor, config.rope_mscale, config.rope_mscale_all_dim)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale
