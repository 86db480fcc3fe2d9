"""The named model presets: one registry, JSON-backed presets read through the checkpoint parser, pairs that
fit together, and a clear error on an unknown name."""

import dataclasses
import json
import pathlib

import pytest

from ddtree_jax import presets
from ddtree_jax.checkpoint import parse_config
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.engine.run import check_configs, random_tiny_pair

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_builds_a_frozen_config(name):
    config = presets.preset(name)
    assert isinstance(config, (Qwen3Config, DeepSeekV3Config, DFlashConfig))
    assert config == presets.preset(name)  # a fresh, equal config per call
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1


def test_json_presets_are_the_config_files():
    for name, filename in (("kimi-k2-tiny", "kimi_k2_tiny.json"), ("kimi-k2.6", "kimi_k2_6.json")):
        parsed = parse_config(json.loads((CONFIGS / filename).read_text()))
        config = presets.preset(name)
        assert dataclasses.replace(parsed, tapped_layers=config.tapped_layers) == config, name
    assert presets.preset("kimi-k2-tiny") == parse_config(json.loads((CONFIGS / "kimi_k2_tiny.json").read_text()))


@pytest.mark.parametrize("name", sorted(presets.PAIRS))
def test_pairs_fit_together(name):
    target, drafter = presets.preset_pair(name)
    assert isinstance(drafter, DFlashConfig) and not isinstance(target, DFlashConfig)
    check_configs(target, drafter)  # hidden sizes, mask token inside the vocabulary, taps inside the target
    assert drafter.target_layers == target.tapped_layers


def test_unknown_names_list_the_presets():
    with pytest.raises(ValueError, match=r"no model preset 'qwen3-9b'; presets: .*qwen3-8b"):
        presets.preset("qwen3-9b")
    with pytest.raises(ValueError, match=r"no preset pair 'k2'; pairs: .*kimi-k2.6"):
        presets.preset_pair("k2")
    with pytest.raises(ValueError, match=r"no model preset \['x'\]"):  # not a string (unhashable): same error
        presets.preset(["x"])
    with pytest.raises(ValueError, match=r"no preset pair \['x'\]"):
        presets.preset_pair(["x"])


def test_the_random_tiny_pair_is_the_tiny_preset():
    pair = random_tiny_pair(0)
    assert (pair.target_config, pair.drafter.config) == presets.preset_pair("qwen3-tiny")
    other = random_tiny_pair(0, vocab=300)
    assert other.target_config.vocab_size == 300 and other.drafter.config.mask_token_id == 299
