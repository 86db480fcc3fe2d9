"""The named configs parse and carry the public facts of the models (layers, heads, experts, vocabulary)."""

import json
import pathlib

import jax
import numpy as np

from ddtree_jax.checkpoint import parse_config
from ddtree_jax.models import deepseek_v3

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def test_kimi_k2_6_config_facts():
    c = parse_config(json.loads((CONFIGS / "kimi_k2_6.json").read_text()))
    assert (c.num_layers, c.first_k_dense_replace, c.hidden_size, c.vocab_size) == (61, 1, 7168, 163840)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (384, 8, 1, 2048)
    assert (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        64,
        1536,
        512,
        128,
        64,
        128,
    )
    assert (c.rope_type, c.rope_factor, c.rope_original_max_position, c.rope_theta) == ("yarn", 64.0, 4096, 50000.0)
    assert c.expert_format == "int4" and c.routed_scaling_factor == 2.827
    shapes = jax.tree.leaves(
        deepseek_v3.param_shapes(c), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)
    )
    total = sum(int(np.prod(s)) for s, _ in shapes)
    assert 1.0e12 < total < 1.1e12  # about a trillion parameters in all (K2: 1T total, 32B active)


def test_tiny_k2_config_runs():
    c = parse_config(json.loads((CONFIGS / "kimi_k2_tiny.json").read_text()))
    params = deepseek_v3.init_params(c, jax.random.key(0))
    logits = deepseek_v3.forward_logits(c, params, jax.numpy.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 512)
