"""`DraftTree`: the fixed-shape draft tree that flows from the builder to the verifier.

Every per-row array has N = budget + 1 slots; slot 0 is the root (the bonus token of the
previous step), slots 1..num_nodes-1 are the draft nodes in pop order of the best-first heap
(non-increasing log-weight), the rest are padding (docs/design.md, "Tree construction").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

#: Values every padding slot carries (the fixed-shape form: padding after the real slots).
PAD_PARENT = -1
PAD_DEPTH = 0
PAD_RANK = -1
PAD_TOKEN = 0


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees in the fixed-shape form.

    Attributes:
      tokens:    int32 [B, N]  token of each slot; slot 0 = root token (0 if none given); padding 0.
      parents:   int32 [B, N]  slot index of the parent; -1 for the root and for padding.
      depths:    int32 [B, N]  depth (root 0, its children 1, ...); padding 0.
      ranks:     int32 [B, N]  rank of the token in its depth's top-K (0 = most probable); root/padding -1.
      logw:      float32 [B, N] sum of draft log-probabilities along the path; root 0, padding -inf.
      num_nodes: int32 [B]     real slots including the root (1 .. N).
      max_depth: static int    the depth limit L (= drafter block size - 1).
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    ranks: jax.Array
    logw: jax.Array
    num_nodes: jax.Array
    max_depth: int = dataclasses.field(metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_slots(self) -> int:
        """N = budget + 1."""
        return self.tokens.shape[1]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def is_real(self) -> jax.Array:
        """bool [B, N]: slot index < num_nodes (root and draft nodes, not padding)."""
        return jnp.arange(self.num_slots)[None, :] < self.num_nodes[:, None]

    def row(self, b: int) -> DraftTree:
        """The b-th row as a batch of one (handy for printing and plotting)."""
        return jax.tree.map(lambda x: x[b : b + 1], self)


jax.tree_util.register_dataclass(
    DraftTree,
    data_fields=["tokens", "parents", "depths", "ranks", "logw", "num_nodes"],
    meta_fields=["max_depth"],
)
