"""Contiguous per-row KV caches and the commit that moves accepted tree slots into place.

Layout: k, v [layers, B, S_max, kv_heads, head_dim]; lengths int32 [B] = committed tokens per row.
Entries at positions >= lengths[b] are scratch (tree slots of the current step, stale data) and are
never attended: every mask is built from `lengths`. `commit` is the one place lengths advance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @classmethod
    def create(
        cls, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16
    ) -> KVCache:
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @staticmethod
    def logical_axes() -> dict:
        return {"k": CACHE_AXES, "v": CACHE_AXES, "lengths": ("batch",)}


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "lengths"], meta_fields=[])


def check_room(cache: KVCache, steps: int) -> None:
    """Eager guard (skipped under jit): rows lengths .. lengths + steps - 1 must fit in the cache.

    A write past the end would be clamped by dynamic_update_slice onto committed rows, so callers
    size the cache for prompt + new tokens + one tree (the engine does) and eager callers get an error.
    """
    if isinstance(cache.lengths, jax.core.Tracer):
        return
    need = int(jnp.max(cache.lengths)) + steps
    if need > cache.capacity:
        raise ValueError(f"KV cache too small: a row needs {need} rows, capacity is {cache.capacity}")


def _concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays if a is not None)


def check_pass(
    cache: KVCache,
    steps: int,
    *,
    num_new=None,
    token_ids=None,
    vocab: int | None = None,
    head_rows=None,
    tree_mask=None,
) -> None:
    """Checks of a model pass over `steps` new rows a batch row (prefill, append_context, tree_forward): the shapes
    always, the values eagerly only (skipped where traced: under jit the engine has checked the request): the room
    (`check_room`), lengths >= 0, num_new in [0, steps] (rows past it would count as committed), token ids in
    [0, vocab) (an embedding lookup clamps, giving another token's row), head_rows in [0, steps), a tree mask of
    shape [B, steps, steps]. ValueError naming the value."""
    check_room(cache, steps)
    batch = cache.lengths.shape[0]
    if _concrete(cache.lengths) and (np.asarray(cache.lengths) < 0).any():
        raise ValueError(f"cache lengths must be >= 0, got {np.asarray(cache.lengths).tolist()}")
    for name, value, low, high in (("num_new", num_new, 0, steps), ("head_rows", head_rows, 0, steps - 1)):
        if value is None:
            continue
        if jnp.shape(value) != (batch,):
            raise ValueError(f"{name} must have shape [B] = ({batch},), got {jnp.shape(value)}")
        if _concrete(value) and ((np.asarray(value) < low) | (np.asarray(value) > high)).any():
            raise ValueError(f"{name} must lie in [{low}, {high}], got {np.asarray(value).tolist()}")
    if token_ids is not None and vocab is not None and _concrete(token_ids):
        ids = np.asarray(token_ids)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"token id {int(ids[row, col])} at [{row}, {col}] is outside the vocabulary [0, {vocab})")
    if tree_mask is not None and tuple(jnp.shape(tree_mask)) != (batch, steps, steps):
        raise ValueError(
            f"tree_mask must be [B, N, N] = ({batch}, {steps}, {steps}), got {tuple(jnp.shape(tree_mask))}"
        )


def append_positions_and_mask(cache: KVCache, steps: int) -> tuple[jax.Array, jax.Array]:
    """A causal pass of `steps` new tokens appended at each row's length: (positions int32 [B, T] = lengths + t,
    mask bool [B, T, S_max]: new token t sees the cache rows up to its own position, i.e. the committed prefix and
    the new tokens up to itself)."""
    positions = cache.lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    rows = jnp.arange(cache.capacity, dtype=jnp.int32)
    return positions, rows[None, None, :] <= positions[:, :, None]


def tree_cache_mask(cache: KVCache, tree_mask: jax.Array) -> jax.Array:
    """bool [B, N, S_max]: the tree-verify pass's mask over the cache rows, with slot i written at row lengths + i.
    Slot i sees the committed prefix and the slots j with tree_mask[i, j] (bool [B, N, N]: itself and its
    ancestors); nothing past the tree window."""
    slots = tree_mask.shape[-1]
    rel = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :] - cache.lengths[:, None, None]
    tree_part = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, slots - 1).repeat(slots, axis=1), axis=2)
    return (rel < 0) | ((rel < slots) & tree_part)


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [B, S, ...] with new [B, T, ...] written at rows start[b] .. start[b] + T - 1."""

    def one(buf, upd, s):
        return jax.lax.dynamic_update_slice_in_dim(buf, upd.astype(buf.dtype), s, axis=0)

    return jax.vmap(one)(buffer, new, start)


def write_layer_rows(stack: jax.Array, layer, new: jax.Array, start: jax.Array) -> jax.Array:
    """stack [L, B, S, ...] with new [B, T, ...] written into layer `layer` at rows start[b] .. start[b] + T - 1,
    in place (no slice of the layer copied out and written back). Callers check room first (`check_room`) and
    pass a layer in [-L, L): out of range, B = 1 clamps as `write_rows`' dynamic_update_slice does (a write
    past S shifted back onto the last T rows, a layer past the stack onto its last layer), B > 1 drops the
    rows past S (and a layer past the stack).

    B = 1: one dynamic_update_slice. A scatter there (one index) becomes XLA's bounds-checked form: the old
    row read out, then selected against the new one and written back (one H200 step: two kernels a cache a
    layer instead of one). B > 1: one scatter."""
    batch, steps = new.shape[:2]
    if batch == 1:
        layer = jnp.asarray(layer, jnp.int32)
        layer = jnp.where(layer < 0, layer + stack.shape[0], layer)  # negative from the end, as the scatter reads it
        index = (layer, jnp.int32(0), start[0].astype(jnp.int32))
        index += (jnp.int32(0),) * (stack.ndim - 3)
        return lax.dynamic_update_slice(stack, new[None].astype(stack.dtype), index)
    rows = start[:, None] + jnp.arange(steps, dtype=start.dtype)[None, :]  # [B, T]
    batch_index = jnp.broadcast_to(jnp.arange(batch, dtype=start.dtype)[:, None], (batch, steps))
    return stack.at[layer, batch_index, rows].set(new.astype(stack.dtype), mode="drop")


def _check_commit(cache: KVCache, accept_index, num_accepted) -> None:
    """`commit`'s eager checks (numpy; skipped when any input is traced)."""
    if any(isinstance(a, jax.core.Tracer) for a in (cache.lengths, accept_index, num_accepted)):
        return
    index, accepted, lengths = (np.asarray(a) for a in (accept_index, num_accepted, cache.lengths))
    steps = index.shape[1]
    for row in range(index.shape[0]):
        n = int(accepted[row])
        if not -1 <= n < steps:
            raise ValueError(
                f"num_accepted[{row}] = {n} is outside [-1, {steps}) (-1: commit nothing; accept_index has {steps} "
                "columns)"
            )
        kept = index[row, : n + 1]
        if n >= 0 and (kept[0] != 0 or (kept < 0).any() or (np.diff(kept) <= 0).any()):
            raise ValueError(
                f"accept_index[{row}, :{n + 1}] = {kept.tolist()}: the accepted slots must start at the root (0) and "
                "increase"
            )
        if int(lengths[row]) + n + 1 > cache.capacity:
            raise ValueError(
                f"row {row}: length {int(lengths[row])} + {n + 1} committed rows passes the cache's capacity "
                f"{cache.capacity}"
            )


def commit(cache: KVCache, accept_index: jax.Array, num_accepted: jax.Array) -> KVCache:
    """Moves the accepted tree slots down and advances the lengths.

    The N tree slots of the last tree forward sit at cache rows lengths .. lengths + N - 1 (slot i at row
    lengths + i). Accepted slots accept_index[0..n] (root first, increasing) move to rows
    lengths .. lengths + n, in place; rows past that are left as scratch. Returns the cache with
    lengths += num_accepted + 1 (the root / bonus token and the accepted draft tokens).

    accept_index: int32 [B, S] (-1 past the end, never gathered); num_accepted: int32 [B] (-1: the row commits
    nothing, its length unchanged: a finished row of the engine's step).
    Eagerly (skipped under jit) a ValueError names a row whose num_accepted is outside [-1, S), whose accepted
    slots are not increasing indices >= 0 (root 0 first), or whose new length would pass the cache's capacity.
    """
    _check_commit(cache, accept_index, num_accepted)
    batch, steps = accept_index.shape
    keep = jnp.arange(steps)[None, :] <= num_accepted[:, None]  # [B, S]
    rows = jnp.arange(batch)[:, None]  # [B, 1]
    start = cache.lengths[:, None]

    def move(buffer):  # [layers, B, S_max, ...]
        source = start + jnp.where(keep, accept_index, 0)  # [B, S]
        target = jnp.where(keep, start + jnp.arange(steps)[None, :], buffer.shape[2])  # out of range: dropped
        # The accepted rows are gathered first into their own small array [layers, B, S, ...], behind a barrier
        # so that XLA cannot fuse the read into the scatter: a scatter that reads the buffer it writes (the
        # rows move within it) made XLA copy the whole cache before it, and again after (4 cache-sized copies
        # a DDTree step in the H200 HLO at 2bd1060); from its own array the scatter writes in place.
        moved = lax.optimization_barrier(buffer[:, rows, source])
        return buffer.at[:, rows, target].set(moved, mode="drop")

    return KVCache(move(cache.k), move(cache.v), cache.lengths + num_accepted + 1)


def gather_accepted(values: jax.Array, accept_index: jax.Array, num_accepted: jax.Array) -> jax.Array:
    """values [B, N, ...] at the accepted slots -> [B, S, ...], zero past num_accepted (never
    gathered with -1). Used for the drafter's new context features (the tapped target hidden states)."""
    steps = accept_index.shape[1]
    keep = jnp.arange(steps)[None, :] <= num_accepted[:, None]
    picked = jnp.take_along_axis(
        values, jnp.where(keep, accept_index, 0).reshape(keep.shape + (1,) * (values.ndim - 2)), axis=1
    )
    return jnp.where(keep.reshape(keep.shape + (1,) * (values.ndim - 2)), picked, 0)
