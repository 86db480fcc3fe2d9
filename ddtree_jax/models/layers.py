"""Shared layers as pure functions: RMSNorm, linear ([out, in] weights), SwiGLU, rotary embeddings.

Weights keep HF's [out, in] layout and are contracted on their last axis (the layout that measured
fastest for one-token matmuls on the H200: shared/spec/performance_notes.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] -> same dtype; statistics in float32 (as HF Qwen3RMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight[out, in].T -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, weight)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); gate/up [F, D], down [D, F]."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


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
