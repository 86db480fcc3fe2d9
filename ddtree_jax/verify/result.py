"""`VerifyResult`: what every verifier returns (the kernels and `ddtree_kernels.sampling_reference` return
its three arrays; the verifiers wrap them here)."""

from __future__ import annotations

import dataclasses

import jax


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
