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
from ddtree_jax.models.cache import KVCache, append_positions_and_mask, check_pass, tree_cache_mask, write_layer_rows
from ddtree_jax.models.layers import (
    apply_rope,
    axes_of,
    decoder_layer_shapes,
    init_from_shapes,
    layer_params,
    linear,
    restack_layers,
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


def _layer(config: Qwen3Config, p: dict, h, cos, sin, kv_update, mask, attn_impl, matmul_impl="xla", causal_start=None):
    """One decoder layer. kv_update(k, v) -> (keys, values) to attend (writes the cache if any); causal_start
    int32 [B] or None: the mask is causal at that offset (a prefill: `attention`'s causal kernel may run)."""
    c = config
    batch, steps, _ = h.shape
    x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
    q = linear(x, p["q_proj"], matmul_impl).reshape(batch, steps, c.num_heads, c.head_dim)
    k = linear(x, p["k_proj"], matmul_impl).reshape(batch, steps, c.num_kv_heads, c.head_dim)
    v = linear(x, p["v_proj"], matmul_impl).reshape(batch, steps, c.num_kv_heads, c.head_dim)
    q = apply_rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k, p["k_norm"], c.rms_norm_eps), cos, sin)
    keys, values = kv_update(k, v)
    out = attention(q, keys, values, mask, impl=attn_impl, causal_start=causal_start)
    out = out.reshape(batch, steps, c.num_heads * c.head_dim)
    h = h + linear(out, p["o_proj"], matmul_impl)
    x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
    return h + swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"], matmul_impl)


def _head(config: Qwen3Config, params: dict, h, matmul_impl: str = "xla") -> jax.Array:
    h = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    return linear(h, head(config, params), matmul_impl).astype(jnp.float32)


LAYER_LOOPS = ("scan", "unrolled")


def _run(
    config,
    params,
    tokens,
    positions,
    mask,
    cache,
    write_start,
    attn_impl,
    matmul_impl="xla",
    layer_loop: str = "unrolled",
    head_rows=None,
    causal_start=None,
):
    """Shared body: embeds, runs every layer, returns (logits f32, tapped [B, T, F*D], cache).
    head_rows int32 [B] (or None): the LM head runs only at that position of each row (logits [B, 1, V]).
    causal_start int32 [B] (or None): mask is causal at that offset (`_layer`).

    layer_loop "unrolled": a Python loop (one copy of the layer per layer in the program). "scan":
    `lax.scan` over the stacked layer parameters and the layer index (the program holds one layer).
    Both carry the full stacked cache.k / cache.v [L, B, S, H, D] and write layer l's new rows into
    them in place (`write_layer_rows`: one in-place write into the stack), then attend slice l (no layer slice
    copied out, written and put back).
    """
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    h = params["embed"][tokens]
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)

    taps = list(dict.fromkeys(config.tapped_layers))  # distinct tapped layers -> their slot in `tapped`
    tap_slot = jnp.asarray(
        [taps.index(layer) if layer in taps else len(taps) for layer in range(config.num_layers)], jnp.int32
    )  # untapped layers write the scratch slot len(taps)

    def step(carry, xs):  # carry (h, tapped, k_all, v_all) (no k / v without a cache); xs (layer params, index)
        p, layer = xs
        h, tapped, kv = carry[0], carry[1], list(carry[2:])

        def kv_update(k, v):
            if cache is None:
                return k, v
            attend = []
            for i, (full, new_rows) in enumerate(zip(kv, (k, v))):
                kv[i] = write_layer_rows(full, layer, new_rows, write_start)
                attend.append(jax.lax.dynamic_index_in_dim(kv[i], layer, 0, keepdims=False))
            return tuple(attend)

        h = _layer(config, p, h, cos, sin, kv_update, mask, attn_impl, matmul_impl, causal_start)
        tapped = jax.lax.dynamic_update_index_in_dim(tapped, h, tap_slot[layer], 0)
        return (h, tapped, *kv), None

    # the tapped layers' outputs [F + 1, B, T, D] ride in the carry (not an [L, B, T, D] per-layer output)
    carry = (h, jnp.zeros((len(taps) + 1,) + h.shape, h.dtype))
    carry += () if cache is None else (cache.k, cache.v)
    if layer_loop == "scan":
        layers = restack_layers(params["layers"])
        carry, _ = jax.lax.scan(step, carry, (layers, jnp.arange(config.num_layers, dtype=jnp.int32)))
    else:
        for layer in range(config.num_layers):
            carry, _ = step(carry, (layer_params(params["layers"], layer), layer))
    h, tapped = carry[0], carry[1]
    if cache is not None:
        cache = KVCache(carry[2], carry[3], cache.lengths)
    features = (
        jnp.concatenate([tapped[taps.index(layer)] for layer in config.tapped_layers], axis=-1)
        if taps
        else jnp.zeros(h.shape[:2] + (0,), h.dtype)
    )
    if head_rows is not None:
        h = jnp.take_along_axis(h, head_rows[:, None, None], axis=1)
    return _head(config, params, h, matmul_impl), features, cache


def forward_logits(
    config: Qwen3Config,
    params: dict,
    input_ids: jax.Array,
    *,
    attn_impl: str = "xla",
    matmul_impl: str = "xla",
    layer_loop: str = "unrolled",
) -> jax.Array:
    """Plain causal forward, no cache: input_ids int32 [B, T] -> logits float32 [B, T, V].

    layer_loop: "unrolled" (default; one copy of the layer per layer in the program) or "scan"
    (`lax.scan` over the stacked layers: the program holds one layer); see `_run`."""
    return forward_features(
        config, params, input_ids, attn_impl=attn_impl, matmul_impl=matmul_impl, layer_loop=layer_loop
    )[0]


def forward_features(
    config: Qwen3Config,
    params: dict,
    input_ids: jax.Array,
    *,
    attn_impl: str = "xla",
    matmul_impl: str = "xla",
    layer_loop: str = "unrolled",
):
    """Plain causal forward, no cache: (logits float32 [B, T, V], tapped hidden [B, T, F*D]) for
    input_ids int32 [B, T]; the tapped layers' outputs are what the DFlash drafter trains on.

    layer_loop: "unrolled" (default; one copy of the layer per layer in the program) or "scan"
    (`lax.scan` over the stacked layers: the program holds one layer); see `_run`."""
    steps = input_ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), input_ids.shape)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (input_ids.shape[0], steps, steps))
    logits, features, _ = _run(
        config, params, input_ids, positions, mask, None, None, attn_impl, matmul_impl, layer_loop
    )
    return logits, features


def prefill(
    config: Qwen3Config,
    params: dict,
    cache: KVCache,
    input_ids: jax.Array,
    num_new: jax.Array,
    *,
    attn_impl: str = "xla",
    matmul_impl: str = "xla",
    layer_loop: str = "unrolled",
    head_rows: jax.Array | None = None,
):
    """Causal pass over new tokens appended at each row's length.

    Args:
      input_ids: int32 [B, T], row b's first num_new[b] entries are real (the rest padding).
      num_new: int32 [B].
      layer_loop: "unrolled" (default; one copy of the layer per layer in the program) or "scan"
        (`lax.scan` over the stacked layers: the program holds one layer); both write the new rows
        into the stacked cache in place (see `_run`).
      head_rows: int32 [B] or None: the logits of only that position of each row (e.g. its last prompt
        token), so a long prompt never holds [B, T, V] logits.
    Returns:
      (logits float32 [B, T, V] ([B, 1, V] with head_rows), tapped hidden [B, T, F*D], cache with
      lengths += num_new).
    """
    batch, steps = input_ids.shape
    check_pass(cache, steps, num_new=num_new, token_ids=input_ids, vocab=config.vocab_size, head_rows=head_rows)
    start = cache.lengths
    positions, mask = append_positions_and_mask(cache, steps)  # causal over the committed prefix + new tokens
    logits, features, cache = _run(
        config,
        params,
        input_ids,
        positions,
        mask,
        cache,
        start,
        attn_impl,
        matmul_impl,
        layer_loop,
        head_rows,
        causal_start=start,
    )
    return logits, features, KVCache(cache.k, cache.v, start + num_new)


def tree_forward(
    config: Qwen3Config,
    params: dict,
    cache: KVCache,
    tokens: jax.Array,
    depths: jax.Array,
    tree_mask: jax.Array,
    *,
    attn_impl: str = "xla",
    matmul_impl: str = "xla",
    layer_loop: str = "unrolled",
):
    """The tree-verify pass: N slots at positions lengths + depth.

    Slot i's K/V are written at cache row lengths + i; slot i attends the committed prefix and the
    slots j with tree_mask[i, j] (itself and its ancestors). Lengths do not change (see `commit`).

    Args:
      tokens, depths: int32 [B, N] (a DraftTree's tokens and depths); tree_mask: bool [B, N, N].
      layer_loop: "unrolled" (default; one copy of the layer per layer in the program) or "scan"
        (`lax.scan` over the stacked layers: the program holds one layer); both write the tree K/V
        into the stacked cache in place (see `_run`).
    Returns:
      (logits float32 [B, N, V], tapped hidden [B, N, F*D], cache with the tree K/V written).
    """
    batch, slots = tokens.shape
    check_pass(cache, slots, token_ids=tokens, vocab=config.vocab_size, tree_mask=tree_mask)
    start = cache.lengths
    positions = start[:, None] + depths
    mask = tree_cache_mask(cache, tree_mask)
    return _run(config, params, tokens, positions, mask, cache, start, attn_impl, matmul_impl, layer_loop)


def embedding(params: dict) -> jax.Array:
    """[V, D] token embedding (shared with the DFlash drafter)."""
    return params["embed"]


def head(config: Qwen3Config, params: dict) -> jax.Array:
    """[V, D] LM head (the embedding when tied; shared with the DFlash drafter)."""
    return params["embed"] if config.tie_word_embeddings else params["lm_head"]


def create_cache(config: Qwen3Config, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)
