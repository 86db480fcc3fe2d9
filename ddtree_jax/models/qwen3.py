"""The Qwen3 dense target: parameters, a plain causal forward, and the cached prefill / verify passes.

Parameters are a dict pytree with layers stacked on a leading axis; `param_axes` gives the logical
axis names of every array (one rule table maps them to mesh axes). HF tensor names map 1:1 (see
`ddtree_jax.checkpoint`). Weights are [out, in] as in HF.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.config import Qwen3Config
from ddtree_jax.models.attention import attention
from ddtree_jax.models.cache import KVCache, check_room, write_rows
from ddtree_jax.models.layers import (
    apply_rope,
    axes_of,
    decoder_layer_shapes,
    init_from_shapes,
    linear,
    rms_norm,
    rope_tables,
    stacked,
    swiglu,
)


def param_shapes(config: Qwen3Config) -> dict:
    """{name: (shape, logical axes)} for every parameter; layer weights carry a leading "layers" axis."""
    c = config
    layer = decoder_layer_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    shapes = {
        "embed": ((c.vocab_size, c.hidden_size), ("vocab", "embed")),
        "layers": stacked(layer, c.num_layers),
        "final_norm": ((c.hidden_size,), ("embed",)),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((c.vocab_size, c.hidden_size), ("vocab", "embed"))
    return shapes


def param_axes(config: Qwen3Config) -> dict:
    """The logical axis names of every parameter (same tree as the params)."""
    return axes_of(param_shapes(config))


def init_params(config: Qwen3Config, key: jax.Array, dtype=jnp.float32, norm_jitter: float = 0.0) -> dict:
    """Random parameters (normal(0, 0.02) matrices; norms 1, or 1 + jitter * normal for tests)."""
    return init_from_shapes(param_shapes(config), key, dtype, norm_jitter)


def _layer(config: Qwen3Config, p: dict, h, cos, sin, kv_update, mask, attn_impl, matmul_impl="xla"):
    """One decoder layer. kv_update(k, v) -> (keys, values) to attend (writes the cache if any)."""
    c = config
    batch, steps, _ = h.shape
    x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
    q = linear(x, p["q_proj"], matmul_impl).reshape(batch, steps, c.num_heads, c.head_dim)
    k = linear(x, p["k_proj"], matmul_impl).reshape(batch, steps, c.num_kv_heads, c.head_dim)
    v = linear(x, p["v_proj"], matmul_impl).reshape(batch, steps, c.num_kv_heads, c.head_dim)
    q = apply_rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k, p["k_norm"], c.rms_norm_eps), cos, sin)
    keys, values = kv_update(k, v)
    out = attention(q, keys, values, mask, impl=attn_impl).reshape(batch, steps, c.num_heads * c.head_dim)
    h = h + linear(out, p["o_proj"], matmul_impl)
    x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
    return h + swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"], matmul_impl)


def _head(config: Qwen3Config, params: dict, h, matmul_impl: str = "xla") -> jax.Array:
    h = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    return linear(h, head(config, params), matmul_impl).astype(jnp.float32)


def _run(config, params, tokens, positions, mask, cache, write_start, attn_impl, matmul_impl="xla"):
    """Shared body: embeds, runs every layer (unrolled), returns (logits f32, tapped [B, T, F*D], cache)."""
    h = params["embed"][tokens]
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
    tapped = []
    new_k, new_v = [], []
    for layer in range(config.num_layers):
        p = jax.tree.map(lambda w: w[layer], params["layers"])
        if cache is None:
            kv_update = lambda k, v: (k, v)  # noqa: E731
        else:
            def kv_update(k, v, layer=layer):
                ck = write_rows(cache.k[layer], k, write_start)
                cv = write_rows(cache.v[layer], v, write_start)
                new_k.append(ck)
                new_v.append(cv)
                return ck, cv
        h = _layer(config, p, h, cos, sin, kv_update, mask, attn_impl, matmul_impl)
        if layer in config.tapped_layers:
            tapped.append(h)
    if cache is not None:
        cache = KVCache(jnp.stack(new_k), jnp.stack(new_v), cache.lengths)
    features = jnp.concatenate(tapped, axis=-1) if tapped else jnp.zeros(h.shape[:2] + (0,), h.dtype)
    return _head(config, params, h, matmul_impl), features, cache


def forward_logits(config: Qwen3Config, params: dict, input_ids: jax.Array, *, attn_impl: str = "xla",
                   matmul_impl: str = "xla") -> jax.Array:
    """Plain causal forward, no cache: input_ids int32 [B, T] -> logits float32 [B, T, V]."""
    return forward_features(config, params, input_ids, attn_impl=attn_impl, matmul_impl=matmul_impl)[0]


def forward_features(config: Qwen3Config, params: dict, input_ids: jax.Array, *, attn_impl: str = "xla",
                     matmul_impl: str = "xla"):
    """Plain causal forward, no cache: (logits float32 [B, T, V], tapped hidden [B, T, F*D]) for
    input_ids int32 [B, T]; the tapped layers' outputs are what the DFlash drafter trains on."""
    steps = input_ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), input_ids.shape)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (input_ids.shape[0], steps, steps))
    logits, features, _ = _run(config, params, input_ids, positions, mask, None, None, attn_impl, matmul_impl)
    return logits, features


def prefill(config: Qwen3Config, params: dict, cache: KVCache, input_ids: jax.Array, num_new: jax.Array, *, attn_impl: str = "xla",
            matmul_impl: str = "xla"):
    """Causal pass over new tokens appended at each row's length.

    Args:
      input_ids: int32 [B, T], row b's first num_new[b] entries are real (the rest padding).
      num_new: int32 [B].
    Returns:
      (logits float32 [B, T, V], tapped hidden [B, T, F*D], cache with lengths += num_new).
    """
    batch, steps = input_ids.shape
    check_room(cache, steps)
    start = cache.lengths
    positions = start[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    rows = jnp.arange(cache.capacity, dtype=jnp.int32)
    mask = rows[None, None, :] <= positions[:, :, None]  # causal over the committed prefix + new tokens
    logits, features, cache = _run(config, params, input_ids, positions, mask, cache, start, attn_impl, matmul_impl)
    return logits, features, KVCache(cache.k, cache.v, start + num_new)


def verify(config: Qwen3Config, params: dict, cache: KVCache, tokens: jax.Array, depths: jax.Array, tree_mask: jax.Array, *,
           attn_impl: str = "xla", matmul_impl: str = "xla"):
    """The tree-verify pass: N slots at positions lengths + depth.

    Slot i's K/V are written at cache row lengths + i; slot i attends the committed prefix and the
    slots j with tree_mask[i, j] (itself and its ancestors). Lengths do not change (see `commit`).

    Args:
      tokens, depths: int32 [B, N] (a DraftTree's tokens and depths); tree_mask: bool [B, N, N].
    Returns:
      (logits float32 [B, N, V], tapped hidden [B, N, F*D], cache with the tree K/V written).
    """
    batch, slots = tokens.shape
    check_room(cache, slots)
    start = cache.lengths
    positions = start[:, None] + depths
    rows = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :]
    rel = rows - start[:, None, None]  # row index relative to the tree window
    in_tree = (rel >= 0) & (rel < slots)
    tree_part = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, slots - 1).repeat(slots, axis=1), axis=2)
    mask = (rel < 0) | (in_tree & tree_part)
    return _run(config, params, tokens, positions, mask, cache, start, attn_impl, matmul_impl)


def embedding(params: dict) -> jax.Array:
    """[V, D] token embedding (shared with the DFlash drafter)."""
    return params["embed"]


def head(config: Qwen3Config, params: dict) -> jax.Array:
    """[V, D] LM head (the embedding when tied; shared with the DFlash drafter)."""
    return params["embed"] if config.tie_word_embeddings else params["lm_head"]


def create_cache(config: Qwen3Config, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)
