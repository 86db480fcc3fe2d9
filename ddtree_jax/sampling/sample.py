"""The plain (non-speculative) sampler and the inverse-CDF draw every sampler shares."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.sampling.coins import draw_coins
from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import INVALID_TOKEN, processed_probs, valid_rows


def inverse_cdf(weights: jax.Array, coin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The spec's final-sample rule over unnormalised weights [..., V] (>= 0) and coins [...].

    u = coin * sum(weights); token = the first i (vocab order) with weights[i] > 0 and
    cumsum(weights)[i] > u; if none, the last i with weights[i] > 0.
    Returns (token int32 [...], has_mass bool [...]); where has_mass is False the caller applies its
    own fallback (the verifier: last rejected token, else V - 1).
    """
    vocab = weights.shape[-1]
    cdf = jnp.cumsum(weights, axis=-1)
    u = coin[..., None] * cdf[..., -1:]
    positive = weights > 0
    hit = positive & (cdf > u)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    first_hit = jnp.min(jnp.where(hit, ids, vocab), axis=-1)
    last_positive = jnp.max(jnp.where(positive, ids, -1), axis=-1)
    token = jnp.where(first_hit < vocab, first_hit, last_positive)
    return token.astype(jnp.int32), last_positive >= 0


def sample(logits: jax.Array, params: SamplingParams, keys: jax.Array) -> jax.Array:
    """int32 [B]: one token per row from processed_probs(logits [B, V], params).

    keys: typed PRNG keys [B], one per row (see `row_keys`); greedy rows ignore theirs. Rows with
    invalid logits (NaN, +inf, all -inf) give INVALID_TOKEN.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {tuple(logits.shape)}")
    probs = processed_probs(logits, params)
    coins = draw_coins(keys, ())
    token, has_mass = inverse_cdf(probs, coins)
    return jnp.where(valid_rows(logits) & has_mass, token, INVALID_TOKEN)
