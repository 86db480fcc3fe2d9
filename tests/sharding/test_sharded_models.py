"""Sharded = unsharded, on 8 fake CPU devices (tests/conftest.py): a tiny K2-shaped target (absorbed MLA,
16 routed experts with INT4 weights, group-limited routing) under the TP and EP rule tables on a
2 (data) x 4 (model) mesh: prefill, tree verify, and whole greedy and sampled generations with a sharded
DFlash drafter. One SPMD program per step: every device holds the same sampled tokens by construction
(no per-rank sampling that could diverge)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine import DFlashDrafter, generate
from ddtree_jax.models import deepseek_v3, dflash
from ddtree_jax.options import DecodeOptions
from ddtree_jax.sampling import SamplingParams, row_keys
from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.rules import param_shardings, param_specs, partition_spec, shard_params
from ddtree_kernels.quant import Int4Weight, quantize_int4
from tests.sharding.tiny_k2 import CONFIG, DRAFTER, prefill_verify


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_sharded_prefill_and_verify_equal_unsharded(params, mesh, layout):
    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, layout)
    gate = sharded["moe_layers"]["expert_gate"]
    assert isinstance(gate, Int4Weight)  # experts stay packed, sharded as packed words
    want_spec = (None, None, "model", None) if layout == "tp" else (None, "model", None, None)
    assert tuple(gate.packed.sharding.spec) == want_spec
    assert len(gate.packed.addressable_shards) == 8
    for got, want in zip(prefill_verify(sharded, mesh), prefill_verify(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_sharded_generation_equals_unsharded(params, mesh, layout):
    """Whole DDTree generations (decode steps with drafting, tree, verify, sampling, commit), greedy and
    at T = 1 with top-p, with the target and the drafter sharded (EP: the experts' "ep" region)."""
    drafter_params = dflash.init_params(DRAFTER, 32, jax.random.key(1))

    def pair(target_params, drafter_params):
        return DFlashDrafter(
            DRAFTER, drafter_params, deepseek_v3.embedding(target_params), deepseek_v3.head(CONFIG, target_params)
        )

    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, layout)
    sharded_drafter = shard_params(drafter_params, dflash.param_axes(DRAFTER, 32), mesh, layout)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, 63, (2, 6)), jnp.int32)
    lengths = jnp.asarray([6, 3], jnp.int32)
    for temperature in (0.0, 1.0):
        common = dict(
            sampling=SamplingParams.create(2, temperature=temperature, top_p=0.9),
            keys=row_keys(jax.random.key(2), jnp.arange(2)),
            stop_tokens=jnp.full((2, 1), -1, jnp.int32),
            max_new=jnp.full((2,), 12, jnp.int32),
            max_new_tokens=12,
            method="ddtree",
            budget=6,
            block_size=4,
        )
        want = generate(CONFIG, params, pair(params, drafter_params), prompts, lengths, **common)
        with jax.set_mesh(mesh):  # EP: the routed experts in the "ep" shard_map region
            got = generate(
                CONFIG,
                sharded,
                pair(sharded, sharded_drafter),
                prompts,
                lengths,
                **common,
                options=DecodeOptions(moe_impl={"tp": "auto", "ep": "ep"}[layout]),
            )
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.accepted), np.asarray(want.accepted))


def test_rule_tables_and_errors(params, mesh):
    assert partition_spec(("layers", "experts", "expert_mlp", "embed"), "tp") == jax.sharding.PartitionSpec(
        None, None, "model", None
    )
    assert partition_spec(("layers", "experts", "expert_mlp", "embed"), "ep") == jax.sharding.PartitionSpec(
        None, "model", None, None
    )
    specs = param_specs(params, deepseek_v3.param_axes(CONFIG), "tp")
    assert isinstance(specs["moe_layers"]["expert_down"], Int4Weight)
    with pytest.raises(ValueError, match="layout must be one of"):
        partition_spec(("embed",), "fsdp")
    with pytest.raises(ValueError, match="no rule"):
        partition_spec(("embed", "pixels"), "tp")
    small = {
        **params,
        "moe_layers": {**params["moe_layers"], "expert_down": quantize_int4(np.zeros((2, 16, 32, 32), np.float32))},
    }  # 32 / 32 = 1 scale column cannot split 4 ways
    with pytest.raises(ValueError, match=r"expert_down.*does not divide over mesh axis 'model'"):
        shard_params(small, deepseek_v3.param_axes(CONFIG), mesh, "tp")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(model=8, data=2)


@pytest.mark.parametrize("model", [3, 6])
def test_param_shardings_refuse_a_model_axis_that_does_not_divide(model):
    """3- and 6-way meshes of the 8 fake devices: the tiny K2 target's kv_b_proj holds 4 heads x 16 = 64 columns,
    which do not split 3 or 6 ways. param_shardings (the out_shardings of a jitted initialiser, as
    experiments/sharded_run.py uses them: no shard_params on the way) names the array, its size and the axis
    up front, from shapes alone, instead of JAX's IndivisibleError out of the jit."""
    mesh = make_mesh(model=model)
    shapes = jax.eval_shape(lambda k: deepseek_v3.init_params(CONFIG, k), jax.random.key(0))
    for layout in ("tp", "ep"):
        with pytest.raises(
            ValueError, match=rf"kv_b_proj.*size 64 does not divide over mesh axis 'model' of size {model}"
        ):
            param_shardings(shapes, deepseek_v3.param_axes(CONFIG), mesh, layout)
