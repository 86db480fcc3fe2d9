"""Named model configurations: one registry of frozen configs for the planner, the roofline, the benchmarks,
the experiments and the random tiny pair of the command line.

`PRESETS` maps a name to a zero-argument function returning a fresh frozen config (`Qwen3Config`,
`DeepSeekV3Config` or `DFlashConfig`); `preset(name)` calls it and names the known presets on a typo.
Presets backed by a file of `configs/` (HF config.json format) are read through the checkpoint
loader's own parser (`checkpoint.hf_config.parse_config`), so a file and its preset cannot disagree.
`PAIRS` names target + drafter presets that run together.

Sources: configs/README.md for the JSON files; the hand-written shapes below say where their numbers
come from. Variants (fewer layers, other taps) are `dataclasses.replace` of a preset at the call site.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable

from ddtree_jax.checkpoint.hf_config import parse_config
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config

ModelConfig = Qwen3Config | DeepSeekV3Config | DFlashConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

# the six taps of Kimi-K2.5-DFlash (target_layer_ids); a target's config.json names none (the parser
# picks `config.default_tapped_layers`)
K2_TAPS = (1, 12, 24, 35, 47, 58)
QWEN3_8B_TAPS = (1, 9, 17, 25, 33)


@functools.cache
def config_file(filename: str) -> ModelConfig:
    """The config of configs/`filename`, parsed as a checkpoint's config.json is (frozen, so cached)."""
    with open(os.path.join(CONFIG_DIR, filename)) as f:
        return parse_config(json.load(f))


def kimi_k2_6() -> DeepSeekV3Config:
    """The Kimi K2.6 text model (configs/kimi_k2_6.json: 61 layers, hidden 7168, 384 INT4 routed experts),
    tapped at Kimi-K2.5-DFlash's layers."""
    return dataclasses.replace(config_file("kimi_k2_6.json"), tapped_layers=K2_TAPS)


def kimi_k2_tiny() -> DeepSeekV3Config:
    """configs/kimi_k2_tiny.json: the K2 architecture at test size (3 layers, 16 experts in 4 groups)."""
    return config_file("kimi_k2_tiny.json")


def kimi_k2_5_dflash() -> DFlashConfig:
    """Kimi-K2.5-DFlash: 6 layers, hidden 7168, block 8, taps K2_TAPS, mask 163838.
    ASSUMED (the public card gives layers, hidden, block, taps and mask only): 64 heads, 8 KV heads, head_dim
    128, intermediate 18432. With these the drafter has 3.48e9 parameters = 6.48 GiB in bf16, the size
    public model lists give for the checkpoint (tests/analysis/test_memory.py checks the count)."""
    return DFlashConfig(
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=6,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        block_size=8,
        mask_token_id=163838,
        target_layers=K2_TAPS,
        rope_theta=50000.0,
        rope_type="yarn",
        rope_factor=64.0,
        rope_original_max_position=4096,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
    )


def kimi_k2_mesh_tiny() -> DeepSeekV3Config:
    """A 2-layer K2-shaped model whose heads (8) and experts (16) divide over an 8-device mesh (the CPU
    check of the multi-device runs; configs/kimi_k2_tiny.json has 4 heads)."""
    return DeepSeekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        num_heads=8,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        tapped_layers=(0, 1),
    )


def kimi_k2_mesh_tiny_dflash() -> DFlashConfig:
    """A 1-layer DFlash drafter of kimi_k2_mesh_tiny (hidden 64, 8 heads, block 8, mask = the last token)."""
    return DFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        block_size=8,
        mask_token_id=255,
        target_layers=(0, 1),
    )


def qwen3_8b() -> Qwen3Config:
    """Qwen3-8B (36 layers, hidden 4096, 32 query / 8 KV heads of 128), tapped as Qwen3-8B-DFlash-b16."""
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tapped_layers=QWEN3_8B_TAPS,
    )


def qwen3_8b_dflash_b16() -> DFlashConfig:
    """Qwen3-8B-DFlash-b16: 5 layers of Qwen3-8B's width, block 16, mask token 151669."""
    return DFlashConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=5,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        mask_token_id=151669,
        target_layers=QWEN3_8B_TAPS,
    )


def qwen3_tiny() -> Qwen3Config:
    """A random-weight smoke-test target: 4 layers, hidden 64, vocab 512."""
    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tapped_layers=(1, 2),
    )


def qwen3_tiny_dflash() -> DFlashConfig:
    """The 1-layer DFlash drafter of qwen3_tiny (block 8, mask = the last token of its 512)."""
    return DFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        mask_token_id=511,
        target_layers=(1, 2),
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "kimi-k2.6": kimi_k2_6,
    "kimi-k2-tiny": kimi_k2_tiny,
    "kimi-k2.5-dflash": kimi_k2_5_dflash,
    "kimi-k2-mesh-tiny": kimi_k2_mesh_tiny,
    "kimi-k2-mesh-tiny-dflash": kimi_k2_mesh_tiny_dflash,
    "qwen3-8b": qwen3_8b,
    "qwen3-8b-dflash-b16": qwen3_8b_dflash_b16,
    "qwen3-tiny": qwen3_tiny,
    "qwen3-tiny-dflash": qwen3_tiny_dflash,
}

# target + drafter presets that run together
PAIRS: dict[str, tuple[str, str]] = {
    "kimi-k2.6": ("kimi-k2.6", "kimi-k2.5-dflash"),
    "kimi-k2-mesh-tiny": ("kimi-k2-mesh-tiny", "kimi-k2-mesh-tiny-dflash"),
    "qwen3-8b": ("qwen3-8b", "qwen3-8b-dflash-b16"),
    "qwen3-tiny": ("qwen3-tiny", "qwen3-tiny-dflash"),
}


def preset(name: str) -> ModelConfig:
    """The config named `name` in PRESETS (ValueError listing the names otherwise)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"no model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def preset_pair(name: str) -> tuple[ModelConfig, DFlashConfig]:
    """(target config, drafter config) of the pair named `name` in PAIRS (ValueError listing the names)."""
    if not isinstance(name, str) or name not in PAIRS:
        raise ValueError(f"no preset pair {name!r}; pairs: {', '.join(sorted(PAIRS))}")
    target, drafter = PAIRS[name]
    return preset(target), preset(drafter)
