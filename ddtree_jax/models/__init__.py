"""Models: shared layers and attention, the Qwen3 target, the DFlash drafter, KV caches."""

from ddtree_jax.models import dflash, qwen3
from ddtree_jax.models.attention import ATTENTION_IMPLS, attention
from ddtree_jax.models.cache import KVCache, commit, gather_accepted

__all__ = ["qwen3", "dflash", "attention", "ATTENTION_IMPLS", "KVCache", "commit", "gather_accepted"]
