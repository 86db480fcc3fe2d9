"""DFlash drafter: the cached implementation against a plain statement of the paper's equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import DFlashConfig
from ddtree_jax.models import dflash

D, V = 32, 53
CONFIG = DFlashConfig(
    hidden_size=D,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    block_size=5,
    mask_token_id=V - 1,
    target_layers=(0, 2, 3),
    rope_theta=10_000.0,
)


def _np(x):
    return np.asarray(x, np.float64)


def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta=10_000.0):
    """x [T, H, Dh], pos [T]: rotate_half RoPE."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
    return x * cos + rot * sin


def draft_reference(params, embed, head, features, bonus):
    """One row, no cache: ctx = hidden_norm(fc(features)) for all C context tokens (positions 0..C-1),
    block [bonus, MASK...] at C..C+bs-1; each layer: Q = q_norm(q_proj(x_block)), K = k_norm(k_proj([ctx; x_block]))
    and V = v_proj([ctx; x_block]) with RoPE on Q, K; softmax over all C + bs keys (non-causal); residual
    MLP; logits of block positions 1.. through final_norm and the target's head."""
    p = jax.tree.map(_np, params)
    c = CONFIG
    ctx = _rms(_np(features) @ p["fc"].T, p["hidden_norm"])
    n_ctx = ctx.shape[0]
    tokens = np.array([bonus] + [c.mask_token_id] * (c.block_size - 1))
    h = _np(embed)[tokens]
    pos_ctx, pos_blk = np.arange(n_ctx), n_ctx + np.arange(c.block_size)
    group = c.num_heads // c.num_kv_heads
    for l in range(c.num_layers):
        w = {k: v[l] for k, v in p["layers"].items()}
        x = _rms(h, w["input_norm"])
        q = _rope(_rms((x @ w["q_proj"].T).reshape(-1, c.num_heads, c.head_dim), w["q_norm"]), pos_blk)
        src = np.concatenate([ctx, x])
        k = _rope(
            _rms((src @ w["k_proj"].T).reshape(-1, c.num_kv_heads, c.head_dim), w["k_norm"]),
            np.concatenate([pos_ctx, pos_blk]),
        )
        v = (src @ w["v_proj"].T).reshape(-1, c.num_kv_heads, c.head_dim)
        out = np.zeros_like(q)
        for hq in range(c.num_heads):
            s = q[:, hq] @ k[:, hq // group].T / np.sqrt(c.head_dim)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hq] = (s / s.sum(-1, keepdims=True)) @ v[:, hq // group]
        h = h + out.reshape(c.block_size, -1) @ w["o_proj"].T
        y = _rms(h, w["post_norm"])
        g = y @ w["gate_proj"].T
        h = h + ((g / (1 + np.exp(-g))) * (y @ w["up_proj"].T)) @ w["down_proj"].T
    return _rms(h[1:], p["final_norm"]) @ _np(head).T


def test_cached_drafter_matches_the_equations():
    key = jax.random.split(jax.random.key(0), 4)
    params = dflash.init_params(CONFIG, D, key[0], norm_jitter=0.2)
    embed = jax.random.normal(key[1], (V, D))
    head = jax.random.normal(key[2], (V, D)) * 0.3
    rng = np.random.default_rng(1)
    lengths = np.array([7, 3, 0])
    features = rng.standard_normal((3, 8, len(CONFIG.target_layers) * D)).astype(np.float32)
    cache = dflash.create_context_cache(CONFIG, 3, 16, jnp.float32)
    first = np.minimum(lengths, 4)  # append the context in two uneven chunks
    cache = dflash.append_context(CONFIG, params, cache, jnp.asarray(features[:, :4]), jnp.asarray(first, jnp.int32))
    rest = np.zeros_like(features[:, :4])
    for b in range(3):
        rest[b, : lengths[b] - first[b]] = features[b, first[b] : lengths[b]]
    cache = dflash.append_context(CONFIG, params, cache, jnp.asarray(rest), jnp.asarray(lengths - first, jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    bonus = jnp.array([5, 17, 40], jnp.int32)
    logits = np.asarray(dflash.draft(CONFIG, params, embed, head, cache, bonus))
    assert logits.shape == (3, CONFIG.block_size - 1, V)
    for b in range(3):
        ref = draft_reference(params, embed, head, features[b, : lengths[b]], int(bonus[b]))
        err = np.max(np.abs(logits[b] - ref)) / np.max(np.abs(ref))
        assert err < 1e-4, (b, err)
    # a smaller block is a different query (the masks attend each other), checked for shape and finiteness
    short = dflash.draft(CONFIG, params, embed, head, cache, bonus, block_size=3)
    assert short.shape == (3, 2, V) and bool(jnp.isfinite(short).all())
    with pytest.raises(ValueError, match="block_size must be in"):
        dflash.draft(CONFIG, params, embed, head, cache, bonus, block_size=9)


def test_config_and_param_validation():
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashConfig(**{**CONFIG.__dict__, "block_size": 1})
    with pytest.raises(ValueError, match="must equal the target's"):
        dflash.param_shapes(CONFIG, D + 1)
    axes = dflash.param_axes(CONFIG, D)
    params = dflash.init_params(CONFIG, D, jax.random.key(0))
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)
    assert CONFIG.num_draft_tokens == 4


def test_yarn_rope_drafter_reduces_to_default_at_factor_one_and_parses():
    from ddtree_jax.checkpoint import parse_config

    yarn_one = DFlashConfig(**{**CONFIG.__dict__, "rope_type": "yarn", "rope_factor": 1.0})
    key = jax.random.split(jax.random.key(3), 3)
    params = dflash.init_params(CONFIG, D, key[0], norm_jitter=0.2)
    embed, head = jax.random.normal(key[1], (V, D)), jax.random.normal(key[2], (V, D))
    feats = jax.random.normal(key[0], (1, 4, len(CONFIG.target_layers) * D))
    outs = []
    for config in (CONFIG, yarn_one):
        cache = dflash.append_context(
            config, params, dflash.create_context_cache(config, 1, 8, jnp.float32), feats, jnp.array([4], jnp.int32)
        )
        outs.append(np.asarray(dflash.draft(config, params, embed, head, cache, jnp.array([3], jnp.int32))))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    kimi_style = parse_config(
        {
            "model_type": "qwen3",
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_hidden_layers": 6,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
            "dflash_config": {"block_size": 8, "mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
        }
    )
    assert (kimi_style.rope_type, kimi_style.rope_factor, kimi_style.block_size) == ("yarn", 64.0, 8)
    assert kimi_style.target_layers == (1, 12, 24, 35, 47, 58)


def test_train_logits_equal_draft_block_by_block():
    """The training forward over many anchors at once = append_context(features[:, :a]) + draft(tokens[a])."""
    key = jax.random.split(jax.random.key(5), 4)
    params = dflash.init_params(CONFIG, D, key[0], norm_jitter=0.2)
    embed = jax.random.normal(key[1], (V, D))
    head = jax.random.normal(key[2], (V, D)) * 0.3
    rng = np.random.default_rng(2)
    batch, steps = 2, 12
    features = jnp.asarray(rng.standard_normal((batch, steps, len(CONFIG.target_layers) * D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V - 1, (batch, steps)), jnp.int32)
    anchors = jnp.array([[0, 3, 7], [2, 5, 7]], jnp.int32)  # a <= steps - block_size; a = 0: no context
    logits = np.asarray(
        jax.jit(lambda *a: dflash.train_logits(CONFIG, *a))(params, embed, head, features, tokens, anchors)
    )
    assert logits.shape == (batch, 3, CONFIG.block_size - 1, V)

    @jax.jit
    def block_by_block(a):
        cache = dflash.create_context_cache(CONFIG, batch, steps, jnp.float32)
        cache = dflash.append_context(CONFIG, params, cache, features, a)  # rows >= a written but not counted
        return dflash.draft(CONFIG, params, embed, head, cache, tokens[jnp.arange(batch), a])

    for n in range(anchors.shape[1]):
        np.testing.assert_allclose(logits[:, n], np.asarray(block_by_block(anchors[:, n])), rtol=2e-5, atol=2e-5)
