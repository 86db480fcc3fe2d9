"""Structures derived from a `DraftTree`, all jit-friendly: positions, the ancestor mask, and the
first-child / next-sibling lists that give the verifier its sibling order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax.options import ORDER_POLICIES
from ddtree_jax.tree.draft_tree import DraftTree

__all__ = ["ORDER_POLICIES", "ancestor_mask", "positions", "verification_order"]


_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_tree(tree, fn: str) -> None:
    """ValueError unless `tree` is a DraftTree (a plain array has no parents / depths to read); works under jit."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"{fn} takes a DraftTree (from build_tree / build_chain), got {type(tree).__name__}")


def _check_start(tree: DraftTree, start) -> None:
    """Eager check of a concrete `start` (skipped when traced): integers, a scalar or shape [B], >= 0, and
    start + L (the tree's depth limit) within int32. ValueError naming the bad row and value."""
    if isinstance(start, jax.core.Tracer):
        return
    values = np.asarray(start)
    if values.dtype == object and values.ndim == 0 and isinstance(start, int):  # beyond int64: a Python int
        values = np.asarray(min(max(start, -1), _INT32_MAX), np.int64)  # out of bounds either way, named below
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"start must be integers (each row's cache length), got {values.dtype} {start!r}")
    batch = tree.batch_size
    if values.ndim != 0 and values.shape != (batch,):
        raise ValueError(f"start must be a scalar or have shape [B] = ({batch},), got shape {values.shape}")
    flat = values.reshape(-1)
    highest = _INT32_MAX - tree.max_depth  # the deepest slot's position, start + L, must fit int32
    for bad, why in (
        (flat < 0, "negative"),
        (flat > highest, f"too large: start + L (the depth limit, {tree.max_depth}) must be <= {_INT32_MAX}"),
    ):
        if bad.any():
            row = int(np.argmax(bad))
            where = "start" if values.ndim == 0 else f"start[{row}]"
            shown = start if values.ndim == 0 and isinstance(start, int) else int(flat[row])
            raise ValueError(f"{where} = {shown} is {why}")


def positions(tree: DraftTree, start: jax.Array) -> jax.Array:
    """int32 [B, N]: sequence position of each slot, start[b] + depth (siblings share a position).

    start: integers [B] (the row's cache length) or a scalar (every row), >= 0, with start + L (the tree's
    depth limit, `tree.max_depth`) within int32. Eagerly a bad start raises ValueError naming the row; a
    traced start (under jit) cannot be read and is not checked: the caller must keep to the same bounds, else
    the positions are negative or wrap around int32 (nothing marks such a row).
    """
    _check_tree(tree, "positions")
    _check_start(tree, start)
    start = jnp.asarray(start, jnp.int32)
    return jnp.reshape(start, (-1, 1)) + tree.depths


def ancestor_mask(tree: DraftTree) -> jax.Array:
    """bool [B, N, N]: mask[b, i, j] = slot j is slot i or an ancestor of i (padding rows: self only)."""
    _check_tree(tree, "ancestor_mask")
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
    _check_tree(tree, "verification_order")
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
