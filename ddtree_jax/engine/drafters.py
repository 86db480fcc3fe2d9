"""Drafters as the engine sees them: `append(state, features, count)` and `draft(state, bonus, block)`.

`DFlashDrafter` wraps the DFlash model (its context cache is the drafter state). The engine only
needs these two calls, so tests and studies can plug other drafters (e.g. an oracle).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.config import DFlashConfig
from ddtree_jax.models import dflash


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """The DFlash drafter bound to its weights and the target's embedding and LM head."""

    config: DFlashConfig
    params: dict
    embed: jax.Array
    lm_head: jax.Array

    @property
    def max_block_size(self) -> int:
        return self.config.block_size

    def init_state(self, batch: int, capacity: int, dtype=jnp.float32):
        return dflash.create_context_cache(self.config, batch, capacity, dtype)

    def append(self, state, features, count):
        """Context K/V for the committed tokens' tapped target features [B, T, F*D] (count[b] real)."""
        return dflash.append_context(self.config, self.params, state, features, count)

    def draft(self, state, bonus, block_size: int):
        """float32 draft logits [B, block_size - 1, V] after the bonus tokens [B]."""
        return dflash.draft(self.config, self.params, self.embed, self.lm_head, state, bonus, block_size=block_size)


jax.tree_util.register_dataclass(DFlashDrafter, data_fields=["params", "embed", "lm_head"], meta_fields=["config"])
