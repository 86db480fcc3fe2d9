"""A synthetic drafter distribution for tools, tests and benchmarks when no drafter is at hand.

Each depth d gets Zipf-shaped logits, -alpha_d * log(1 + rank), over a random permutation of the
vocabulary, with a sharpness alpha_d = alpha_1 * decay^(d-1) that falls with depth: confident near the
root, flatter deeper down, the qualitative shape of block-diffusion drafter marginals (DFlash's
per-position acceptance falls with position). Not a model of any particular drafter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def synthetic_draft_logits(
    key: jax.Array,
    batch: int,
    depth: int,
    vocab: int,
    *,
    sharpness: float = 3.0,
    decay: float = 0.85,
    dtype=jnp.float32,
) -> jax.Array:
    """float [batch, depth, vocab] logits; see the module docstring."""
    for name, value in (("batch", batch), ("depth", depth), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not (math.isfinite(sharpness) and sharpness > 0):
        raise ValueError(f"sharpness must be a finite number > 0, got {sharpness}")
    if not (math.isfinite(decay) and 0 < decay <= 1):
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    alpha = sharpness * decay ** jnp.arange(depth, dtype=jnp.float32)  # [depth]
    ranked = -alpha[:, None] * jnp.log1p(jnp.arange(vocab, dtype=jnp.float32))[None, :]  # [depth, vocab]
    keys = jax.random.split(key, batch * depth)
    perms = jax.vmap(lambda k: jax.random.permutation(k, vocab))(keys).reshape(batch, depth, vocab)
    logits = jnp.zeros((batch, depth, vocab), jnp.float32)
    logits = logits.at[jnp.arange(batch)[:, None, None], jnp.arange(depth)[None, :, None], perms].set(
        jnp.broadcast_to(ranked, (batch, depth, vocab))
    )
    return logits.astype(dtype)
