"""analysis/tp_shard.py: one device's share of a TP model as a model of its own, equal to what the rule table
gives each device of the real sharding."""

import jax
import numpy as np
import pytest

from ddtree_jax import presets
from ddtree_jax.analysis.tp_shard import per_device_shapes, tp_shard_config
from ddtree_jax.models import deepseek_v3
from ddtree_jax.models.layers import is_shape_leaf
from ddtree_jax.presets import preset
from ddtree_jax.sharding import make_mesh, param_shardings


def test_the_k26_tp8_shard_is_what_one_gpu_holds():
    k26 = presets.kimi_k2_6()
    shard = tp_shard_config(k26, 8)
    assert (shard.num_heads, shard.intermediate_size, shard.moe_intermediate_size, shard.vocab_size) == (
        8,
        18432 // 8,
        256,
        163840 // 8,
    )
    # replicated: the latent cache and its projections, the router over all 384 experts, the depth
    assert (shard.kv_lora_rank, shard.q_lora_rank, shard.n_routed_experts, shard.num_layers) == (512, 1536, 384, 61)
    shapes = deepseek_v3.param_shapes(shard)["moe_layers"]
    assert shapes["expert_down"][0] == (60, 384, 7168, 256) and shapes["router"][0] == (60, 384, 7168)
    drafter = tp_shard_config(presets.kimi_k2_5_dflash(), 8, target_hidden=k26.hidden_size)
    assert drafter.num_heads == presets.kimi_k2_5_dflash().num_heads // 8


def test_per_device_shapes_are_the_real_shards_shapes():
    """On 8 CPU devices: the tiny 8-way-divisible K2 target sharded by the TP rule table; every parameter's
    per-device array shape equals `per_device_shapes`, and equals the shard model's own parameter."""
    config = preset("kimi-k2-mesh-tiny")
    mesh = make_mesh(8)
    shapes = jax.eval_shape(lambda k: deepseek_v3.init_params(config, k), jax.random.key(0))
    params = jax.jit(
        lambda k: deepseek_v3.init_params(config, k),
        out_shardings=param_shardings(shapes, deepseek_v3.param_axes(config), mesh, "tp"),
    )(jax.random.key(0))
    want = jax.tree.leaves(per_device_shapes(config, "tp", 8), is_leaf=is_shape_leaf)
    got = [leaf.addressable_shards[0].data.shape for leaf in jax.tree.leaves(params)]
    assert [tuple(w[0]) for w in want] == got
    shard = tp_shard_config(config, 8)
    own = jax.eval_shape(lambda k: deepseek_v3.init_params(shard, k), jax.random.key(0))
    assert [leaf.shape for leaf in jax.tree.leaves(own)] == got
    assert np.prod(got[0]) * 8 == np.prod(jax.tree.leaves(shapes)[0].shape)  # the embedding: 1/8 of the vocab


def test_layouts_without_a_same_family_share_and_bad_splits_are_named():
    k26 = presets.kimi_k2_6()
    with pytest.raises(NotImplementedError, match="layout 'ep' splits"):
        tp_shard_config(k26, 8, layout="ep")
    with pytest.raises(ValueError, match="num_heads = 64 does not split 3 ways"):
        tp_shard_config(k26, 3)
    with pytest.raises(ValueError, match="does not divide over 3 devices"):
        per_device_shapes(k26, "tp", 3)
    with pytest.raises(ValueError, match="layout must be one of"):
        tp_shard_config(k26, 8, layout="fsdp")
    with pytest.raises(ValueError, match="target_hidden"):
        tp_shard_config(presets.kimi_k2_5_dflash(), 8)
