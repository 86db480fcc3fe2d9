"""The one attention entry point of the models, with an `impl` switch: "xla"
(`ddtree_kernels.tree_attention.attention_reference`, the whole score matrix at once), "blockwise"
(`blockwise_attention`: the same in XLA with an online softmax over key blocks, for long prefills),
"pallas" (`ddtree_kernels.tree_attention`: flash-decoding over the cache, streaming only the keys a row
can see; interpret mode off GPU) or "auto" (`dispatch.attention_impl`)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ddtree_jax import dispatch
from ddtree_jax.dispatch import ATTENTION_IMPLS, BLOCKWISE_KEYS
from ddtree_jax.models.layers import LayerOf
from ddtree_jax.sharding.regions import heads, rows, shard_call
from ddtree_jax.sharding.rules import MODEL, partition_spec
from ddtree_kernels.gqa_attention_mgpu import gqa_tree_attention
from ddtree_kernels.head_projections import absorb
from ddtree_kernels.mla_attention_mgpu import BLOCK_KV as MLA_BLOCK_KV
from ddtree_kernels.mla_attention_mgpu import PackedTreeMask, mla_tree_attention, pack_tree_mask
from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention
from ddtree_kernels.tiling import dot_precision
from ddtree_kernels.tree_attention import attention_reference, tree_attention

__all__ = [
    "ATTENTION_IMPLS",
    "BLOCKWISE_KEYS",
    "attention",
    "blockwise_attention",
    "pack_tree_mask",
    "sharded_causal_attention",
    "sharded_mla_attention",
    "sharded_tree_attention",
]


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    block: int = BLOCKWISE_KEYS,
    expand=None,
) -> jax.Array:
    """`attention_reference` computed flash-style in XLA: a `lax.scan` over blocks of `block` keys with an
    online softmax (running max and sum per query), so the float32 scores alive at once are
    [B, Hkv, G, T, block] instead of [B, Hkv, G, T, S]: a long prefill's memory grows with T x block, not
    T x S. Same arguments and result as `attention_reference` (a row with no visible key yields zeros);
    equal to it up to float rounding (the softmax is normalised after the value product, not before).

    q: [B, T, Hq, Dk]; k: [B, S, Hkv, Dk]; v: [B, S, Hkv, Dv]; mask: bool [B, T, S]. Returns [B, T, Hq, Dv]
    in q's dtype. expand (optional): (k_block [B, block, ...], v_block) -> (keys [B, block, Hkv', Dk],
    values [B, block, Hkv', Dv]) applied to each block inside the scan, so keys derived from a compact
    cache (the expanded MLA form: per-head keys and values from the latent) exist one block at a time.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    batch, steps, q_heads, head_dim = q.shape
    keys = k.shape[1]
    block = min(block, keys)
    if expand is None:
        expand = lambda k_block, v_block: (k_block, v_block)  # noqa: E731
    k_shape, v_shape = jax.eval_shape(expand, k[:, :block], v[:, :block])
    kv_heads, value_dim = k_shape.shape[2], v_shape.shape[-1]
    group = q_heads // kv_heads
    blocks = -(-keys // block)
    pad = blocks * block - keys
    if pad:  # padded keys are masked out
        k = jnp.pad(k, ((0, 0), (0, pad)) + ((0, 0),) * (k.ndim - 2))
        v = jnp.pad(v, ((0, 0), (0, pad)) + ((0, 0),) * (v.ndim - 2))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    precision = dot_precision(q.dtype)
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, steps, kv_heads, group, head_dim)
    k_blocks = k.reshape(batch, blocks, block, *k.shape[2:]).swapaxes(0, 1)  # [n, B, block, ...]
    v_blocks = v.reshape(batch, blocks, block, *v.shape[2:]).swapaxes(0, 1)
    mask_blocks = mask.reshape(batch, steps, blocks, block).transpose(2, 0, 1, 3)  # [n, B, T, block]

    def one_block(carry, xs):
        acc, row_max, row_sum = carry  # acc f32 [B, Hkv, G, T, Dv]; row_max, row_sum f32 [B, Hkv, G, T]
        k_block, v_block, visible = xs
        k_block, v_block = expand(k_block, v_block)  # [B, block, Hkv, Dk], [B, block, Hkv, Dv]
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_block, preferred_element_type=jnp.float32, precision=precision)
        scores = jnp.where(visible[:, None, None, :, :], scores * scale, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.exp(scores - safe[..., None])  # 0 for hidden keys
        correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max - safe, -jnp.inf))
        acc = acc * correction[..., None] + jnp.einsum(
            "bkgts,bskd->bkgtd",
            weights.astype(v_block.dtype),
            v_block,
            preferred_element_type=jnp.float32,
            precision=precision,
        )
        return (acc, new_max, row_sum * correction + jnp.sum(weights, axis=-1)), None

    init = (
        jnp.zeros((batch, kv_heads, group, steps, value_dim), jnp.float32),
        jnp.full((batch, kv_heads, group, steps), -jnp.inf, jnp.float32),
        jnp.zeros((batch, kv_heads, group, steps), jnp.float32),
    )
    (acc, _, row_sum), _ = jax.lax.scan(one_block, init, (k_blocks, v_blocks, mask_blocks))
    out = acc / jnp.maximum(row_sum, 1e-30)[..., None]  # rows that see no key: 0 / 1e-30 = 0
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, q_heads, value_dim).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    impl: str = "xla",
    causal_start: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, Hq, Dk] queries; k: [B, S, Hkv, Dk] keys; v: [B, S, Hkv, Dv] values (Hq a multiple of Hkv).
      mask: bool [B, T, S], True where query t may attend key s. A row with no True entry yields zeros.
      scale: softmax scale (default 1 / sqrt(Dk)).
      causal_start: int32 [B] or None. Given, the caller states that mask[b, t, s] == (s <= causal_start[b] + t)
        (a causal prefill chunk at that offset), and the call may run on the causal flash-attention kernel
        (`dispatch.prefill_attention_kernel`), which reads only the keys below the diagonal.
    Returns:
      [B, T, Hq, Dv] in q's dtype (softmax in float32; float32 inputs at float32).
    Head dims that are not powers of two fall back to "xla" under "pallas" (split keys into parts and call
    `ddtree_kernels.tree_attention` directly, as the absorbed MLA does).
    """
    if causal_start is not None:
        kernel = dispatch.prefill_attention_kernel(
            impl,
            queries=q.shape[1],
            keys=k.shape[1],
            key_dim=q.shape[-1],
            value_dim=v.shape[-1],
            bfloat16=all(x.dtype == jnp.bfloat16 for x in (q, k, v)),
        )
        if kernel == "mosaic":
            return sharded_causal_attention(q, k, v, causal_start, scale=scale)
    choice = dispatch.attention_impl(
        impl,
        queries=q.shape[1],
        keys=k.shape[1],
        group=q.shape[2] // k.shape[2],
        float32=q.dtype == jnp.float32 or k.dtype == jnp.float32,
    )
    if choice == "pallas" and all(d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1])):
        bfloat16 = all(x.dtype == jnp.bfloat16 for x in (q, k, v))
        kernel = dispatch.gqa_attention_kernel(
            queries=q.shape[1], keys=k.shape[1], head_dim=q.shape[-1], value_dim=v.shape[-1], bfloat16=bfloat16
        )
        if kernel == "mosaic":
            return sharded_gqa_attention(q, k, v, mask, scale=scale)
        return sharded_tree_attention((q,), (k,), v, mask, scale=scale)
    if choice == "blockwise":
        return blockwise_attention(q, k, v, mask, scale=scale)
    return attention_reference(q, k, v, mask, scale=scale)


def sharded_tree_attention(q_parts, k_parts, v: jax.Array | None, mask: jax.Array, *, scale: float | None) -> jax.Array:
    """`ddtree_kernels.tree_attention`, per shard when a mesh is set (`sharding.regions`): batch over "data",
    query heads over "model" with their KV heads (a single shared KV head, MQA / absorbed MLA, is
    replicated). A kernel call XLA cannot partition would otherwise run whole on every device.
    v None: the values are key part 0 (absorbed MLA's latent)."""
    kv = heads(4) if k_parts[0].shape[2] > 1 else rows(4)
    if v is None:
        specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), rows(3))
        return shard_call(
            lambda q, k, m: tree_attention(q, k, None, m, scale=scale),
            (tuple(q_parts), tuple(k_parts), mask),
            specs,
            heads(4),
        )
    specs = (tuple(heads(4) for _ in q_parts), tuple(kv for _ in k_parts), kv, rows(3))
    return shard_call(partial(tree_attention, scale=scale), (tuple(q_parts), tuple(k_parts), v, mask), specs, heads(4))


def sharded_gqa_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None
) -> jax.Array:
    """`gqa_attention_mgpu.gqa_tree_attention` (q [B, T, Hq, D], k / v [B, S, Hkv, D] bf16, mask bool [B, T, S]
    -> [B, T, Hq, D]), per shard when a mesh is set: batch over "data", query heads over "model" with their KV
    heads (a single KV head, MQA, is replicated; `dispatch.gqa_attention_kernel` says when it runs)."""
    kv = heads(4) if k.shape[2] > 1 else rows(4)
    return shard_call(
        lambda q, k, v, m: gqa_tree_attention(q, k, v, m, scale=scale),
        (q, k, v, mask),
        (heads(4), kv, kv, rows(3)),
        heads(4),
    )


@dataclasses.dataclass(frozen=True)
class HeadRows:
    """Each head's rows offset .. + width of a head-major weight [H x stride, R] in HF's [out, in] layout (head h's
    rows h x stride + offset ..), as absorbed MLA's W_UK (offset 0, width nope) and W_UV (offset nope, width v) lie
    in DeepSeek-V3's kv_b_proj; weight may be a `LayerOf` of every layer's stack (read in place by the kernels of
    `ddtree_kernels.head_projections`; its axes, kv_b_proj's logical axes, give its spec under a mesh)."""

    weight: jax.Array | LayerOf
    offset: int
    width: int

    def operands(self) -> tuple[tuple, tuple]:
        """(weight, layer int32 []) and their specs under a mesh: the weight's rows split over "model" with their
        heads (the rule table's "out" axis); an unstacked weight's layer is 0 (unused)."""
        stacked = isinstance(self.weight, LayerOf)
        weight, layer = (self.weight.stack, self.weight.layer) if stacked else (self.weight, 0)
        out_axis = partition_spec(self.weight.axes, "tp")[0] if stacked and self.weight.axes is not None else MODEL
        spec = PartitionSpec(None, out_axis, None) if stacked else PartitionSpec(out_axis, None)
        return (weight, jnp.asarray(layer, jnp.int32)), (spec, PartitionSpec())


def sharded_absorb(q: jax.Array, rows: HeadRows, *, q_width: int) -> jax.Array:
    """`head_projections.absorb` per shard: q [B, T, H, Dq] (its first rows.width values a head: absorbed MLA's
    q_nope, read from the whole query in place) times each head's weight rows -> [B, T, H, q_width] in q's dtype
    (q_width: the weight's columns, kv_lora_rank). Batch over "data", heads over "model" with their weight rows."""
    (weight, layer), weight_specs = rows.operands()

    def per_shard(q, weight, layer):
        batch, steps, heads, dim = q.shape
        out = absorb(
            q.reshape(batch, steps * heads, dim),
            weight,
            layer if weight.ndim == 3 else None,
            heads=heads,
            q_offset=0,
            width=rows.width,
            w_offset=rows.offset,
        )
        return out.reshape(batch, steps, heads, q_width)

    return shard_call(per_shard, (q, weight, layer), (heads(4),) + weight_specs, heads(4))


def sharded_mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    rope_key: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    packed_mask: PackedTreeMask | None = None,
    up: HeadRows | None = None,
) -> jax.Array:
    """Absorbed-MLA attention on a kernel (attn_impl "pallas"), per shard when a mesh is set: queries
    q_latent [B, T, H, R], q_rope [B, T, H, P] against the shared latent cache [B, S, 1, R] and rope keys
    [B, S, 1, P], values the latent; mask bool [B, T, S] -> [B, T, H, R] in q_latent's dtype. With `layer`
    the caches are every layer's, [L, B, S, 1, ...], and layer `layer` is attended: the Mosaic kernel reads
    it in place (no copy of the layer's cache a call) where S is whole key blocks, else it is sliced out
    first. packed_mask: `pack_tree_mask(mask)`, packed once by a caller that attends under one mask in every
    layer (the Mosaic kernel reads it instead of packing mask again). The kernel is
    `dispatch.mla_attention_kernel`'s: the Mosaic GPU kernel on GPU for bf16 at R = 512,
    P = 64 (its schedule: `dispatch.MLA_SCHEDULE`), the Triton kernel otherwise. up (Mosaic kernel only): each
    head's up-projection applied in the kernel's split merge -> [B, T, H, up.width] (`HeadRows`)."""
    dtype = q_latent.dtype
    bfloat16 = all(x.dtype == jnp.bfloat16 for x in (q_latent, q_rope, latent, rope_key))
    mosaic = dispatch.mla_attention_kernel(bfloat16=bfloat16, dims=(q_latent.shape[-1], q_rope.shape[-1])) == "mosaic"
    if up is not None and not mosaic:
        raise ValueError("up= (W_UV in the split merge) needs the Mosaic MLA kernel (`dispatch.mla_attention_kernel`)")
    if layer is not None and not (mosaic and latent.shape[2] % MLA_BLOCK_KV == 0):
        latent, rope_key = (jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in (latent, rope_key))
        layer = None
    if not mosaic:
        return sharded_tree_attention(
            (q_latent, q_rope.astype(dtype)), (latent.astype(dtype), rope_key.astype(dtype)), None, mask, scale=scale
        )
    cache_spec = rows(4) if layer is None else PartitionSpec(None, *rows(4))  # stacks [L, B, S, 1, ...]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    words, kv_lengths = pack_tree_mask(mask) if packed_mask is None else packed_mask
    args = (q_latent, q_rope, latent, rope_key, mask, words, kv_lengths, layer)
    specs = (heads(4), heads(4), cache_spec, cache_spec, rows(3), rows(3), rows(1), PartitionSpec())
    if up is not None:
        up_args, up_specs = up.operands()
        args, specs = args + up_args, specs + up_specs

    def per_shard(ql, qr, lat, rk, m, w, n, i, *up_args):
        packed = PackedTreeMask(w, n)
        extra = {}
        if up_args:
            weight, up_layer = up_args
            extra = dict(
                up_weight=weight,
                up_layer=up_layer if weight.ndim == 3 else None,
                up_offset=up.offset,
                up_width=up.width,
            )
        return mla_tree_attention(
            ql,
            qr,
            lat,
            rk,
            m,
            scale=scale,
            layer=i if lat.ndim == 5 else None,
            packed_mask=packed,
            **dispatch.mla_schedule_options(),
            **extra,
        )

    return shard_call(per_shard, args, specs, heads(4))


def sharded_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, *, scale: float | None
) -> jax.Array:
    """`prefill_attention_mgpu.causal_prefill_attention` (q [B, T, Hq, Dk], k [B, S, Hkv, Dk], v [B, S, Hkv, Dv],
    start int32 [B]: key s visible to query t iff s <= start[b] + t), per shard when a mesh is set: batch
    over "data", query heads over "model" with their KV heads. 128-key blocks where S allows (the engine's
    caches are whole 128-row blocks) and the key dim fits them, else 64."""
    block_kv = 128 if k.shape[1] % 128 == 0 and q.shape[-1] <= 128 else 64
    kv = heads(4) if k.shape[2] > 1 else rows(4)
    return shard_call(
        lambda q, k, v, start: causal_prefill_attention(q, k, v, start, scale=scale, block_kv=block_kv),
        (q, k, v, start),
        (heads(4), kv, kv, rows(1)),
        heads(4),
    )
