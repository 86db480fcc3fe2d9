"""The plain (non-speculative) sampler; `inverse_cdf` (the final-sample rule every sampler shares) is
`ddtree_kernels.sampling_reference`'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.sampling.coins import draw_coins
from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import INVALID_TOKEN, processed_probs, valid_rows
from ddtree_kernels.sampling_reference import inverse_cdf


def sample(logits: jax.Array, params: SamplingParams, keys: jax.Array) -> jax.Array:
    """int32 [B]: one token per row from processed_probs(logits [B, V], params).

    keys: typed PRNG keys [B], one per row (see `row_keys`); greedy rows ignore theirs. Rows with
    invalid logits (NaN, +inf, all -inf) or, under jit, out-of-range settings (`SamplingParams.in_range`) give
    INVALID_TOKEN.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {tuple(logits.shape)}")
    if tuple(keys.shape) != (logits.shape[0],):
        raise ValueError(
            f"keys must be one typed PRNG key per row, shape [B] = ({logits.shape[0]},), got {tuple(keys.shape)}"
        )
    probs = processed_probs(logits, params)
    coins = draw_coins(keys, ())
    token, has_mass = inverse_cdf(probs, coins)
    return jnp.where(valid_rows(logits) & params.in_range() & has_mass, token, INVALID_TOKEN)


__all__ = ["inverse_cdf", "sample"]
