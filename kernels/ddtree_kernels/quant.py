"""Quantised weights kept in their stored form in device memory and dequantised inside the matmul.

INT4 "pack-quantized" (compressed-tensors; Kimi K2.x routed experts): symmetric, group size 32.
  weight_packed int32 [..., out, in / 8]: element k (0..7) of a word in bits 4k..4k+3, as the unsigned
  code q + 8 of a signed value q in [-8, 7]; weight_scale [..., out, in / 32]; w = q * scale.
Block FP8 (DeepSeek-V3, original Kimi K2): weight float8_e4m3fn [..., out, in], weight_scale_inv
  float32 [..., ceil(out / 128), ceil(in / 128)]; w = weight * scale_inv of its 128 x 128 block.

The reference matmul dequantises to the activation dtype and contracts ([out, in] layout, like
`layers.linear`); the Pallas weight-streaming kernels replace it without changing this contract.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

INT4_GROUP = 32
FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    packed: jax.Array  # int32 [..., out, in / 8]
    scale: jax.Array  # [..., out, in / 32]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.packed.shape[:-1] + (self.packed.shape[-1] * 8,)

    def check_layout(self, name: str = "the weight") -> None:
        """ValueError naming `name` unless the words are int32 and the scales [..., out, in / 32] match them (a
        kernel reads both in place: a wrong scale layout would read finite garbage)."""
        want_scale = self.packed.shape[:-1] + (self.packed.shape[-1] * 8 // INT4_GROUP,)
        if self.scale.shape != want_scale:
            raise ValueError(
                f"{name}: scale shape {self.scale.shape} does not match the packed words (want {want_scale})"
            )
        if self.packed.dtype != jnp.int32:
            raise ValueError(f"{name}: packed words must be int32, got {self.packed.dtype}")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        shifts = jnp.arange(8, dtype=jnp.int32) * 4
        codes = (self.packed[..., None] >> shifts) & 0xF  # [..., out, in / 8, 8]
        values = (codes - 8).reshape(self.shape).astype(jnp.float32)
        scale = jnp.repeat(self.scale.astype(jnp.float32), INT4_GROUP, axis=-1)
        return (values * scale).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight:
    weight: jax.Array  # float8_e4m3fn [..., out, in]
    scale_inv: jax.Array  # float32 [..., ceil(out / 128), ceil(in / 128)]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        out, inner = self.weight.shape[-2:]
        scale = jnp.repeat(jnp.repeat(self.scale_inv.astype(jnp.float32), FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
        return (self.weight.astype(jnp.float32) * scale[..., :out, :inner]).astype(dtype)


for _cls, _fields in ((Int4Weight, ["packed", "scale"]), (Fp8BlockWeight, ["weight", "scale_inv"])):
    jax.tree_util.register_dataclass(_cls, data_fields=_fields, meta_fields=[])


def dense(weight, dtype=jnp.float32) -> jax.Array:
    """A plain array as is; a quantised weight dequantised to `dtype`."""
    return weight.dequantize(dtype) if isinstance(weight, (Int4Weight, Fp8BlockWeight)) else weight


def quantize_int4(weight: np.ndarray) -> Int4Weight:
    """Symmetric group-32 INT4 of a float [..., out, in] array (in a multiple of 32): scale = max|w| / 7
    per group, q = clip(round(w / scale), -8, 7). For tests and for converting float checkpoints."""
    w = np.asarray(weight, np.float32)
    if w.shape[-1] % INT4_GROUP:
        raise ValueError(f"INT4 needs the input dimension to be a multiple of {INT4_GROUP}, got {w.shape[-1]}")
    groups = w.reshape(w.shape[:-1] + (w.shape[-1] // INT4_GROUP, INT4_GROUP))
    scale = np.abs(groups).max(-1) / 7.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(groups / scale[..., None]), -8, 7).astype(np.int64).reshape(w.shape)
    codes = (q + 8).reshape(w.shape[:-1] + (w.shape[-1] // 8, 8))
    packed = np.zeros(codes.shape[:-1], np.int64)
    for k in range(8):
        packed |= codes[..., k] << (4 * k)
    packed = packed.astype(np.uint32).view(np.int32)
    return Int4Weight(jnp.asarray(packed), jnp.asarray(scale))
