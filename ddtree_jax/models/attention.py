"""The one attention entry point of the models, with an `impl` switch: "xla"
(`ddtree_kernels.tree_attention.attention_reference`), "pallas" (`ddtree_kernels.tree_attention`:
flash-decoding over the cache, streaming only the keys a row can see; interpret mode off GPU) or "auto"
(`dispatch.attention_impl`)."""

from __future__ import annotations

from functools import partial

import jax

from ddtree_jax import dispatch
from ddtree_jax.dispatch import ATTENTION_IMPLS
from ddtree_jax.sharding.regions import heads, rows, shard_call
from ddtree_kernels.tree_attention import attention_reference, tree_attention

__all__ = ["ATTENTION_IMPLS", "attention", "sharded_tree_attention"]


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None, impl: str = "xla"
) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, Hq, Dk] queries; k: [B, S, Hkv, Dk] keys; v: [B, S, Hkv, Dv] values (Hq a multiple of Hkv).
      mask: bool [B, T, S], True where query t may attend key s. A row with no True entry yields zeros.
      scale: softmax scale (default 1 / sqrt(Dk)).
    Returns:
      [B, T, Hq, Dv] in q's dtype (softmax in float32; float32 inputs at float32).
    Head dims that are not powers of two fall back to "xla" under "pallas" (split keys into parts and call
    `ddtree_kernels.tree_attention` directly, as the absorbed MLA does).
    """
    if dispatch.attention_impl(impl, queries=q.shape[1]) == "pallas" and all(
        d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1])
    ):
        return sharded_tree_attention((q,), (k,), v, mask, scale=scale)
    return attention_reference(q, k, v, mask, scale=scale)


def sharded_tree_attention(q_parts, k_parts, v: jax.Array | None, mask: jax.Array, *, scale: float | None) -> jax.Array:
    """`ddtree_kernels.tree_attention`, per shard when a mesh is set (`sharding.regions`): batch over "data",
    query heads over "model" with their KV heads (a single shared KV head, MQA / absorbed MLA, is
    replicated). A kernel call XLA cannot partition would otherwise run whole on every device.
    v None: the values are key part 0 (absorbed MLA's latent)."""
    kv = heads(4) if k_parts[0].shape[2] > 1 else rows(4)
    if v is None:
        specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), rows(3))
        return shard_call(
            lambda q, k, m: tree_attention(q, k, None, m, scale=scale),
            (tuple(q_parts), tuple(k_parts), mask),
            specs,
            heads(4),
        )
    specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), kv, rows(3))
    return shard_call(partial(tree_attention, scale=scale), (tuple(q_parts), tuple(k_parts), v, mask), specs, heads(4))
