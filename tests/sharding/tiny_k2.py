"""The tiny K2-shaped target of the sharding tests: absorbed MLA, 16 routed experts (INT4 in the fixture),
group-limited routing; and a DFlash drafter for it."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import DFlashConfig
from ddtree_jax.models import deepseek_v3
from ddtree_jax.sharding.rules import batch_sharding
from ddtree_jax.tree import ancestor_mask, build_tree
from tests.tiny_models import DSV3_TINY

# the shared tiny DeepSeek-V3 (tests/tiny_models.py) with a vocabulary of 64, 128-wide experts, routed scaling 2.5
# and layers 0 and 2 tapped
CONFIG = dataclasses.replace(
    DSV3_TINY, vocab_size=64, moe_intermediate_size=128, routed_scaling_factor=2.5, tapped_layers=(0, 2)
)
DRAFTER = DFlashConfig(
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    block_size=4,
    mask_token_id=63,
    target_layers=(0, 2),
)


def prefill_verify(params, mesh=None, *, in_mesh_context: bool = False, **impls):
    """(prefill logits, verify logits, verify features) of a fixed batch: 2 rows of 7 and 4 prompt tokens,
    then a 7-slot tree per row. With `mesh`, caches and inputs are split by batch over "data"; with
    `in_mesh_context` the calls also run under `jax.set_mesh(mesh)` (the manual regions' mesh).
    impls: prefill / verify keyword arguments (attn_impl, moe_impl)."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 7)), jnp.int32)
    lengths = jnp.asarray([7, 4], jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 64)) * 2).astype(np.float32), 6, jnp.asarray([3, 5], jnp.int32))
    cache = deepseek_v3.create_cache(CONFIG, 2, 24, jnp.float32)
    if mesh is not None:  # caches and inputs split by batch over "data"
        cache = jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh, a.ndim, 1 if a.ndim == 5 else 0)), cache)
        ids = jax.device_put(ids, batch_sharding(mesh, 2))
    context = jax.set_mesh(mesh) if in_mesh_context else contextlib.nullcontext()
    with context:
        pre, _, cache = jax.jit(lambda p, c, i, l: deepseek_v3.prefill(CONFIG, p, c, i, l, **impls))(
            params, cache, ids, lengths
        )
        ver, feats, _ = jax.jit(
            lambda p, c: deepseek_v3.tree_forward(CONFIG, p, c, tree.tokens, tree.depths, ancestor_mask(tree), **impls)
        )(params, cache)
    return pre, ver, feats
