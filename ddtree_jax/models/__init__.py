"""Models: shared layers, attention, the Qwen3 and DeepSeek-V3 targets (MoE in moe), the DFlash drafter, the
path-conditioned child head, KV caches."""

from ddtree_jax.config import DeepSeekV3Config, Qwen3Config
from ddtree_jax.models import child_head, deepseek_v3, dflash, moe, qwen3
from ddtree_jax.models.attention import ATTENTION_IMPLS, attention
from ddtree_jax.models.cache import KVCache, commit, gather_accepted


def target_module(config):
    """The module implementing a target config's interface: create_cache, prefill, tree_forward, forward_logits,
    embedding, head (Qwen3Config -> qwen3, DeepSeekV3Config -> deepseek_v3)."""
    if isinstance(config, Qwen3Config):
        return qwen3
    if isinstance(config, DeepSeekV3Config):
        return deepseek_v3
    raise ValueError(f"no target model for config type {type(config).__name__}")


__all__ = [
    "qwen3",
    "deepseek_v3",
    "moe",
    "dflash",
    "child_head",
    "attention",
    "ATTENTION_IMPLS",
    "KVCache",
    "commit",
    "gather_accepted",
    "target_module",
]
