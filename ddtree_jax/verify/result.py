"""`VerifyResult`: what every verifier returns."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Outputs of one verification, S = max_accept + 1.

    Attributes:
      accept_index: int32 [B, S] local slot indices of the accepted path, starting with 0 (the root);
        -1 after the end. Mask by num_accepted before gathering: index -1 wraps in JAX.
      num_accepted: int32 [B] draft tokens accepted (the final correction/bonus token not counted).
      tokens: int32 [B, S] the emitted tokens: candidates of accept_index[1..n] then the final token;
        -1 after. A step emits num_accepted + 1 tokens (tau = num_accepted + 1).
    """

    accept_index: jax.Array
    num_accepted: jax.Array
    tokens: jax.Array

    @property
    def num_emitted(self) -> jax.Array:
        return self.num_accepted + 1


jax.tree_util.register_dataclass(VerifyResult, data_fields=["accept_index", "num_accepted", "tokens"], meta_fields=[])


def emitted_tokens(candidates: jax.Array, accept: jax.Array, num_accepted: jax.Array, final: jax.Array) -> jax.Array:
    """One row's `tokens` [S]: candidates of accept[1..n], then `final`, then -1.

    candidates [N]; accept [S] (accept[0] = 0, -1 after the end); num_accepted and final: scalars.
    """
    steps = accept.shape[0]
    positions = jnp.arange(steps)
    accepted_tokens = candidates[jnp.maximum(accept, 0)]
    tokens = jnp.where(positions < num_accepted, accepted_tokens[jnp.minimum(positions + 1, steps - 1)], -1)
    return jnp.where(positions == num_accepted, final, tokens).astype(jnp.int32)
