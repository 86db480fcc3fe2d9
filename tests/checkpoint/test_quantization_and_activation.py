"""Block-FP8 Qwen3 checkpoints (HF's format, as Qwen/Qwen3-8B-FP8) load dequantised; other quantization
configs, stray or missing FP8 scales, and activations other than SiLU raise CheckpointError naming them;
DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers) are skipped as HF skips them."""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import CheckpointError, load_hf, parse_config, save_hf
from ddtree_jax.checkpoint.hf_weights import TensorSource, read_safetensors_header
from ddtree_jax.models import deepseek_v3, dflash, qwen3
from ddtree_jax.models.layers import is_shape_leaf
from tests.checkpoint.test_load_hf import _hf_dict
from tests.tiny_models import QWEN3_CHECKPOINT, tiny_drafter

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# q_proj [256, 64] (2 x 1 blocks), o_proj [64, 256] (1 x 2), gate / up [192, 64] (a full and a partial block),
# down [64, 192]; k / v [64, 64] (one partial block)
FP8_TARGET = dataclasses.replace(
    QWEN3_CHECKPOINT,
    vocab_size=97,
    hidden_size=64,
    intermediate_size=192,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
)


def _quantize_block_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn codes, float32 scale_inv [ceil(out / 128), ceil(in / 128)]) with scale_inv = block amax / 448,
    as HF's block-FP8 checkpoints (and scripts/make_parity_fixture.py) store them."""
    out, inner = w.shape
    rows, cols = -(-out // BLOCK), -(-inner // BLOCK)
    padded = np.zeros((rows * BLOCK, cols * BLOCK), np.float32)
    padded[:out, :inner] = w
    blocks = padded.reshape(rows, BLOCK, cols, BLOCK)
    scale = (np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0).astype(np.float32)
    codes = (blocks / scale[:, None, :, None]).reshape(rows * BLOCK, cols * BLOCK)[:out, :inner]
    return codes.astype(ml_dtypes.float8_e4m3fn), scale


def _dequantized(codes, scale):
    full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[: codes.shape[0], : codes.shape[1]]
    return codes.astype(np.float32) * full


def _codes(quantised, ours):
    """The FP8 codes of projection `ours` ("q_proj", ...) of every layer, in layer order."""
    named = {int(n.split(".")[2]): codes for n, (codes, _) in quantised.items() if n.split(".")[-2] == ours}
    return [named[layer] for layer in sorted(named)]


def _edit_config(path, **over):
    file = os.path.join(path, "config.json")
    cfg = json.loads(pathlib.Path(file).read_text())
    cfg.update(over)
    pathlib.Path(file).write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def dense_and_fp8(tmp_path_factory):
    """(dense dir, FP8 dir, {weight name: (codes, scale)}): one tiny Qwen3, saved in float32 and in block FP8
    (every decoder projection; embedding, norms and lm_head as stored). Each 128 x 128 block of a projection
    is scaled by its own factor, so a block's scale applied to the wrong block shows."""
    rng = np.random.default_rng(0)

    def init(shape, axes):  # as qwen3.init_params (norms 1 + 0.1 normal, matrices 0.02 normal), in numpy
        if len(shape) - (axes[0] == "layers") == 1:
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        w = 0.02 * rng.standard_normal(shape).astype(np.float32)
        if axes[0] == "layers":  # a projection: scale each 128 x 128 block by its own factor
            factors = rng.uniform(0.25, 4.0, (shape[0], -(-shape[1] // BLOCK), -(-shape[2] // BLOCK)))
            w *= np.repeat(np.repeat(factors, BLOCK, 1), BLOCK, 2)[:, : shape[1], : shape[2]].astype(np.float32)
        return w

    params = jax.tree.map(lambda leaf: init(*leaf), qwen3.param_shapes(FP8_TARGET), is_leaf=is_shape_leaf)
    dense_dir, fp8_dir = tmp_path_factory.mktemp("dense"), tmp_path_factory.mktemp("fp8")
    save_hf(str(dense_dir), FP8_TARGET, params)
    quantised = _save_block_fp8(dense_dir, fp8_dir, lambda name: name.startswith("model.layers."))
    return str(dense_dir), str(fp8_dir), quantised


def _save_block_fp8(dense_dir, fp8_dir, select) -> dict:
    """Re-saves the checkpoint in dense_dir into fp8_dir with its linear weights (`*_proj.weight`, `fc.weight`,
    `lm_head.weight`) that `select(name)` picks in block FP8, as HF stores them; returns {weight name: (codes, scale)}."""
    os.makedirs(fp8_dir, exist_ok=True)
    stored, quantised = {}, {}
    for name, w in load_file(str(pathlib.Path(dense_dir) / "model.safetensors")).items():
        if (name.endswith("_proj.weight") or name in ("fc.weight", "lm_head.weight")) and select(name):
            codes, scale = _quantize_block_fp8(w)
            stored[name], stored[f"{name}_scale_inv"] = codes, scale
            quantised[name] = (codes, scale)
        else:
            stored[name] = w
    save_file(stored, str(pathlib.Path(fp8_dir) / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(pathlib.Path(dense_dir) / "config.json", pathlib.Path(fp8_dir) / "config.json")
    _edit_config(fp8_dir, quantization_config=FP8_CONFIG)
    return quantised


def test_block_fp8_qwen3_checkpoint_loads_dequantised(dense_and_fp8):
    """The FP8 checkpoint loads with every projection = codes x its block's scale (not the raw codes, up to
    448), and its logits match the unquantised checkpoint's within FP8 error."""
    dense_dir, fp8_dir, quantised = dense_and_fp8
    header = read_safetensors_header(os.path.join(fp8_dir, "model.safetensors"))
    assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "F8_E4M3"  # stored as HF stores it
    assert header["model.layers.0.self_attn.q_proj.weight_scale_inv"]["shape"] == [2, 1]
    config, dense = load_hf(dense_dir, dtype=jnp.float32)
    fp8_config, params = load_hf(fp8_dir, dtype=jnp.float32)
    assert fp8_config == config == FP8_TARGET
    for name, (codes, scale) in quantised.items():
        layer, ours = int(name.split(".")[2]), name.split(".")[-2]
        loaded = np.asarray(params["layers"][ours][layer])
        np.testing.assert_array_equal(loaded, _dequantized(codes, scale), err_msg=name)
        reference = np.asarray(dense["layers"][ours][layer])
        assert np.max(np.abs(loaded - reference)) <= np.max(np.abs(reference)) / 8, name  # e4m3: 3 mantissa bits
    np.testing.assert_array_equal(params["embed"], dense["embed"])  # stored unquantised, loaded as is
    ids = jnp.asarray(np.random.default_rng(1).integers(0, FP8_TARGET.vocab_size, (2, 12)), jnp.int32)
    ref = np.asarray(qwen3.forward_logits(config, dense, ids))
    logits = np.asarray(qwen3.forward_logits(fp8_config, params, ids))
    err = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
    # e4m3 rounding moves the projections by ~2.6% (l2) and these random-init logits by ~6% (max-relative; ~5.5% l2);
    # the raw codes (what the loader gave before it read the scales) by > 100%
    assert err < 0.1, f"max |fp8 - dense| / max |dense| = {err:.3f}"
    layers = sorted({name.split(".")[-2] for name in quantised})
    raw = {k: jnp.stack([jnp.asarray(codes.astype(np.float32)) for codes in _codes(quantised, k)]) for k in layers}
    raw_logits = np.asarray(qwen3.forward_logits(config, {**params, "layers": {**params["layers"], **raw}}, ids))
    assert np.max(np.abs(raw_logits - ref)) / np.max(np.abs(ref)) > 0.5
    _, bf16 = load_hf(fp8_dir, dtype=jnp.bfloat16)  # dequantised straight to the load dtype
    assert bf16["layers"]["q_proj"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(bf16["layers"]["q_proj"], np.float32), np.asarray(params["layers"]["q_proj"]), rtol=2**-8
    )
    _, auto = load_hf(fp8_dir)  # "auto": the stored floating dtype (float32 here), never the FP8 codes'
    assert auto["layers"]["down_proj"].dtype == jnp.float32


def test_block_fp8_drafter_and_lm_head_load_dequantised(tmp_path):
    """A DFlash drafter's fc ([32, 160]: 1 x 2 blocks) and projections, and a Qwen3 lm_head, load dequantised too."""
    drafter = tiny_drafter(39, (0, 1, 2, 3, 4), 4)
    rng = np.random.default_rng(2)

    def init(shape, axes):  # norms 1, matrices 0.02 normal
        is_norm = len(shape) - (axes[0] == "layers") == 1
        return (1.0 if is_norm else 0.02 * rng.standard_normal(shape)) * np.ones(shape, np.float32)

    params = jax.tree.map(lambda leaf: init(*leaf), dflash.param_shapes(drafter, 32), is_leaf=is_shape_leaf)
    save_hf(str(tmp_path / "dense"), drafter, params, vocab_size=40)
    quantised = _save_block_fp8(tmp_path / "dense", tmp_path / "fp8", lambda name: True)
    assert "fc.weight" in quantised and "layers.0.mlp.down_proj.weight" in quantised
    config, loaded = load_hf(str(tmp_path / "fp8"), dtype=jnp.float32)
    assert config == drafter
    np.testing.assert_array_equal(loaded["fc"], _dequantized(*quantised["fc.weight"]))
    np.testing.assert_array_equal(
        loaded["layers"]["down_proj"][0], _dequantized(*quantised["layers.0.mlp.down_proj.weight"])
    )
    np.testing.assert_array_equal(loaded["hidden_norm"], params["hidden_norm"])

    target = QWEN3_CHECKPOINT
    save_hf(str(tmp_path / "target"), target, qwen3.init_params(target, jax.random.key(0)))
    quantised = _save_block_fp8(tmp_path / "target", tmp_path / "target_fp8", lambda name: name == "lm_head.weight")
    assert list(quantised) == ["lm_head.weight"]
    _, loaded = load_hf(str(tmp_path / "target_fp8"), dtype=jnp.float32)
    np.testing.assert_array_equal(loaded["lm_head"], _dequantized(*quantised["lm_head.weight"]))


def _rewrite_tensors(src, dst, mutate):
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    source = TensorSource(str(dst))  # safetensors.numpy cannot read float8 tensors; the loader's reader can
    tensors = {name: source.get(name) for name in source.names()}
    mutate(tensors)
    save_file(tensors, file)
    return str(dst)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (  # a scale beside a tensor that is not a linear weight: never skipped silently
            lambda t: t.__setitem__("model.layers.0.input_layernorm.weight_scale_inv", np.ones((1,), np.float32)),
            r"does not use, first: 'model.layers.0.input_layernorm.weight_scale_inv'",
        ),
        (
            lambda t: t.__setitem__("model.embed_tokens.weight_scale_inv", np.ones((1, 1), np.float32)),
            r"does not use, first: 'model.embed_tokens.weight_scale_inv'",
        ),
        (  # a scale whose weight is not in the model
            lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight_scale_inv", np.ones((2, 1), np.float32)),
            r"does not use, first: 'model.layers.7.mlp.up_proj.weight_scale_inv'",
        ),
        (  # FP8 codes without their scales
            lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale_inv"),
            r"'model.layers.1.mlp.down_proj.weight' is stored as F8_E4M3 without its block scales",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight_scale_inv", np.ones((1, 1), np.float32)),
            r"'model.layers.0.self_attn.q_proj.weight_scale_inv' has shape \(1, 1\), expected \(2, 1\)",
        ),
        (  # a scale beside a weight that is not FP8
            lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((64, 64), np.float32)),
            r"'model.layers.0.self_attn.k_proj.weight' has a .*_scale_inv but is stored as F32, not F8_E4M3",
        ),
    ],
)
def test_fp8_scales_are_used_or_reported(dense_and_fp8, tmp_path, mutate, message):
    path = _rewrite_tensors(dense_and_fp8[1], tmp_path / "ckpt", mutate)
    with pytest.raises(CheckpointError, match=message):
        load_hf(path, dtype=jnp.float32)


def _qwen3_dict(**over):
    return _hf_dict(**{"rope_theta": 10_000.0, **over})  # test_load_hf's tiny Qwen3 config


def _drafter_dict(**over):
    dflash = {"block_size": 4, "mask_token_id": 3, "target_layer_ids": [0, 1]}
    return _qwen3_dict(architectures=["DFlashDraftModel"], dflash_config=dflash, **over)


def _deepseek_dict(**over):
    return {**json.loads((FIXTURES / "deepseek_v3_tiny" / "config.json").read_text()), **over}


@pytest.mark.parametrize("family", [_qwen3_dict, _drafter_dict])
@pytest.mark.parametrize(
    "quant,message",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, r"quant_method 'compressed-tensors'"),
        ({"bits": 8}, r"quant_method None"),
        ({**FP8_CONFIG, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
        ({**FP8_CONFIG, "weight_block_size": None}, r"weight_block_size None is not supported"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, r"activation_scheme 'static' is not supported"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
        ("fp8", r"quantization_config must be a JSON object"),
    ],
)
def test_unsupported_quantization_configs_raise(family, quant, message):
    with pytest.raises(CheckpointError, match=message):
        parse_config(family(quantization_config=quant))


def test_quantization_config_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_qwen3_dict(quantization_config={"quant_method": "awq"})))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: .*quant_method 'awq'"):
        load_hf(str(tmp_path))


def test_block_fp8_and_no_quantization_configs_parse():
    plain = parse_config(_qwen3_dict())
    assert parse_config(_qwen3_dict(quantization_config=FP8_CONFIG)) == plain
    assert parse_config(_qwen3_dict(quantization_config={"quant_method": "fp8"})) == plain  # HF's defaults
    assert parse_config(_qwen3_dict(quantization_config=None)) == plain
    assert parse_config(_drafter_dict(quantization_config=FP8_CONFIG)) == parse_config(_drafter_dict())
    with pytest.raises(CheckpointError, match=r"quant_method 'awq'"):
        parse_config(_deepseek_dict(quantization_config={"quant_method": "awq"}))
    with pytest.raises(CheckpointError, match=r"activation_scheme 'static'"):
        parse_config(_deepseek_dict(quantization_config={**FP8_CONFIG, "activation_scheme": "static"}))


@pytest.mark.parametrize("family", [_qwen3_dict, _drafter_dict, _deepseek_dict])
@pytest.mark.parametrize(
    "value,message",
    [("gelu", r"hidden_act 'gelu' \(string\)"), (None, r"hidden_act None \(null\)"), (1, r"hidden_act 1 \(number\)")],
)
def test_activations_other_than_silu_raise(family, value, message):
    with pytest.raises(CheckpointError, match=message):
        parse_config(family(hidden_act=value))


@pytest.mark.parametrize("family", [_qwen3_dict, _drafter_dict, _deepseek_dict])
def test_silu_and_a_missing_hidden_act_parse_alike(family):
    without = {k: v for k, v in family().items() if k != "hidden_act"}
    assert parse_config(family(hidden_act="silu")) == parse_config(without) == parse_config(family(hidden_act="swish"))


def test_deepseek_multi_token_prediction_layers_are_skipped(tmp_path):
    """A checkpoint with num_nextn_predict_layers = 1 holds an MTP layer at index num_hidden_layers (as
    DeepSeek-V3's model.layers.61.*); it loads, ignoring exactly that layer, as HF's DeepseekV3ForCausalLM."""
    fixture = FIXTURES / "deepseek_v3_tiny"
    config, reference = load_hf(str(fixture), dtype=jnp.float32)
    assert json.loads((fixture / "config.json").read_text())["num_nextn_predict_layers"] == 1
    last = config.num_layers - 1

    def add_mtp(index):
        def mutate(t):
            prefix = f"model.layers.{last}."
            for name in [n for n in t if n.startswith(prefix)]:  # an MoE decoder layer, plus the MTP-only tensors
                t[f"model.layers.{index}." + name[len(prefix) :]] = t[name]
            hidden = config.hidden_size
            t[f"model.layers.{index}.enorm.weight"] = np.ones((hidden,), np.float32)
            t[f"model.layers.{index}.hnorm.weight"] = np.ones((hidden,), np.float32)
            t[f"model.layers.{index}.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
            t[f"model.layers.{index}.shared_head.norm.weight"] = np.ones((hidden,), np.float32)

        return mutate

    path = _rewrite_tensors(fixture, tmp_path / "mtp", add_mtp(config.num_layers))
    loaded_config, params = load_hf(path, dtype=jnp.float32)
    assert loaded_config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = jnp.array([[3, 14, 15, 92, 6]], jnp.int32)
    np.testing.assert_array_equal(
        deepseek_v3.forward_logits(config, params, ids), deepseek_v3.forward_logits(config, reference, ids)
    )
    _edit_config(path, num_nextn_predict_layers=0)  # without MTP layers in the config, they are unexpected
    with pytest.raises(CheckpointError, match=rf"does not use, first: 'model.layers.{config.num_layers}\."):
        load_hf(path, dtype=jnp.float32)
    beyond = _rewrite_tensors(fixture, tmp_path / "beyond", add_mtp(config.num_layers + 1))  # past the MTP layers
    with pytest.raises(CheckpointError, match=rf"does not use, first: 'model.layers.{config.num_layers + 1}\."):
        load_hf(beyond, dtype=jnp.float32)


@pytest.mark.parametrize("family", [_qwen3_dict, _drafter_dict])
def test_layer_types_other_than_full_attention_raise(family):
    """transformers' `layer_types` (one attention kind a layer): a sliding-window layer would load as full
    attention, so it raises naming the layer; an all-"full_attention" list parses as no list."""
    layers = family()["num_hidden_layers"]
    full = ["full_attention"] * layers
    assert parse_config(family(layer_types=full)) == parse_config(family())
    with pytest.raises(CheckpointError, match=r"layer_types\[1\] = 'sliding_attention' is not supported"):
        parse_config(family(layer_types=["full_attention", "sliding_attention"] + full[2:]))
    with pytest.raises(CheckpointError, match="layer_types must be a list"):
        parse_config(family(layer_types="full_attention"))


def test_a_tied_checkpoint_that_also_stores_the_head_loads_only_if_the_head_is_the_embedding(tmp_path):
    """Some exporters write a tied head twice (lm_head.weight beside embed_tokens); HF loads that. Equal to the
    embedding: it loads as the tied model does. Different: CheckpointError (the tied model would ignore it)."""
    fixture = FIXTURES / "qwen3_tiny_tied"
    _, reference = load_hf(str(fixture), dtype=jnp.float32)
    tensors = load_file(str(fixture / "model.safetensors"))
    for name, head in (
        ("copy", tensors["model.embed_tokens.weight"]),
        ("other", tensors["model.embed_tokens.weight"] * 2),
    ):
        directory = tmp_path / name
        shutil.copytree(fixture, directory)
        save_file({**tensors, "lm_head.weight": head}, str(directory / "model.safetensors"))
        if name == "copy":
            _, params = load_hf(str(directory), dtype=jnp.float32)
            for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
                load_hf(str(directory), dtype=jnp.float32)
