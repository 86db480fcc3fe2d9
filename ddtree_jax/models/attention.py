"""The one attention entry point of the models, with an `impl` switch: "xla" (the plain reference
below), "pallas" (`kernels.tree_attention`: flash-decoding over the cache, streaming only the keys a
row can see; interpret mode off GPU) or "auto" (by measurement, `resolve_attention_impl`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("xla", "pallas", "auto")
# "auto" on GPU, from benchmarks/bench_attention.py on one H200 (BENCHMARKS.md, commit a67bcf3): the kernel
# beats XLA 1.9-2.3x for GQA with N = 17 tree queries (contexts 8k-128k), ties at N = 65 (0.94-0.99x)
# and loses on absorbed MLA (0.2-0.7x, Triton reaches 30-56 TFLOP/s there); so "auto" takes it for GQA
# with at most AUTO_PALLAS_MAX_QUERIES queries per row and XLA for MLA and longer blocks (prefill).
AUTO_PALLAS_MAX_QUERIES = 32


def resolve_attention_impl(impl: str, *, queries: int | None = None, mla: bool = False,
                           backend: str | None = None) -> str:
    """"xla" or "pallas" for a call with `queries` query positions per row (None: a decode / verify
    step) of a GQA (mla=False) or absorbed-MLA layer; "auto" is xla off GPU. `backend`: the platform to
    resolve for (None: `jax.default_backend()`; the memory planner passes "gpu")."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        if (backend or jax.default_backend()) != "gpu" or mla:
            return "xla"
        return "pallas" if queries is None or queries <= AUTO_PALLAS_MAX_QUERIES else "xla"
    return impl


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
              impl: str = "xla") -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, Hq, Dk] queries; k: [B, S, Hkv, Dk] keys; v: [B, S, Hkv, Dv] values (Hq a multiple of Hkv).
      mask: bool [B, T, S], True where query t may attend key s. A row with no True entry yields zeros.
      scale: softmax scale (default 1 / sqrt(Dk)).
    Returns:
      [B, T, Hq, Dv] in q's dtype (softmax in float32).
    Head dims that are not powers of two fall back to "xla" under "pallas" (split keys into parts and call
    `kernels.tree_attention` directly, as the absorbed MLA does).
    """
    if resolve_attention_impl(impl, queries=q.shape[1]) == "pallas" and all(d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1])):
        return sharded_tree_attention((q,), (k,), v, mask, scale=scale)
    batch, steps, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    qg = q.reshape(batch, steps, kv_heads, group, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = weights / jnp.maximum(weights.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, steps, q_heads, v.shape[-1]).astype(q.dtype)


def sharded_tree_attention(q_parts, k_parts, v: jax.Array | None, mask: jax.Array, *, scale: float | None) -> jax.Array:
    """`kernels.tree_attention`, per shard when a mesh is set (`sharding.regions`): batch over "data",
    query heads over "model" with their KV heads (a single shared KV head, MQA / absorbed MLA, is
    replicated). A kernel call XLA cannot partition would otherwise run whole on every device.
    v None: the values are key part 0 (absorbed MLA's latent)."""
    from functools import partial

    from kernels.tree_attention import tree_attention
    from ddtree_jax.sharding.regions import heads, rows, shard_call

    kv = heads(4) if k_parts[0].shape[2] > 1 else rows(4)
    if v is None:
        specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), rows(3))
        return shard_call(lambda q, k, m: tree_attention(q, k, None, m, scale=scale), (tuple(q_parts), tuple(k_parts), mask),
                          specs, heads(4))
    specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), kv, rows(3))
    return shard_call(partial(tree_attention, scale=scale), (tuple(q_parts), tuple(k_parts), v, mask), specs, heads(4))
