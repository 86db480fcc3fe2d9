"""`processed_probs`: the one function that turns logits into the distribution a row samples from.

The plain sampler and every verifier use it (spec fact 4), so speculative and non-speculative
decoding sample from the same law. Definitions, in threshold form (a sort-based reference and a
threshold-search kernel select the same sets):

  p = softmax(logits / T); T == 0: one-hot on the argmax, ties to the lowest token id
  top-k (0 or >= V: off):  keep i iff p_i >= the k-th largest p (ties at the cut kept); renormalise
  top-p (1: off):          keep i iff sum of p_j over p_j > p_i is < top_p; renormalise
  min-p (0: off):          keep i iff p_i >= min_p * max_j p_j; renormalise

Invalid rows (a NaN or +inf logit, or every logit -inf) have no distribution: they come out all
zero here, `valid_rows` flags them, and the samplers/verifiers emit INVALID_TOKEN (-1) for them rather
than a silent wrong token. -inf logits are otherwise fine (masked tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ddtree_jax.sampling.params import SamplingParams

INVALID_TOKEN = -1


def valid_rows(logits: jax.Array) -> jax.Array:
    """bool [...]: no NaN / +inf entry and at least one finite entry along the last axis."""
    x = logits.astype(jnp.float32)
    return (~jnp.isnan(x) & (x != jnp.inf)).all(axis=-1) & (x > -jnp.inf).any(axis=-1)


def check_logits(logits: jax.Array) -> None:
    """Eager check (one host sync): raises ValueError naming the first invalid row."""
    import numpy as np

    ok = np.asarray(valid_rows(logits))
    if not ok.all():
        bad = tuple(int(i) for i in np.argwhere(~ok)[0])
        raise ValueError(f"logits row {bad} contains NaN or +inf, or is entirely -inf")


def _per_row(values: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] broadcastable against logits [B, ..., V]."""
    return values.reshape(values.shape + (1,) * (ndim - 1))


def _renormalise(p: jax.Array) -> jax.Array:
    total = p.sum(axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def processed_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 [B, ..., V] probabilities from logits [B, ..., V] (float32 or bfloat16), params [B].

    Numerically safe at any temperature > 0 (the max is subtracted before dividing by T).
    """
    x = logits.astype(jnp.float32)
    ndim, vocab = x.ndim, x.shape[-1]
    if params.temperature.shape != (x.shape[0],):
        raise ValueError(f"params have batch {params.temperature.shape}, logits have batch {x.shape[0]}")
    temperature = _per_row(params.temperature, ndim)
    top_k = _per_row(params.top_k, ndim)
    top_p = _per_row(params.top_p, ndim)
    min_p = _per_row(params.min_p, ndim)
    valid = valid_rows(x)[..., None]
    x = jnp.where(valid, x, 0.0)  # keep the arithmetic finite; invalid rows are zeroed at the end

    greedy = temperature == 0
    shifted = x - x.max(axis=-1, keepdims=True)  # <= 0, max exactly 0 (-inf stays -inf)
    p = _renormalise(jnp.exp(shifted / jnp.where(greedy, 1.0, temperature)))

    top_k_on = (top_k > 0) & (top_k < vocab)
    top_p_on = top_p < 1.0

    def filter_by_rank(p):
        s = -jnp.sort(-p, axis=-1)  # descending
        kth = jnp.take_along_axis(s, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)
        keep_k = ~top_k_on | (p >= kth)
        total_k = jnp.where(keep_k, p, 0.0).sum(axis=-1, keepdims=True)
        p = jnp.where(keep_k, p, 0.0) / total_k
        # the same renormalised values, still in descending order
        s = jnp.where(~top_k_on | (s >= kth), s, 0.0) / total_k
        # mass strictly above each value: the exclusive cumsum at the first element of its tie group
        before = jnp.cumsum(s, axis=-1) - s
        group_start = jnp.concatenate([jnp.ones_like(s[..., :1], bool), s[..., 1:] != s[..., :-1]], axis=-1)
        above = lax.cummax(jnp.where(group_start, before, 0.0), axis=s.ndim - 1)
        kept = (above < top_p).sum(axis=-1, keepdims=True)  # a prefix of the sorted order, >= 1
        cut = jnp.take_along_axis(s, jnp.clip(kept - 1, 0, vocab - 1), axis=-1)
        keep_p = ~top_p_on | (p >= cut)
        return _renormalise(jnp.where(keep_p, p, 0.0))

    # the sort is only paid when some row of the batch uses top-k or top-p
    p = lax.cond(jnp.any(top_k_on | top_p_on), filter_by_rank, lambda p: p, p)
    p = _renormalise(jnp.where(p >= min_p * p.max(axis=-1, keepdims=True), p, 0.0))

    one_hot = jax.nn.one_hot(jnp.argmax(x, axis=-1), vocab, dtype=jnp.float32)  # ties -> lowest id
    p = jnp.where(greedy, one_hot, p)
    return jnp.where(valid, p, 0.0)
