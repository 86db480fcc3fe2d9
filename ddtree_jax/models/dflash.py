"""The DFlash drafter: KV injection of fused target features, non-causal attention within a block.

One draft pass takes the block [bonus, MASK x (block_size - 1)] at positions ctx_len .. ctx_len +
block_size - 1 and returns the logits at block positions 1 .. block_size - 1: the L draft marginals
(same-position prediction). Every layer attends the cached context K/V (its own k_proj / v_proj of the
fused target features, appended per committed token) and the block's own K/V, which are discarded.
The drafter has no embedding or LM head: it uses the target's (frozen).

`train_logits` is the training-mode forward: many random-anchor blocks of one sequence in one pass,
each seeing the context strictly before its anchor (equal to `draft` run block by block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.config import DFlashConfig
from ddtree_jax.models.attention import attention
from ddtree_jax.models.cache import KVCache, check_pass, write_layer_rows
from ddtree_jax.models.layers import (
    apply_rope,
    axes_of,
    contract,
    decoder_layer_shapes,
    init_from_shapes,
    layer_params,
    linear,
    rms_norm,
    rope_cos_sin,
    stacked,
    swiglu,
)


def param_shapes(config: DFlashConfig, target_hidden: int) -> dict:
    """{name: (shape, logical axes)}; no embedding or head (the target's are used)."""
    c = config
    if target_hidden != c.hidden_size:
        raise ValueError(f"the drafter's hidden_size ({c.hidden_size}) must equal the target's ({target_hidden})")
    layer = decoder_layer_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    return {
        "fc": ((c.hidden_size, len(c.target_layers) * target_hidden), ("embed", "features")),
        "hidden_norm": ((c.hidden_size,), ("embed",)),
        "layers": stacked(layer, c.num_layers),
        "final_norm": ((c.hidden_size,), ("embed",)),
    }


def param_axes(config: DFlashConfig, target_hidden: int) -> dict:
    return axes_of(param_shapes(config, target_hidden))


def init_params(
    config: DFlashConfig, target_hidden: int, key: jax.Array, dtype=jnp.float32, norm_jitter: float = 0.0
) -> dict:
    return init_from_shapes(param_shapes(config, target_hidden), key, dtype, norm_jitter)


def create_context_cache(config: DFlashConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """Per-layer context K/V (capacity >= the longest sequence); lengths = context tokens per row."""
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)


def fuse_features(config: DFlashConfig, params: dict, features: jax.Array) -> jax.Array:
    """ctx = hidden_norm(fc(concat of the tapped target hidden states)): [B, T, F*D] -> [B, T, D]."""
    return rms_norm(linear(features, params["fc"]), params["hidden_norm"], config.rms_norm_eps)


def _rope(config: DFlashConfig, positions):
    """cos, sin [B, T, head_dim] in the half-split layout (default RoPE or YaRN)."""
    cos, sin = rope_cos_sin(positions, config.head_dim, config)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def _project_kv(config: DFlashConfig, p: dict, x, positions):
    batch, steps, _ = x.shape
    cos, sin = _rope(config, positions)
    k = linear(x, p["k_proj"]).reshape(batch, steps, config.num_kv_heads, config.head_dim)
    v = linear(x, p["v_proj"]).reshape(batch, steps, config.num_kv_heads, config.head_dim)
    return apply_rope(rms_norm(k, p["k_norm"], config.rms_norm_eps), cos, sin), v


def append_context(
    config: DFlashConfig, params: dict, cache: KVCache, features: jax.Array, num_new: jax.Array
) -> KVCache:
    """Appends committed tokens' context K/V: features [B, T, F*D] (row b's first num_new[b] real),
    at positions lengths .. lengths + T - 1. Returns the cache with lengths += num_new."""
    steps = features.shape[1]
    check_pass(cache, steps, num_new=num_new)
    positions = cache.lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    ctx = fuse_features(config, params, features)
    k_all, v_all = cache.k, cache.v
    for layer in range(config.num_layers):  # each layer's rows scattered into the stacks in place
        p = layer_params(params["layers"], layer)
        k, v = _project_kv(config, p, ctx, positions)
        k_all = write_layer_rows(k_all, layer, k, cache.lengths)
        v_all = write_layer_rows(v_all, layer, v, cache.lengths)
    return KVCache(k_all, v_all, cache.lengths + num_new)


def draft(
    config: DFlashConfig,
    params: dict,
    embed: jax.Array,
    lm_head: jax.Array,
    cache: KVCache,
    bonus: jax.Array,
    *,
    block_size: int | None = None,
    attn_impl: str = "xla",
    return_hidden: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """One draft pass: float32 draft logits [B, block_size - 1, V] for the tokens after `bonus` [B].

    embed [V, D] and lm_head [V, D] are the target's. `block_size` may be smaller than the drafter's
    (fewer masks, a shallower tree); the context cache is read, not written. return_hidden: also the
    final-normed hidden states [B, block_size - 1, D] the logits are read from (depth j at index j - 1; what
    a path-conditioned head, `models.child_head`, conditions on).
    """
    size = block_size or config.block_size
    if not 2 <= size <= config.block_size:
        raise ValueError(f"block_size must be in [2, {config.block_size}], got {size}")
    batch = bonus.shape[0]
    tokens = jnp.concatenate([bonus[:, None], jnp.full((batch, size - 1), config.mask_token_id, bonus.dtype)], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
    cos, sin = _rope(config, positions)
    context_rows = jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None]  # [B, 1, C]
    mask = jnp.concatenate(
        [jnp.broadcast_to(context_rows, (batch, size, cache.capacity)), jnp.ones((batch, size, size), bool)], axis=2
    )
    h = embed[tokens].astype(params["fc"].dtype)
    for layer in range(config.num_layers):
        p = layer_params(params["layers"], layer)
        x = rms_norm(h, p["input_norm"], config.rms_norm_eps)
        q = linear(x, p["q_proj"]).reshape(batch, size, config.num_heads, config.head_dim)
        q = apply_rope(rms_norm(q, p["q_norm"], config.rms_norm_eps), cos, sin)
        k, v = _project_kv(config, p, x, positions)
        keys = jnp.concatenate([cache.k[layer].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([cache.v[layer].astype(v.dtype), v], axis=1)
        out = attention(q, keys, values, mask, impl=attn_impl).reshape(batch, size, -1)
        h = h + linear(out, p["o_proj"])
        h = h + swiglu(rms_norm(h, p["post_norm"], config.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
    h = rms_norm(h[:, 1:], params["final_norm"], config.rms_norm_eps)
    logits = linear(h, lm_head).astype(jnp.float32)
    return (logits, h) if return_hidden else logits


def train_logits(
    config: DFlashConfig,
    params: dict,
    embed: jax.Array,
    lm_head: jax.Array,
    features: jax.Array,
    tokens: jax.Array,
    anchors: jax.Array,
    return_hidden: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The training forward: many independent draft blocks per sequence in one pass (DFlash's recipe).

    Args:
      features: [B, T, F*D] the target's tapped hidden states over the whole sequence `tokens` int [B, T].
      anchors: int32 [B, N], each in [0, T - block_size]. Block n of row b is [tokens[b, a], MASK x
        (block_size - 1)] at positions a .. a + block_size - 1 (a = anchors[b, n]). It attends the context
        K/V of positions strictly before a (never the target's features at or after its anchor, nor any
        token after it) and, bidirectionally, its own block; blocks do not see each other.
    Returns:
      float32 [B, N, block_size - 1, V]: block n's logits at block positions 1 .. block_size - 1, i.e.
      what `draft` returns after `append_context` of features[:, :a] with bonus tokens[:, a]; with
      return_hidden, also the final-normed hidden states [B, N, block_size - 1, D] they are read from.
    """
    c = config
    size = c.block_size
    batch, steps = tokens.shape
    blocks = anchors.shape[1]
    ctx = fuse_features(config, params, features)
    ctx_positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
    positions = (anchors[:, :, None] + jnp.arange(size, dtype=jnp.int32)).reshape(batch, blocks * size)
    first = jnp.take_along_axis(tokens, anchors, axis=1)[:, :, None]
    block_tokens = jnp.concatenate([first, jnp.full((batch, blocks, size - 1), c.mask_token_id, tokens.dtype)], axis=2)
    h = embed[block_tokens.reshape(batch, blocks * size)].astype(params["fc"].dtype)
    cos, sin = _rope(config, positions)
    visible = jnp.arange(steps)[None, None, :] < anchors[:, :, None]  # [B, N, T]: context strictly before the anchor
    for layer in range(c.num_layers):
        p = layer_params(params["layers"], layer)
        x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
        q = linear(x, p["q_proj"]).reshape(batch, blocks * size, c.num_heads, c.head_dim)
        q = apply_rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), cos, sin)
        k, v = _project_kv(config, p, x, positions)
        k_ctx, v_ctx = _project_kv(config, p, ctx, ctx_positions)
        split = lambda a: a.reshape(batch, blocks, size, *a.shape[2:])  # noqa: E731
        out = _block_attention(split(q), k_ctx, v_ctx, split(k), split(v), visible)
        h = h + linear(out.reshape(batch, blocks * size, -1), p["o_proj"])
        h = h + swiglu(rms_norm(h, p["post_norm"], c.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
    h = rms_norm(h.reshape(batch, blocks, size, -1)[:, :, 1:], params["final_norm"], c.rms_norm_eps)
    logits = linear(h, lm_head).astype(jnp.float32)
    return (logits, h) if return_hidden else logits


def _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, visible):
    """Attention of N blocks over the shared context keys and their own keys, without copying the
    context per block: q [B, N, S, Hq, Dh]; k_ctx / v_ctx [B, T, Hkv, Dh]; k_blk / v_blk [B, N, S, Hkv, Dh];
    visible bool [B, N, T]. Softmax in float32 over the visible context keys and all S block keys (as
    `attention` computes it on the concatenated keys). Returns [B, N, S, Hq, Dh] in q's dtype."""
    batch, blocks, size, q_heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]
    qg = q.reshape(batch, blocks, size, kv_heads, q_heads // kv_heads, head_dim)
    scale = head_dim**-0.5
    s_ctx = contract("bnskgd,btkd->bnkgst", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = contract("bnskgd,bnrkd->bnkgsr", qg, k_blk, preferred_element_type=jnp.float32) * scale
    row_max = jnp.maximum(jnp.max(s_ctx, axis=-1, keepdims=True), jnp.max(s_blk, axis=-1, keepdims=True))  # finite
    w_ctx, w_blk = jnp.exp(s_ctx - row_max), jnp.exp(s_blk - row_max)
    denom = w_ctx.sum(axis=-1, keepdims=True) + w_blk.sum(axis=-1, keepdims=True)
    out = contract(
        "bnkgst,btkd->bnskgd", (w_ctx / denom).astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32
    )
    out = out + contract(
        "bnkgsr,bnrkd->bnskgd", (w_blk / denom).astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
    )
    return out.reshape(batch, blocks, size, q_heads, head_dim).astype(q.dtype)
