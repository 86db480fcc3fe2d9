"""Broken checkpoints raise one clear error (CheckpointError, a ValueError) naming the file and the
key, value or tensor; NaN/inf weights are caught with check_finite; load_hf keeps the stored dtype."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import CheckpointError, load_hf, parse_config, read_config, save_hf
from ddtree_jax.models import qwen3
from tests.tiny_models import QWEN3_CHECKPOINT

TARGET = QWEN3_CHECKPOINT


@pytest.fixture(scope="module")
def target_params():
    return qwen3.init_params(TARGET, jax.random.key(0))


def _saved(path, params, **kw):
    save_hf(str(path), TARGET, params, **kw)
    return str(path)


def _rewrite_config(path, mutate):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    mutate(cfg)
    with open(file, "w") as f:
        json.dump(cfg, f)
    return file


def _raises(message, fn, *args, **kw):
    with pytest.raises(CheckpointError, match=message) as info:
        fn(*args, **kw)
    return str(info.value)


def test_null_architectures_as_transformers_writes_them_parse(tmp_path, target_params):
    path = _saved(tmp_path, target_params)
    _rewrite_config(path, lambda cfg: cfg.update(architectures=None))
    config, _ = load_hf(path, dtype=jnp.float32)
    assert config == TARGET


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda cfg: cfg.pop("hidden_size"), "hidden_size is missing"),
        (lambda cfg: cfg.update(hidden_size=None), "hidden_size is null"),
        (lambda cfg: cfg.update(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
        (lambda cfg: cfg.update(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1, got 0"),
        (
            lambda cfg: (cfg.pop("head_dim"), cfg.update(num_attention_heads=0)),
            "num_attention_heads must be an integer >= 1, got 0",
        ),
        (lambda cfg: cfg.update(hidden_size="16"), r"hidden_size must be an integer, got '16' \(string\)"),
        (lambda cfg: cfg.update(num_hidden_layers=2.5), "num_hidden_layers must be an integer, got 2.5"),
        (lambda cfg: cfg.update(rms_norm_eps="1e-6"), "rms_norm_eps must be a number, got '1e-6'"),
        (lambda cfg: cfg["rope_parameters"].update(rope_theta="1e4"), "rope_theta must be a number, got '1e4'"),
        (lambda cfg: cfg.update(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
        (lambda cfg: cfg.update(architectures="Qwen3ForCausalLM"), "architectures must be a list"),
        (
            lambda cfg: cfg.update(num_attention_heads=4, num_key_value_heads=3),
            "must be a multiple of num_key_value_heads",
        ),
    ],
)
def test_bad_config_values_name_the_file_and_key(tmp_path, target_params, edit, message):
    path = _saved(tmp_path, target_params)
    file = _rewrite_config(path, edit)
    text = _raises(message, load_hf, path)
    assert text.startswith(f"{file}: ")


def test_drafter_config_values_are_checked():
    base = {
        "model_type": "qwen3",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "rope_theta": 1e4,
        "architectures": None,
    }
    _raises(
        "block_size must be an integer, got '16'",
        parse_config,
        {**base, "dflash_config": {"block_size": "16", "mask_token_id": 3, "target_layer_ids": [0]}},
    )
    _raises(
        r"target_layer_ids must be a list of integers, got 0",
        parse_config,
        {**base, "dflash_config": {"block_size": 16, "mask_token_id": 3, "target_layer_ids": 0}},
    )
    _raises(r"dflash_config must be a JSON object", parse_config, {**base, "dflash_config": [16]})
    _raises(
        r"^my/drafter: num_target_layers must be an integer",
        parse_config,
        {**base, "dflash_config": {"block_size": 16, "mask_token_id": 3}, "num_target_layers": "36"},
        "my/drafter",
    )


def test_config_json_that_is_not_a_json_object(tmp_path):
    file = tmp_path / "config.json"
    file.write_text('{"model_type": "qwen3",')
    _raises(re.escape(str(file)) + " is not valid JSON", load_hf, str(tmp_path))
    file.write_text("[1, 2]")
    _raises(re.escape(str(file)) + " holds a JSON list, not an object", load_hf, str(tmp_path))
    file.write_bytes(b"\x89\xff\xfe binary")
    _raises(re.escape(str(file)) + " is not a UTF-8 text file", load_hf, str(tmp_path))
    _raises("a config must be a JSON object, got a JSON list", parse_config, [1, 2])


def test_a_safetensors_file_given_as_the_directory(tmp_path, target_params):
    path = _saved(tmp_path, target_params)
    file = os.path.join(path, "model.safetensors")
    _raises(re.escape(file) + " is a safetensors file; give the checkpoint directory", load_hf, file)
    _raises(re.escape(file) + " is a safetensors file", read_config, file)


def test_truncated_safetensors_name_the_file(tmp_path, target_params):
    path = _saved(tmp_path, target_params)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    _raises(re.escape(file) + " is truncated: tensor '.*' needs bytes", load_hf, path)
    open(file, "wb").write(data[:5])
    _raises(re.escape(file) + " is not a safetensors file", load_hf, path)


def test_damaged_safetensors_headers_name_the_file(tmp_path, target_params):
    path = _saved(tmp_path, target_params)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    header_len = int.from_bytes(data[:8], "little")
    open(file, "wb").write((2**62).to_bytes(8, "little") + data[8:])
    _raises(re.escape(file) + f" is truncated or not a safetensors file: its header length is {2**62}", load_hf, path)
    garbled = bytearray(data)
    garbled[8 + header_len // 2 : 8 + header_len // 2 + 4] = b"\xff}}\x00"
    open(file, "wb").write(bytes(garbled))
    _raises(re.escape(file) + " has a damaged safetensors header", load_hf, path)
    header = json.loads(data[8 : 8 + header_len])
    name = "model.layers.0.mlp.up_proj.weight"
    header[name]["data_offsets"][1] += 4  # an entry whose bytes do not match its shape
    text = json.dumps(header).encode()
    open(file, "wb").write(len(text).to_bytes(8, "little") + text + data[8 + header_len :])
    _raises(re.escape(file) + f": damaged header entry for tensor '{re.escape(name)}'", load_hf, path)


def test_sharded_index_errors_name_the_index(tmp_path, target_params):
    path = _saved(tmp_path, target_params, max_shard_bytes=2000)
    index = os.path.join(path, "model.safetensors.index.json")
    content = json.load(open(index))
    json.dump({"metadata": content["metadata"]}, open(index, "w"))
    _raises(re.escape(index) + " has no weight_map", load_hf, path)
    open(index, "w").write("{not json")
    _raises(re.escape(index) + " is not valid JSON", load_hf, path)
    weight_map = dict(content["weight_map"])
    name = "model.layers.1.mlp.down_proj.weight"
    wrong = next(shard for shard in sorted(set(weight_map.values())) if shard != weight_map[name])
    json.dump({**content, "weight_map": {**weight_map, name: wrong}}, open(index, "w"))
    _raises(
        f"maps tensor '{re.escape(name)}' to {re.escape(os.path.join(path, wrong))}, which does not hold it",
        load_hf,
        path,
    )
    json.dump({**content, "weight_map": {**weight_map, name: "model-missing.safetensors"}}, open(index, "w"))
    with pytest.raises(FileNotFoundError, match="model-missing.safetensors"):
        load_hf(path)


def test_check_finite_names_the_tensor_and_file(tmp_path, target_params):
    path = _saved(tmp_path, target_params)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name][3, 5] = np.nan
    tensors[name][4, 0] = np.inf
    save_file(tensors, file)
    _, params = load_hf(path)  # off by default in the Python API
    assert np.isnan(np.asarray(params["layers"]["o_proj"][1, 3, 5]))
    text = _raises(
        f"tensor '{re.escape(name)}' in {re.escape(file)} holds 2 non-finite value", load_hf, path, check_finite=True
    )
    assert "first at index (3, 5)" in text
    tensors[name][3, 5] = tensors[name][4, 0] = 0.0  # a finite checkpoint passes the check
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
    tensors["model.norm.weight"][7] = np.inf
    save_file(tensors, file)
    _raises("tensor 'model.norm.weight' .* first at index \\(7,\\)", load_hf, path, check_finite=True)
    tensors["model.norm.weight"][7] = 1.0
    save_file(tensors, file)
    load_hf(path, check_finite=True)


def test_load_hf_keeps_the_stored_dtype_by_default(tmp_path, target_params):
    path = _saved(tmp_path / "f32", target_params, dtype=np.float32)
    _, params = load_hf(path)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(target_params["embed"], np.float32))
    for bf16 in (jnp.bfloat16, "bfloat16"):
        _, params = load_hf(path, dtype=bf16)
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    import ml_dtypes

    path = _saved(tmp_path / "bf16", target_params, dtype=ml_dtypes.bfloat16)
    _, params = load_hf(path)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    _, params = load_hf(path, dtype="auto")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
