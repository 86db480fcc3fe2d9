"""load_hf / save_hf round trips (single and sharded), config layouts, errors that name the tensor, Orbax."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import load_hf, parse_config, restore_orbax, save_hf, save_orbax
from ddtree_jax.config import DFlashConfig
from ddtree_jax.models import dflash, qwen3
from tests.tiny_models import QWEN3_CHECKPOINT, yarn_drafter

TARGET = QWEN3_CHECKPOINT
DRAFTER = DFlashConfig(
    hidden_size=16,
    intermediate_size=20,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    block_size=4,
    mask_token_id=39,
    target_layers=(0, 1),
    rope_theta=10_000.0,
)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.parametrize("shard", [None, 2000])
def test_target_round_trip(tmp_path, shard):
    params = qwen3.init_params(TARGET, jax.random.key(0), norm_jitter=0.1)
    save_hf(str(tmp_path), TARGET, params, max_shard_bytes=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config, loaded = load_hf(str(tmp_path), dtype=jnp.float32)
    assert config == TARGET
    _assert_same(params, loaded)
    ids = jnp.array([[1, 5, 7, 2]])
    np.testing.assert_array_equal(qwen3.forward_logits(TARGET, params, ids), qwen3.forward_logits(config, loaded, ids))


def test_drafter_round_trip(tmp_path):
    params = dflash.init_params(DRAFTER, 16, jax.random.key(1), norm_jitter=0.1)
    save_hf(str(tmp_path), DRAFTER, params, vocab_size=40)
    config, loaded = load_hf(str(tmp_path), dtype=jnp.float32)
    assert config == DRAFTER
    _assert_same(params, loaded)


def _hf_dict(**over):
    cfg = {
        "model_type": "qwen3",
        "vocab_size": 40,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
    }
    cfg.update(over)
    return cfg


def test_both_rope_layouts_and_drafter_defaults():
    old = parse_config(_hf_dict(rope_theta=10000.0, rope_scaling=None))
    new = parse_config(_hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    assert old == new == TARGET
    drafter = parse_config(
        _hf_dict(
            rope_theta=1e6,
            num_hidden_layers=5,
            num_target_layers=36,
            dflash_config={"mask_token_id": 151669},
            block_size=16,
            architectures=["DFlashDraftModel"],
        )
    )
    assert drafter.target_layers == (1, 9, 17, 25, 33) and drafter.block_size == 16 and drafter.mask_token_id == 151669


@pytest.mark.parametrize(
    "over,message",
    [
        (dict(model_type="llama", rope_theta=1.0), "unknown model_type 'llama'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope type 'yarn'"),
        (dict(rope_theta=1.0, attention_bias=True), "attention_bias"),
        (dict(rope_theta=1.0, dflash_config={"block_size": 16, "target_layer_ids": [0]}), "mask_token_id"),
        (
            dict(rope_theta=1.0, dflash_config={"block_size": 16, "mask_token_id": 3}),
            "target_layer_ids or num_target_layers",
        ),
    ],
)
def test_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        parse_config(_hf_dict(**over))


def test_bad_tensors_are_named(tmp_path):
    params = qwen3.init_params(TARGET, jax.random.key(2))
    save_hf(str(tmp_path), TARGET, params)
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)

    def rewrite(mutate):
        t = dict(tensors)
        mutate(t)
        save_file(t, file)

    rewrite(lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(str(tmp_path))
    rewrite(lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((3, 16), np.float32)))
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(3, 16\), expected \(8, 16\)"
    ):
        load_hf(str(tmp_path))
    rewrite(lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros((16,), np.float32)))
    with pytest.raises(ValueError, match="does not use.*q_proj.bias"):
        load_hf(str(tmp_path))
    os.remove(file)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(str(tmp_path))


def test_orbax_round_trip(tmp_path):
    params = qwen3.init_params(TARGET, jax.random.key(3), dtype=jnp.bfloat16)
    save_orbax(str(tmp_path / "ckpt"), params)
    _assert_same(params, restore_orbax(str(tmp_path / "ckpt"), like=params))


def test_deepseek_family_configs_in_both_layouts():
    """kimi_k25 wraps the text model in text_config; older configs use rope_scaling {type: yarn}."""
    text = json.loads(
        (pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_tiny" / "config.json").read_text()
    )
    newer = parse_config(text)
    older = dict(text)
    rope = older.pop("rope_parameters")
    older["rope_theta"] = rope.pop("rope_theta")
    older["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"}
    older["model_type"] = "kimi_k2"
    assert parse_config(older) == newer
    assert parse_config({"model_type": "kimi_k25", "text_config": older}) == newer
    assert newer.rope_type == "yarn" and newer.first_k_dense_replace == 1 and newer.n_group == 2
    with pytest.raises(ValueError, match="sigmoid scoring with noaux_tc"):
        parse_config({**text, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="text_config"):
        parse_config({"model_type": "kimi_k25"})


def test_kimi_style_yarn_drafter_loads_and_runs_on_the_deepseek_target(tmp_path):
    """A DFlash drafter directory in the Kimi-K2.5-DFlash config layout (model_type qwen3, older
    `rope_theta` + `rope_scaling: {type: yarn}` keys, `dflash_config` with target_layer_ids) loads with
    load_pair beside the HF-written DeepSeek-V3 fixture target, taps the layers it names, and the engine
    runs it: greedy DDTree and chain equal AR greedy (lossless for any drafter)."""
    from ddtree_jax.engine.run import load_pair, run

    target_dir = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_tiny"
    vocab, hidden = 97, 32
    drafter = yarn_drafter(vocab - 1, (0, 2))  # hidden_size 32 (= hidden)
    save_hf(
        str(tmp_path),
        drafter,
        dflash.init_params(drafter, hidden, jax.random.key(7), norm_jitter=0.1),
        vocab_size=vocab,
    )
    kimi_layout = {  # the key set of Kimi-K2.5-DFlash's config.json, at this tiny size
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 40,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50_000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "dflash_config": {"block_size": 4, "mask_token_id": vocab - 1, "target_layer_ids": [0, 2]},
    }
    (tmp_path / "config.json").write_text(json.dumps(kimi_layout))
    pair = load_pair(str(target_dir), str(tmp_path))
    assert pair.drafter.config == drafter
    assert pair.target_config.tapped_layers == (0, 2)
    prompts = [[5, 17, 3, 60, 2, 9], [41, 8]]
    common = dict(block_size=None, max_new_tokens=10, temperature=0.0)
    ar = run(pair, prompts, method="ar", budget=8, **common)["tokens"]
    assert run(pair, prompts, method="ddtree", budget=8, **common)["tokens"] == ar
    assert run(pair, prompts, method="chain", budget=8, **common)["tokens"] == ar


def test_a_second_save_into_the_directory_is_what_loads(tmp_path):
    """A sharded save then a single-file save (and the reverse): the first's index or file was left behind and the
    loader, which takes the index when there is one, read the old weights."""
    old = qwen3.init_params(TARGET, jax.random.key(0))
    new = qwen3.init_params(TARGET, jax.random.key(1))
    for first, second in ((2000, None), (None, 2000), (2000, 3000)):
        directory = str(tmp_path / f"{first}_{second}")
        save_hf(directory, TARGET, old, max_shard_bytes=first)
        save_hf(directory, TARGET, new, max_shard_bytes=second)
        _assert_same(new, load_hf(directory, dtype=jnp.float32)[1])


def test_a_load_dtype_must_be_floating_and_deepseek_saves_refuse_before_writing(tmp_path):
    save_hf(str(tmp_path / "q"), TARGET, qwen3.init_params(TARGET, jax.random.key(0)))
    for dtype in ("int32", "bool", jnp.int8):  # were cast: every weight zeros and ones
        with pytest.raises(ValueError, match="dtype must be 'auto' or a floating dtype"):
            load_hf(str(tmp_path / "q"), dtype=dtype)
    fixture = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_tiny"
    config, params = load_hf(str(fixture), dtype=jnp.float32)
    target = tmp_path / "dsv3"
    target.mkdir()
    (target / "config.json").write_text('{"keep": true}')
    with pytest.raises(NotImplementedError, match="save_hf for DeepSeek-V3"):  # was an AttributeError ...
        save_hf(str(target), config, params)
    assert json.loads((target / "config.json").read_text()) == {"keep": True}  # ... after emptying config.json


def test_the_kimi_k25_wrapper_layout_loads_its_text_model(tmp_path):
    """Kimi K2.5 / K2.6 checkpoints (KimiK25ForConditionalGeneration) store the text model under "language_model."
    beside a vision tower and a projector: the text model loads by its bare names, as from a plain DeepSeek-V3
    checkpoint (it failed: "lacks 187 tensor(s), first: 'lm_head.weight'"); the vision parts are left out."""
    fixture = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_tiny_int4"
    tensors = load_file(str(fixture / "model.safetensors"))
    wrapped = {f"language_model.{name}": value for name, value in tensors.items()}
    wrapped["vision_tower.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    wrapped["mm_projector.proj.0.weight"] = np.zeros((4, 4), np.float32)
    target = tmp_path / "k25"
    target.mkdir()
    save_file(wrapped, str(target / "model.safetensors"))
    text_config = json.loads((fixture / "config.json").read_text())
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
    }
    (target / "config.json").write_text(json.dumps(wrapper))
    want_config, want = load_hf(str(fixture), dtype=jnp.float32)
    got_config, got = load_hf(str(target), dtype=jnp.float32)
    assert got_config == want_config
    _assert_same(want, got)
