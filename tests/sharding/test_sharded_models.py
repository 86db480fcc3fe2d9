"""Sharded = unsharded, on 8 fake CPU devices (tests/conftest.py): a tiny K2-shaped target (absorbed MLA,
16 routed experts with INT4 weights, group-limited routing) under the TP and EP rule tables on a
2 (data) x 4 (model) mesh: prefill, tree verify, and whole greedy and sampled generations with a sharded
DFlash drafter. One SPMD program per step: every device holds the same sampled tokens by construction
(no per-rank sampling that could diverge)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import DeepSeekV3Config, DFlashConfig
from ddtree_jax.engine import DFlashDrafter, generate
from ddtree_jax.models import deepseek_v3, dflash
from ddtree_jax.models.quant import Int4Weight, quantize_int4
from ddtree_jax.sampling import SamplingParams, row_keys
from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.rules import batch_sharding, param_specs, partition_spec, shard_params
from ddtree_jax.tree import ancestor_mask, build_tree

CONFIG = DeepSeekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=128, num_layers=3,
                          first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=3,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, num_heads=4,
                          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          tapped_layers=(0, 2))
DRAFTER = DFlashConfig(hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8,
                       block_size=4, mask_token_id=63, target_layers=(0, 2))


@pytest.fixture(scope="module")
def params():
    p = deepseek_v3.init_params(CONFIG, jax.random.key(0), norm_jitter=0.1)
    for name in ("expert_gate", "expert_up", "expert_down"):
        p["moe_layers"][name] = quantize_int4(np.asarray(p["moe_layers"][name]))
    return p


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(model=4, data=2)


def _prefill_verify(params, mesh=None):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 7)), jnp.int32)
    lengths = jnp.asarray([7, 4], jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 64)) * 2).astype(np.float32), 6, jnp.asarray([3, 5], jnp.int32))
    cache = deepseek_v3.create_cache(CONFIG, 2, 24, jnp.float32)
    if mesh is not None:  # caches and inputs split by batch over "data"
        cache = jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh, a.ndim, 1 if a.ndim == 5 else 0)), cache)
        ids = jax.device_put(ids, batch_sharding(mesh, 2))
    pre, _, cache = jax.jit(lambda p, c, i, l: deepseek_v3.prefill(CONFIG, p, c, i, l))(params, cache, ids, lengths)
    ver, feats, _ = jax.jit(lambda p, c: deepseek_v3.verify(CONFIG, p, c, tree.tokens, tree.depths, ancestor_mask(tree)))(
        params, cache)
    return pre, ver, feats


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_sharded_prefill_and_verify_equal_unsharded(params, mesh, layout):
    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, layout)
    gate = sharded["moe_layers"]["expert_gate"]
    assert isinstance(gate, Int4Weight)  # experts stay packed, sharded as packed words
    want_spec = (None, None, "model", None) if layout == "tp" else (None, "model", None, None)
    assert tuple(gate.packed.sharding.spec) == want_spec
    assert len(gate.packed.addressable_shards) == 8
    for got, want in zip(_prefill_verify(sharded, mesh), _prefill_verify(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_sharded_generation_equals_unsharded(params, mesh, layout):
    """Whole DDTree generations (decode steps with drafting, tree, verify, sampling, commit), greedy and
    at T = 1 with top-p, with the target and the drafter sharded."""
    drafter_params = dflash.init_params(DRAFTER, 32, jax.random.key(1))

    def pair(target_params, drafter_params):
        return DFlashDrafter(DRAFTER, drafter_params, deepseek_v3.embedding(target_params),
                             deepseek_v3.head(CONFIG, target_params))

    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, layout)
    sharded_drafter = shard_params(drafter_params, dflash.param_axes(DRAFTER, 32), mesh, layout)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, 63, (2, 6)), jnp.int32)
    lengths = jnp.asarray([6, 3], jnp.int32)
    for temperature in (0.0, 1.0):
        common = dict(sampling=SamplingParams.create(2, temperature=temperature, top_p=0.9),
                      keys=row_keys(jax.random.key(2), jnp.arange(2)), stop_tokens=jnp.full((2, 1), -1, jnp.int32),
                      max_new=jnp.full((2,), 12, jnp.int32), max_new_tokens=12, method="ddtree", budget=6, block_size=4)
        want = generate(CONFIG, params, pair(params, drafter_params), prompts, lengths, **common)
        got = generate(CONFIG, sharded, pair(sharded, sharded_drafter), prompts, lengths, **common)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.accepted), np.asarray(want.accepted))


def test_rule_tables_and_errors(params, mesh):
    assert partition_spec(("layers", "experts", "expert_mlp", "embed"), "tp") == jax.sharding.PartitionSpec(
        None, None, "model", None)
    assert partition_spec(("layers", "experts", "expert_mlp", "embed"), "ep") == jax.sharding.PartitionSpec(
        None, "model", None, None)
    specs = param_specs(params, deepseek_v3.param_axes(CONFIG), "tp")
    assert isinstance(specs["moe_layers"]["expert_down"], Int4Weight)
    with pytest.raises(ValueError, match="layout must be one of"):
        partition_spec(("embed",), "fsdp")
    with pytest.raises(ValueError, match="no rule"):
        partition_spec(("embed", "pixels"), "tp")
    small = {**params, "moe_layers": {**params["moe_layers"], "expert_down": quantize_int4(
        np.zeros((2, 16, 32, 32), np.float32))}}  # 32 / 32 = 1 scale column cannot split 4 ways
    with pytest.raises(ValueError, match=r"expert_down.*does not divide over mesh axis 'model'"):
        shard_params(small, deepseek_v3.param_axes(CONFIG), mesh, "tp")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(model=8, data=2)
