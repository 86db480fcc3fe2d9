"""Coins: the uniform variates every sampler and verifier consumes.

Each row's coins come from its own key (fold in a request id), so a row's result never depends on
what else is in the batch. Coins lie in [tiny, 1 - 2^-24]: never exactly 0 or 1 (a coin of 0 would accept a token of probability 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

COIN_MIN = float(jnp.finfo(jnp.float32).tiny)
COIN_MAX = 1.0 - 2.0**-24


def row_keys(key: jax.Array, request_ids: jax.Array) -> jax.Array:
    """keys [B]: fold_in(key, request_id) per row.

    request_ids must lie in [0, 2^32) (they are folded in as uint32; larger or negative ids would wrap
    and collide): concrete ids outside it raise ValueError; traced ids are not checked."""
    if not isinstance(request_ids, jax.core.Tracer):
        ids = np.asarray(request_ids)
        if ids.dtype.kind not in "iub":
            raise ValueError(f"request_ids must be integers in [0, 2^32), got dtype {ids.dtype}")
        bad = (ids.astype(object) < 0) | (ids.astype(object) >= 2**32) if ids.size else np.zeros(ids.shape, bool)
        if np.any(bad):
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"request_ids{list(index)} = {ids[index].item()} is outside [0, 2^32): it would wrap modulo 2^32"
            )
    return jax.vmap(lambda rid: jax.random.fold_in(key, rid))(jnp.asarray(request_ids, jnp.uint32))


def draw_coins(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 coins of `shape` in [COIN_MIN, COIN_MAX].

    key: a single key, or keys [B] (one per row), in which case the result is [B, *shape] and row b
    uses only keys[b].
    """
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise ValueError(f"key must be a typed PRNG key (jax.random.key) or an array of them, got dtype {key.dtype}")
    draw = lambda k: jnp.clip(jax.random.uniform(k, shape, jnp.float32), COIN_MIN, COIN_MAX)  # noqa: E731
    if key.ndim == 0:
        return draw(key)
    return jax.vmap(draw)(key)
