"""Tiny model configs shared by several test files (each defined once here; a test that needs a few other sizes
derives its config from one of these with dataclasses.replace, one that needs a different model keeps its own). The
tiny K2-shaped target of the sharding tests (DSV3_TINY's routing) is in tests/sharding/tiny_k2.py."""

import dataclasses

from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config

# 2 layers, both tapped: the implementation-switch tests (tests/models/test_attention_impls.py, test_matmul_impls.py)
QWEN3_TINY = Qwen3Config(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tapped_layers=(0, 1),
)

# hidden 16, default tapped layers: the checkpoint tests' target (tests/checkpoint)
QWEN3_CHECKPOINT = Qwen3Config(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rope_theta=10_000.0,
)

# q_lora, 16 routed experts in 4 groups (top-2 groups), 3 per token; default RoPE (tests/models/test_deepseek_v3.py
# adds YaRN to it)
DSV3_TINY = DeepSeekV3Config(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    num_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
)

# DSV3_TINY's widths and attention with 2 layers (1 dense, 1 MoE), 8 routed experts in 2 groups (top-1 group), 2 per
# token, routed scaling 2.5, both layers tapped: the implementation-switch tests (tests/models/test_attention_impls.py);
# tests/engine/test_generate.py gives it the engine tests' vocabulary and YaRN
DSV3_TWO_LAYER = dataclasses.replace(
    DSV3_TINY,
    num_layers=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    tapped_layers=(0, 1),
)


def tiny_drafter(mask_token_id: int, target_layers: tuple[int, ...], block_size: int, **rope) -> DFlashConfig:
    """A one-layer hidden-32 DFlash drafter (intermediate 40, 4 heads over 2 KV heads of 8) for a tiny target;
    rope: its RoPE fields (rope_theta, rope_type, ...), the DFlashConfig defaults where left out."""
    return DFlashConfig(
        hidden_size=32,
        intermediate_size=40,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layers=target_layers,
        **rope,
    )


def yarn_drafter(mask_token_id: int, target_layers: tuple[int, ...]) -> DFlashConfig:
    """The tiny drafter with YaRN RoPE (the Kimi drafters' kind: theta 50k, factor 4 over 16 positions), block 4,
    for a tiny DeepSeek-family target."""
    return tiny_drafter(
        mask_token_id,
        target_layers,
        4,
        rope_theta=50_000.0,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position=16,
    )
