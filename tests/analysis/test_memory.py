"""The memory planner: exact parameter inventories against the models' param_shapes, K2.6 on 8 x H200
(INT4 fits, bf16 experts do not), max_context, and bad inputs. Pure arithmetic: no device work."""

import dataclasses
import json
import math
import pathlib

import pytest

from ddtree_jax import dispatch, presets
from ddtree_jax.analysis import memory
from ddtree_jax.analysis.memory import (
    MeshLayout,
    drafter_inventory,
    max_context,
    param_counts,
    parse_layout,
    plan_memory,
    total_params,
    weight_bytes,
    weight_inventory,
)
from ddtree_jax.checkpoint import parse_config
from ddtree_jax.config import DFlashConfig, Qwen3Config
from ddtree_jax.models import deepseek_v3, dflash, qwen3
from ddtree_jax.sharding.rules import MODEL, RULES
from tests.tiny_models import DSV3_TINY

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

QWEN3_TINY = Qwen3Config(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tapped_layers=(0, 2),
)
DRAFTER_TINY = DFlashConfig(
    hidden_size=32,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    block_size=5,
    mask_token_id=60,
    target_layers=(0, 2),
)


def _k2_tiny():
    return parse_config(json.loads((CONFIGS / "kimi_k2_tiny.json").read_text()))


def _flatten(shapes: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in shapes.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = (tuple(v[0]), tuple(v[1]))
    return out


def _same_tensors(inventory, shapes):
    assert {t.path: (t.shape, t.axes) for t in inventory} == _flatten(shapes)


@pytest.mark.parametrize(
    "config",
    [
        DSV3_TINY,
        dataclasses.replace(DSV3_TINY, q_lora_rank=None, tie_word_embeddings=True, first_k_dense_replace=0),
        dataclasses.replace(DSV3_TINY, n_shared_experts=2, first_k_dense_replace=3),
        "k2_tiny",
    ],
    ids=["dsv3-tiny", "no-q-lora-tied", "all-dense-2-shared", "kimi_k2_tiny.json"],
)
def test_deepseek_inventory_is_param_shapes_exactly(config):
    config = _k2_tiny() if config == "k2_tiny" else config
    inventory = weight_inventory(config)
    _same_tensors(inventory, deepseek_v3.param_shapes(config))
    assert total_params(config) == sum(math.prod(s) for s, _ in _flatten(deepseek_v3.param_shapes(config)).values())


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_and_drafter_inventories_are_param_shapes_exactly(tied):
    config = dataclasses.replace(QWEN3_TINY, tie_word_embeddings=tied)
    _same_tensors(weight_inventory(config), qwen3.param_shapes(config))
    counts = param_counts(config)
    assert counts["routed_experts"] == counts["shared_experts"] == 0 and (counts["lm_head"] == 0) == tied
    _same_tensors(drafter_inventory(DRAFTER_TINY, 32), dflash.param_shapes(DRAFTER_TINY, 32))
    with pytest.raises(ValueError, match="must equal the target's"):
        drafter_inventory(DRAFTER_TINY, 64)


def test_k2_6_preset_matches_the_config_file_and_counts_about_a_trillion():
    parsed = parse_config(json.loads((CONFIGS / "kimi_k2_6.json").read_text()))
    preset = presets.kimi_k2_6()
    assert preset.tapped_layers == presets.kimi_k2_5_dflash().target_layers == (1, 12, 24, 35, 47, 58)
    assert dataclasses.replace(parsed, tapped_layers=preset.tapped_layers) == preset
    counts = param_counts(preset)
    assert sum(counts.values()) == 1_026_408_232_448  # exact; K2: "1T total"
    assert counts["routed_experts"] == 60 * 384 * 3 * 2048 * 7168
    assert 1.0e12 < total_params(preset) < 1.1e12
    assert total_params(preset) == sum(math.prod(s) for s, _ in _flatten(deepseek_v3.param_shapes(preset)).values())
    # the assumed Kimi-K2.5-DFlash shape: 3.48e9 parameters = the published 6.48 GiB bf16 checkpoint
    assert abs(memory.drafter_params(presets.kimi_k2_5_dflash()) * 2 / 2**30 - 6.48) < 0.01


def test_format_bytes():
    assert memory.format_bytes((7168, 2048), "int4") == 7168 * 2048 * 0.5625  # 0.5 B + a bf16 scale per 32
    assert memory.format_bytes((3, 7168, 256), "int4") == 3 * 7168 * 256 * 0.5625
    assert memory.format_bytes((300, 256), "fp8") == 300 * 256 + 3 * 2 * 4  # float32 scale per 128 x 128 block
    assert memory.format_bytes((5, 7), "bf16") == 70
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        memory.format_bytes((4, 48), "int4")


def test_k2_6_int4_fits_on_8_h200_and_bf16_experts_do_not():
    k2, drafter = presets.kimi_k2_6(), presets.kimi_k2_5_dflash()
    routed_total = param_counts(k2)["routed_experts"] * 0.5625
    for layout in ("tp8", "ep8"):
        for batch in (1, 8):
            plan = plan_memory(k2, drafter=drafter, layout=layout, batch=batch, context=4096, budget=64)
            assert plan.fits, plan.table()
            assert plan.weights["routed_experts"] == routed_total / 8  # 384 experts x 1/8 columns = 48 whole experts
            assert 75e9 < plan.weights_total < 77e9
        assert not plan_memory(k2, drafter=drafter, layout=layout, expert_format="bf16").fits
    # block FP8 experts and projections (the original K2 format): 1T parameters do not fit 8 x 141 GB either
    assert not plan_memory(k2, drafter=drafter, layout="tp8", expert_format="fp8", dense_format="fp8").fits
    # the same bytes per device under TP and EP, except the router (experts-split under EP)
    tp, ep = weight_bytes(k2, "tp8"), weight_bytes(k2, "ep8")
    assert {k: v for k, v in tp.items() if k != "norms_router"} == {k: v for k, v in ep.items() if k != "norms_router"}
    assert ep["norms_router"] < tp["norms_router"]
    # the MLA latent cache is replicated over the model axis and split by batch over the data axis
    one = plan_memory(k2, layout="tp8", batch=8, context=1000, budget=0)
    # 1,000 tokens + 1 slot = 1,001 rows, allocated in whole 128-row blocks (dispatch.CACHE_ROW_MULTIPLE): 1,024
    assert one.kv_cache == 8 * 1024 * 61 * 576 * 2
    assert plan_memory(k2, layout="tp4-dp2", batch=8, context=1000, budget=0).kv_cache == one.kv_cache // 2


def test_max_context_is_the_boundary_and_shrinks_with_batch():
    k2, drafter = presets.kimi_k2_6(), presets.kimi_k2_5_dflash()
    contexts = [max_context(k2, drafter=drafter, layout="tp8", batch=b, budget=64) for b in (1, 2, 4, 8, 16)]
    assert all(a >= b for a, b in zip(contexts, contexts[1:])), contexts
    assert contexts[0] > k2.max_position_embeddings  # at batch 1 the model's 262,144 positions bind, not memory
    # the prefill's workspace per device at batch 8 counts too (~9 GB before the routed experts' [A, hidden]
    # buffers were counted; 55,296 tokens since, the cache sized for the prompt padded to whole chunks)
    assert 50_000 < contexts[3] < 62_000
    s = contexts[3]
    assert plan_memory(k2, drafter=drafter, layout="tp8", batch=8, context=s, budget=64).fits
    assert not plan_memory(k2, drafter=drafter, layout="tp8", batch=8, context=s + 1, budget=64).fits
    limit = k2.max_position_embeddings
    assert max_context(k2, drafter=drafter, batch=1, budget=64, limit=limit) == limit
    assert max_context(k2, layout="tp8", expert_format="bf16") == 0  # weights alone do not fit
    # the XLA attention path's float32 scores cost decode workspace; at batch 8 the prefill's workspace is still
    # the larger, so the context limit is the same
    plans = {
        impl: plan_memory(k2, drafter=drafter, layout="tp8", batch=8, context=s, budget=64, attention_impl=impl)
        for impl in ("xla", "pallas")
    }
    assert plans["xla"].activations_total > plans["pallas"].activations_total + 1e9
    assert plans["xla"].workspace_total == plans["xla"].prefill_total
    assert max_context(k2, drafter=drafter, batch=8, budget=64, attention_impl="xla") == s


def test_qwen3_8b_on_one_h200():
    q, d = presets.qwen3_8b(), presets.qwen3_8b_dflash_b16()
    plan = plan_memory(q, drafter=d, layout="single", batch=1, context=4096, budget=256)
    assert plan.fits and plan.layout.devices == 1
    assert 8.1e9 < total_params(q) < 8.3e9  # Qwen3-8B: 8.2B
    assert memory.cache_bytes_per_token(q, "single") == 36 * 2 * 8 * 128 * 2
    assert memory.cache_bytes_per_token(q, "tp8") == 36 * 2 * 1 * 128 * 2  # KV heads split over the model axis


def test_the_planner_splits_the_axes_the_rule_table_splits():
    # every logical axis the models use: MODEL_AXES and MeshLayout.split follow sharding/rules.py's RULES
    assert set(memory.MODEL_AXES) == set(RULES)
    for kind, rules in RULES.items():
        assert memory.MODEL_AXES[kind] == {axis for axis, mesh_axis in rules.items() if mesh_axis == MODEL}
        layout = MeshLayout(kind, 8, 2)
        for axis, mesh_axis in rules.items():
            assert layout.split(axis) == (8 if mesh_axis == MODEL else 1), (kind, axis)
    # and every axis a planned tensor carries has a rule (an axis without one would silently replicate)
    for config in (presets.kimi_k2_6(), presets.qwen3_8b(), _k2_tiny()):
        for t in weight_inventory(config):
            assert set(t.axes) <= set(RULES["tp"]) and set(t.axes) <= set(RULES["ep"]), t.path
    for t in drafter_inventory(presets.kimi_k2_5_dflash(), 7168):
        assert set(t.axes) <= set(RULES["tp"]), t.path


def test_auto_attention_is_resolved_as_on_a_gpu():
    # MLA: "auto" is the Mosaic kernel from dispatch.AUTO_PALLAS_MLA_MIN_KEYS cache rows, XLA below; Qwen3's GQA
    # at N <= 65: the kernel; at N = 129 only against a short cache (dispatch.AUTO_PALLAS_GQA_SHORT_KEYS)
    k2, q = presets.kimi_k2_6(), presets.qwen3_8b()
    for context, impl in ((4096, "pallas"), (dispatch.AUTO_PALLAS_MLA_MIN_KEYS - 200, "xla")):
        assert (
            plan_memory(k2, context=context, attention_impl="auto").activations
            == plan_memory(k2, context=context, attention_impl=impl).activations
        ), context
    assert (
        plan_memory(q, layout="single", budget=16, attention_impl="auto").activations
        == plan_memory(q, layout="single", budget=16, attention_impl="pallas").activations
    )
    assert (
        plan_memory(q, layout="single", budget=64, attention_impl="auto").activations
        == plan_memory(q, layout="single", budget=64, attention_impl="pallas").activations
    )
    for context, impl in ((1024, "pallas"), (8192, "xla")):
        assert (
            plan_memory(q, layout="single", budget=128, context=context, attention_impl="auto").activations
            == plan_memory(q, layout="single", budget=128, context=context, attention_impl=impl).activations
        ), context


def test_layouts():
    assert parse_layout("tp8") == MeshLayout("tp", 8, 1)
    assert parse_layout("ep2") == MeshLayout("ep", 2, 1)
    assert parse_layout("tp4-dp2").devices == 8 and parse_layout("single").devices == 1
    assert parse_layout("ep8").split("experts") == 8 and parse_layout("ep8").split("expert_mlp") == 1
    assert parse_layout("tp8").split("experts") == 1 and parse_layout("tp8").split("expert_mlp") == 8
    assert parse_layout("tp8").split("kv_lora") == 1  # MLA's shared low-rank projections are replicated


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch=0), "batch must be an integer >= 1, got 0"),
        (dict(context=-5), "context must be an integer >= 0, got -5"),
        (dict(budget=-1), "budget must be an integer >= 0, got -1"),
        (dict(layout="pp8"), "got 'pp8'"),
        (dict(layout="tp3"), "of size 163840 does not divide over 3 devices .layout .tp3.."),
        (dict(layout="ep5"), "does not divide over 5 devices"),
        (dict(expert_format="int3"), "expert_format must be one of .* got 'int3'"),
        (dict(dense_format="fp4"), "got 'fp4'"),
        (dict(cache_dtype="fp16"), "got 'fp16'"),
        (dict(attention_impl="cuda"), "got 'cuda'"),
        (dict(usable_fraction=1.5), "got 1.5"),
    ],
)
def test_bad_inputs_raise_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(presets.kimi_k2_6(), **kwargs)


def test_bad_configs_and_meshes():
    with pytest.raises(ValueError, match="got 'dict'|got dict"):
        weight_inventory({"hidden_size": 1})
    with pytest.raises(ValueError, match="model=0"):
        MeshLayout("tp", 0)
    with pytest.raises(ValueError, match="8 KV heads do not divide over 16"):
        plan_memory(presets.qwen3_8b(), layout="tp16")


def test_the_prefill_workspace_counts_when_it_is_the_larger():
    """The plan counts the larger of the decode step's and the prefill's workspace (never both): a long prompt's
    chunked prefill (2,048 tokens per row) holds [rows, P, hidden] buffers, blockwise attention past the
    dense path's limit, and logits of one token per row."""
    k2, drafter = presets.kimi_k2_6(), presets.kimi_k2_5_dflash()
    plan = plan_memory(k2, drafter=drafter, layout="tp8", batch=8, context=80_000, budget=64)
    assert plan.prefill_total > plan.activations_total and plan.workspace_total == plan.prefill_total
    assert plan.prefill["logits"] < 1e8  # one token per row, not [rows, P, V]
    short = plan_memory(k2, drafter=drafter, layout="tp8", batch=1, context=0, budget=64)
    assert short.prefill == {} and short.workspace_total == short.activations_total
    assert "prefill workspace: hidden_states" in plan.table()
    # 80k keys x 2,048 queries: blockwise (one 1,024-key block of scores), far below the dense scores
    dense_scores = 2 * 8 * (k2.num_heads // 8) * 2048 * 80_000 * 4
    assert plan.prefill["attention"] < dense_scores / 20
