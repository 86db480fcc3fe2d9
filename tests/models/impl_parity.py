"""Shared by the implementation-switch tests: a prefill + tree verify of a fixed batch (2 rows of 9 and 3
prompt tokens, then a 7-slot tree) under each value of one switch (attn_impl, matmul_impl), and the
relative error used to compare them."""

import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import ancestor_mask, build_tree


def unpack_tree_mask(packed_mask, steps: int, capacity: int):
    """A `pack_tree_mask` result (words int32 [B, ceil(T / 32), S], kv_lengths [B]) back to bool [B, T, S], for the
    spies that stand in for the Mosaic MLA kernel (it reads the packing, not the mask's values)."""
    words, kv_lengths = packed_mask
    t = jnp.arange(steps)
    bits = (words[:, t // 32, :] >> (t % 32)[None, :, None]) & 1
    return (bits == 1) & (jnp.arange(capacity)[None, None, :] < kv_lengths[:, None, None])


def mla_kernel_twin(
    q_latent,
    q_rope,
    latent,
    rope_key,
    mask,
    *,
    scale,
    layer=None,
    packed_mask=None,
    up_weight=None,
    up_layer=None,
    up_offset=0,
    up_width=None,
):
    """What the Mosaic MLA kernel (`mla_tree_attention`) computes, for spies standing in for it off GPU: the layer
    `layer` of stacked caches, the packed mask handed in unpacked (the kernel reads the packing, not mask's values,
    so a wrong packing shows in the outputs), and with up_weight the layer `up_layer` of stacked weights applied as
    the merge's up-projection."""
    from ddtree_kernels.mla_attention_mgpu import mla_tree_attention_reference

    if layer is not None:
        latent, rope_key = latent[layer], rope_key[layer]
    seen = unpack_tree_mask(packed_mask, mask.shape[1], mask.shape[2])
    if up_weight is not None and up_layer is not None:
        up_weight = up_weight[up_layer]
    up = {} if up_weight is None else dict(up_weight=up_weight, up_offset=up_offset, up_width=up_width)
    return mla_tree_attention_reference(q_latent, q_rope, latent, rope_key, seen, scale=scale, **up)


def relerr(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def forward_by_impl(module, config, params, switch: str, impls=("xla", "pallas"), vocab: int = 50) -> dict:
    """{impl: (row 0's prefill logits, row 1's first 3, prefill features of row 0, verify logits, verify
    features)} with `switch`=impl passed to the model's prefill and verify."""
    rng = np.random.default_rng(1)
    prefix = jnp.asarray(rng.integers(0, vocab, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 3], jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, vocab)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    outs = {}
    for impl in impls:
        cache = module.create_cache(config, 2, 32, jnp.float32)
        pre, pre_feats, cache = module.prefill(config, params, cache, prefix, lengths, **{switch: impl})
        ver, feats, _ = module.tree_forward(
            config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), **{switch: impl}
        )
        outs[impl] = (pre[0], pre[1, :3], pre_feats[0], ver, feats)
    return outs
