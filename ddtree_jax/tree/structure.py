"""Structures derived from a `DraftTree`, all jit-friendly: positions, the ancestor mask, and the
first-child / next-sibling lists that give the verifier its sibling order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ddtree_jax.options import ORDER_POLICIES
from ddtree_jax.tree.draft_tree import DraftTree

__all__ = ["ORDER_POLICIES", "ancestor_mask", "positions", "verification_order"]


def positions(tree: DraftTree, start: jax.Array) -> jax.Array:
    """int32 [B, N]: sequence position of each slot, start[b] + depth (siblings share a position).

    start: int32 [B] (the row's cache length) or a scalar.
    """
    start = jnp.asarray(start, jnp.int32)
    return jnp.reshape(start, (-1, 1)) + tree.depths


def ancestor_mask(tree: DraftTree) -> jax.Array:
    """bool [B, N, N]: mask[b, i, j] = slot j is slot i or an ancestor of i (padding rows: self only)."""
    batch, slots = tree.parents.shape
    mask = jnp.broadcast_to(jnp.eye(slots, dtype=bool), (batch, slots, slots))
    ancestor = tree.parents  # [B, N], -1 once past the root
    rows = jnp.arange(slots)
    for _ in range(tree.max_depth):  # a path has at most max_depth edges
        hit = (ancestor[:, :, None] == rows[None, None, :]) & (ancestor[:, :, None] >= 0)
        mask = mask | hit
        ancestor = jnp.where(ancestor >= 0, jnp.take_along_axis(tree.parents, jnp.maximum(ancestor, 0), axis=1), -1)
    return mask


def verification_order(
    tree: DraftTree, order: str = "draft", key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """First-child / next-sibling lists over local slot indices, with a sibling-order policy.

    Args:
      tree: the draft tree.
      order: "draft" (descending draft log-probability = rank order), "reverse" (ascending), or
        "random" (a keyed random permutation of each sibling group). `key`: one typed key, from
        which row b uses `fold_in(key, b)`, or keys [B], one per row; either way a row's permutation
        does not depend on the other rows.

    Returns:
      (next_token, next_sibling), int32 [B, N] each, -1 = none. next_token[i] is the first child of
      slot i in verification order, next_sibling[i] the child of the same parent tried after i.
      Padding slots are in no list.
    """
    if order not in ORDER_POLICIES:
        raise ValueError(f"order must be one of {ORDER_POLICIES}, got {order!r}")
    if order == "random" and key is None:
        raise ValueError("order='random' needs a PRNG key")
    batch, slots = tree.parents.shape
    if order == "draft":
        within = tree.ranks
    elif order == "reverse":
        within = -tree.ranks
    else:
        if key.ndim == 1:
            if key.shape != (batch,):
                raise ValueError(f"per-row keys must have shape ({batch},), got {key.shape}")
            row_keys = key
        else:
            row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
        within = jax.vmap(lambda k: jax.random.randint(k, (slots,), 0, jnp.iinfo(jnp.int32).max))(row_keys)
    return _sibling_lists(tree.parents, within)


def _sibling_lists(parents: jax.Array, within: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Lists from parents [B, N] and a within-group order key [B, N] (ties -> lower slot first)."""
    batch, slots = parents.shape
    slot = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
    group = jnp.where(parents >= 0, parents, slots)  # root and padding: a group nobody reads
    group_s, _, slot_s = lax.sort((group, within.astype(jnp.int32), slot), num_keys=3)
    real_s = group_s < slots
    same_as_next = jnp.concatenate([group_s[:, 1:] == group_s[:, :-1], jnp.zeros((batch, 1), bool)], axis=1)
    following = jnp.concatenate([slot_s[:, 1:], jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    first_of_group = jnp.concatenate([jnp.ones((batch, 1), bool), group_s[:, 1:] != group_s[:, :-1]], axis=1)

    rows = jnp.arange(batch)[:, None]
    next_sibling = (
        jnp.full((batch, slots), -1, jnp.int32).at[rows, slot_s].set(jnp.where(real_s & same_as_next, following, -1))
    )
    # scatter each group's first child to its parent; non-first entries write to a dropped index
    target = jnp.where(real_s & first_of_group, group_s, slots)
    next_token = jnp.full((batch, slots), -1, jnp.int32).at[rows, target].set(slot_s, mode="drop")
    return next_token, next_sibling
