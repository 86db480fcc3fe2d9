"""The models with attn_impl="pallas" (kernels/tree_attention.py, interpret mode) equal the XLA path:
Qwen3 prefill + tree verify, and the DeepSeek-V3 absorbed MLA (two key parts, no [latent ; rope] copy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import DeepSeekV3Config, Qwen3Config
from ddtree_jax.models import deepseek_v3, qwen3
from ddtree_jax.models.attention import attention
from ddtree_jax.tree import ancestor_mask, build_tree

QWEN = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, tapped_layers=(0, 1))
DSV3 = DeepSeekV3Config(vocab_size=50, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_layers=2,
                        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_heads=4,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        tapped_layers=(0, 1))


def _relerr(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_prefill_and_tree_verify_equal_the_xla_path(family):
    module, config = (qwen3, QWEN) if family == "qwen3" else (deepseek_v3, DSV3)
    params = module.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(1)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 3], jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    outs = {}
    for impl in ("xla", "pallas"):
        cache = module.create_cache(config, 2, 32, jnp.float32)
        pre, _, cache = module.prefill(config, params, cache, prefix, lengths, attn_impl=impl)
        ver, feats, _ = module.verify(config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl=impl)
        outs[impl] = (pre[0], pre[1, :3], ver, feats)
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert _relerr(got, want) < 1e-5


def test_attention_entry_dispatches_and_falls_back_for_odd_head_dims():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 3, 2, 12), (1, 10, 1, 12), (1, 10, 1, 12)))
    mask = jnp.asarray(rng.random((1, 3, 10)) < 0.7)
    np.testing.assert_allclose(np.asarray(attention(q, k, v, mask, impl="pallas")),  # 12: not a power of two -> xla
                               np.asarray(attention(q, k, v, mask, impl="xla")), rtol=1e-6)
    with pytest.raises(ValueError, match="attention impl"):
        attention(q, k, v, mask, impl="flash")
