"""`VerifyResult`: what every verifier returns (the kernels and `ddtree_kernels.sampling_reference` return
its three arrays; the verifiers wrap them here)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.sampling.probs import INVALID_TOKEN


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


def invalid_rows_masked(result: VerifyResult, row_ok: jax.Array) -> VerifyResult:
    """`result` with the rows not `row_ok` (bool [B]) as invalid rows: num_accepted 0, accept_index [0, -1, ...],
    tokens INVALID_TOKEN; the other rows as they are."""
    steps = result.accept_index.shape[1]
    return VerifyResult(
        accept_index=jnp.where(row_ok[:, None], result.accept_index, jnp.where(jnp.arange(steps) == 0, 0, -1)),
        num_accepted=jnp.where(row_ok, result.num_accepted, 0),
        tokens=jnp.where(row_ok[:, None], result.tokens, INVALID_TOKEN),
    )


jax.tree_util.register_dataclass(VerifyResult, data_fields=["accept_index", "num_accepted", "tokens"], meta_fields=[])
