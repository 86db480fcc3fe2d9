"""Drafters as the engine sees them: `append(state, features, count)` and `draft(state, bonus, block)`.

`DFlashDrafter` wraps the DFlash model (its context cache is the drafter state). The engine only
needs these two calls, so tests and studies can plug other drafters (e.g. an oracle).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.config import ChildHeadConfig, DFlashConfig
from ddtree_jax.models import child_head, dflash


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """The DFlash drafter bound to its weights and the target's embedding and LM head, and optionally a
    path-conditioned child head (`models.child_head`, issue #23: head_config and head_params together). With a
    head, DDTree steps build path-conditioned trees (`tree.conditional`); without, the marginal DDTree tree."""

    config: DFlashConfig
    params: dict
    embed: jax.Array
    lm_head: jax.Array
    head_params: dict | None = None
    head_config: ChildHeadConfig | None = None

    def __post_init__(self):
        if (self.head_config is None) != (self.head_params is None):
            raise ValueError("DFlashDrafter: head_config and head_params go together (both or neither)")
        if self.head_config is not None and self.head_config.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"the child head's hidden_size ({self.head_config.hidden_size}) must equal the drafter's "
                f"({self.config.hidden_size})"
            )

    @property
    def conditional(self) -> bool:
        """Whether DDTree steps build path-conditioned trees (a child head is attached)."""
        return self.head_config is not None

    def with_head(self, head_config: ChildHeadConfig, head_params: dict) -> DFlashDrafter:
        return dataclasses.replace(self, head_config=head_config, head_params=head_params)

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

    def draft_children(self, state, bonus, block_size: int):
        """(draft logits [B, L, V], child_logits_fn, inputs): the draft pass with the `tree.conditional` inputs
        of this drafter's child head (requires `conditional`)."""
        if self.head_config is None:
            raise ValueError("draft_children needs a child head (DFlashDrafter.with_head)")
        logits, hidden = dflash.draft(
            self.config, self.params, self.embed, self.lm_head, state, bonus, block_size=block_size, return_hidden=True
        )
        inputs = child_head.HeadInputs(params=self.head_params, hidden=hidden, embed=self.embed, lm_head=self.lm_head)
        return logits, functools.partial(child_head.head_child_logits, self.head_config), inputs


jax.tree_util.register_dataclass(
    DFlashDrafter,
    data_fields=["params", "embed", "lm_head", "head_params"],
    meta_fields=["config", "head_config"],
)
