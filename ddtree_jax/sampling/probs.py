"""`processed_probs`: the one function that turns logits into the distribution a row samples from.

The plain sampler and every verifier use it, so speculative and non-speculative
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
import numpy as np

from ddtree_jax.sampling.params import SamplingParams
from ddtree_kernels.sampling_reference import processed_probs_reference, valid_rows

__all__ = ["INVALID_TOKEN", "check_logits", "processed_probs", "valid_rows"]

INVALID_TOKEN = -1


def check_logits(logits: jax.Array) -> None:
    """Eager check (one host sync): raises ValueError naming the first invalid row."""
    ok = np.asarray(valid_rows(logits))
    if not ok.all():
        bad = tuple(int(i) for i in np.argwhere(~ok)[0])
        raise ValueError(f"logits row {bad} contains NaN or +inf, or is entirely -inf")


def processed_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 [B, ..., V] probabilities from logits [B, ..., V] (float32 or bfloat16), params [B]: the
    definitions above (`ddtree_kernels.sampling_reference.processed_probs_reference`, which the fused
    tree-sampling kernel is tested against). Numerically safe at any temperature > 0."""
    if params.temperature.shape != (logits.shape[0],):
        raise ValueError(f"params have batch {params.temperature.shape}, logits have batch {logits.shape[0]}")
    return processed_probs_reference(logits, params.temperature, params.top_k, params.top_p, params.min_p)
