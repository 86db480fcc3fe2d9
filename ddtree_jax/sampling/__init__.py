"""Sampling: per-row parameters, the processed distribution, coins, and the plain sampler."""

from ddtree_jax.sampling.coins import COIN_MAX, COIN_MIN, draw_coins, row_keys
from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import INVALID_TOKEN, check_logits, processed_probs, valid_rows
from ddtree_jax.sampling.sample import inverse_cdf, sample

__all__ = [
    "SamplingParams",
    "processed_probs",
    "valid_rows",
    "check_logits",
    "INVALID_TOKEN",
    "draw_coins",
    "row_keys",
    "COIN_MIN",
    "COIN_MAX",
    "inverse_cdf",
    "sample",
]
