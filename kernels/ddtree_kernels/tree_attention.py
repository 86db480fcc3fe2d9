"""Tree-verify attention: N tree queries per row against the row's cache (prefix + the tree's own slots).

  out[b, t, h] = softmax_s(scale * sum_p q_p[b, t, h] . k_p[b, s, h // G]  where mask[b, t, s]) @ v[b, s, h // G]

One kernel serves both target families:
  GQA (Qwen3)       parts ((q,), (k,)), v: Hq query heads over Hkv KV heads, head_dim 128.
  absorbed MLA      parts ((q_latent, q_rope), (latent, rope_key)), v = latent: one shared KV head,
  (K2.6 / DSV3)     scores over 512 + 64 dims, values the 512-dim latent; passing the two key parts
                    separately avoids materialising [latent ; rope] (a full cache copy per layer).

The mask is the models' dense bool [B, T, S] (prefix visible, tree slots under the ancestor mask);
reading it costs T bytes per key against >= 1 KB of K/V. `kv_lengths` [B] bounds the keys a row can
see (default: one past the last visible key of any of its queries), so a large, mostly empty cache
is not streamed.

Kernel (Triton lowering via `pl.pallas_call`; interpret mode on CPU): flash-decoding. Grid (B, KV head,
row block, key split): the G query heads x T tree queries of a KV head form G * T rows; each program
takes BM of them against one split of the keys, in blocks of BS keys, with an online softmax, and
writes (unnormalised output, running max, running sum); XLA merges the splits by log-sum-exp. Splits
are sized so that the grid fills the GPU even at B = 1 with one KV head. Tiling (`BlockConfig`: keys
per block, warps, pipeline stages) defaults to the largest that fits the shared memory
(`default_block_config`; the fixed tiling of the first version asked the H200 for 353 KB at the MLA
shape, against 227 KB, and did not launch). Absorbed MLA passes v=None, so the latent block is read from
memory once for both products (Triton still stages it twice in shared memory: the value product needs
another operand layout).

`tree_attention_reference` is the twin: `attention_reference` (plain XLA GQA attention, which the models
run as their "xla" attention) over the concatenated parts. Precision: float32 inputs at float32 in both
(`tiling`); the shared-memory estimate counts the inputs' element size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_kernels.tiling import TARGET_PROGRAMS, default_interpret, dot_precision

MAX_BLOCK_M = 64  # query rows per program
SMEM_BUDGET = 224 * 1024  # bytes a program may plan for: the H200 allows 232,448; the estimate is within 2 KB
# (keys per inner block, pipeline stages), best first; the first whose tiles fit SMEM_BUDGET is the default.
# Order from `benchmarks/bench_attention.py --sweep` on the H200 (N = 17, 32k context, B = 1): GQA best at
# (64, 2); absorbed MLA, where (64, 2) does not fit, best at (64, 1) with 8 warps (BENCHMARKS.md).
BLOCK_CHOICES = ((64, 2), (64, 1), (32, 2), (32, 1), (16, 1))


class BlockConfig(NamedTuple):
    """Static tiling of one kernel launch: keys per inner block, Triton warps and pipeline stages."""

    block_s: int
    num_warps: int
    num_stages: int


def shared_memory_bytes(block_m: int, key_dims, value_dim: int, config: BlockConfig, itemsize: int = 2) -> int:
    """Planned shared memory of a program: its query tile plus `num_stages` key and value tiles, of
    `itemsize`-byte elements (2: bf16; 4: float32). The value tile counts also when the values are key
    part 0: Triton stages it separately for the second product. For bf16, within 2 KB of what Triton
    asked the H200 for in every case measured (BENCHMARKS.md, "Attention")."""
    return itemsize * (block_m * sum(key_dims) + config.num_stages * config.block_s * (sum(key_dims) + value_dim))


def default_block_config(block_m: int, key_dims, value_dim: int, itemsize: int = 2) -> BlockConfig:
    """The first of BLOCK_CHOICES whose tiles fit SMEM_BUDGET; 8 warps when the [BM, Dv] float32
    accumulator would exceed ~128 registers a thread with 4 (absorbed MLA: Dv = 512)."""
    num_warps = 8 if block_m * value_dim / (4 * 32) > 128 else 4  # accumulator floats per thread at 4 warps
    for block_s, stages in BLOCK_CHOICES:
        config = BlockConfig(block_s, num_warps, stages)
        if shared_memory_bytes(block_m, key_dims, value_dim, config, itemsize) <= SMEM_BUDGET:
            return config
    return BlockConfig(16, num_warps, 1)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _attention_kernel(
    len_ref,
    mask_ref,
    *refs,
    num_parts: int,
    t_pad: int,
    block_m: int,
    block_s: int,
    split_size: int,
    scale: float,
    values_from_keys: bool,
    precision,
):
    # len_ref: i32 [B] keys visible per row (kv_lengths); mask_ref: i8 [T_pad, S] this row's mask
    # q parts: [BM, D_p] this program's query rows (row r = g * T_pad + t); k parts: [S, D_p] of this KV head;
    # v_ref: [S, Dv] (absent when values_from_keys: the values are key part 0, loaded once for both products);
    # outputs: acc f32 [BM, Dv], m f32 [BM], l f32 [BM]
    q_refs, k_refs = refs[:num_parts], refs[num_parts : 2 * num_parts]
    v_ref = None if values_from_keys else refs[2 * num_parts]
    acc_ref, m_ref, l_ref = refs[2 * num_parts + (0 if values_from_keys else 1) :]
    b, row_block, split = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_len = jnp.clip(len_ref[b], 0, k_refs[0].shape[0])  # a length past S reads no key past the cache
    s_start = split * split_size
    s_stop = jnp.minimum(s_start + split_size, kv_len)
    num_blocks = jnp.maximum(pl.cdiv(s_stop - s_start, block_s), 0)
    queries = [q_ref[...] for q_ref in q_refs]
    first_t = (row_block * block_m) % t_pad
    dv = (k_refs[0] if values_from_keys else v_ref).shape[-1]

    def body(i, carry):
        acc, m, l = carry
        s0 = s_start + i * block_s
        cols = s0 + jnp.arange(block_s)
        live = cols < s_stop
        scores = jnp.zeros((block_m, block_s), jnp.float32)
        key_blocks = []
        for q, k_ref in zip(queries, k_refs):
            k = plgpu.load(k_ref.at[pl.ds(s0, block_s), :], mask=live[:, None], other=0.0)
            key_blocks.append(k)
            scores += lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
        if block_m >= t_pad:  # the block holds whole groups: repeat the [T_pad, BS] mask per group
            tile = plgpu.load(mask_ref.at[:, pl.ds(s0, block_s)], mask=live[None, :], other=0)
            visible = jnp.broadcast_to(tile[None], (block_m // t_pad, t_pad, block_s)).reshape(block_m, block_s)
        else:  # the block is part of one group: its rows are queries first_t .. first_t + BM
            visible = plgpu.load(mask_ref.at[pl.ds(first_t, block_m), pl.ds(s0, block_s)], mask=live[None, :], other=0)
        visible = (visible != 0) & live[None, :]
        scores = jnp.where(visible, scores * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
        p = jnp.exp(scores - safe[:, None])  # exp(-inf) = 0 for hidden keys
        correction = jnp.exp(jnp.where(m > -jnp.inf, m - safe, -jnp.inf))
        v = (
            key_blocks[0]
            if values_from_keys
            else plgpu.load(v_ref.at[pl.ds(s0, block_s), :], mask=live[:, None], other=0.0)
        )
        acc = acc * correction[:, None] + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return acc, m_new, l * correction + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((block_m, dv), jnp.float32),
        jnp.full((block_m,), -jnp.inf, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(0, num_blocks, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def block_rows(group: int, steps: int) -> int:
    """Query rows per program: the G query heads x T tree queries of a KV head, padded, at most MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, max(16, group * _pow2(steps)))


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _tree_attention(q_parts, k_parts, v, mask, kv_lengths, *, scale: float, config: BlockConfig, interpret: bool):
    values_from_keys = v is None
    batch, steps, q_heads, _ = q_parts[0].shape
    capacity, kv_heads = k_parts[0].shape[1], k_parts[0].shape[2]
    dv = (k_parts[0] if values_from_keys else v).shape[-1]
    group = q_heads // kv_heads
    t_pad = _pow2(steps)
    rows = group * t_pad
    block_m = block_rows(group, steps)
    block_s = config.block_s
    rows_pad = pl.cdiv(rows, block_m) * block_m
    row_blocks = rows_pad // block_m
    splits = max(1, min(pl.cdiv(TARGET_PROGRAMS, batch * kv_heads * row_blocks), pl.cdiv(capacity, block_s)))
    split_size = pl.cdiv(pl.cdiv(capacity, splits), block_s) * block_s
    splits = pl.cdiv(capacity, split_size)

    def arrange(q):  # [B, T, Hq, D] -> [B, Hkv, rows_pad, D], row = g * T_pad + t
        d = q.shape[-1]
        q = q.reshape(batch, steps, kv_heads, group, d).transpose(0, 2, 3, 1, 4)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, t_pad - steps), (0, 0))).reshape(batch, kv_heads, rows, d)
        return jnp.pad(q, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))

    queries = [arrange(q) for q in q_parts]
    mask_i8 = jnp.pad(mask.astype(jnp.int8), ((0, 0), (0, t_pad - steps), (0, 0)))
    q_specs = [pl.BlockSpec((None, None, block_m, q.shape[-1]), lambda b, h, r, s: (b, h, r, 0)) for q in queries]
    k_specs = [pl.BlockSpec((None, capacity, None, k.shape[-1]), lambda b, h, r, s: (b, 0, h, 0)) for k in k_parts]
    v_spec = pl.BlockSpec((None, capacity, None, dv), lambda b, h, r, s: (b, 0, h, 0))
    out_part = lambda *tail: pl.BlockSpec(
        (None, None, None, block_m) + tail,  # noqa: E731
        lambda b, h, r, s: (b, h, s, r) + (0,) * len(tail),
    )
    kernel = functools.partial(
        _attention_kernel,
        num_parts=len(q_parts),
        t_pad=t_pad,
        block_m=block_m,
        block_s=block_s,
        split_size=split_size,
        scale=scale,
        values_from_keys=values_from_keys,
        precision=dot_precision(q_parts[0].dtype),
    )
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, row_blocks, splits),
        in_specs=[
            pl.BlockSpec((batch,), lambda *_: (0,)),
            pl.BlockSpec((None, t_pad, capacity), lambda b, h, r, s: (b, 0, 0)),
        ]
        + q_specs
        + k_specs
        + ([] if values_from_keys else [v_spec]),
        out_specs=[out_part(dv), out_part(), out_part()],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(kv_lengths.astype(jnp.int32), mask_i8, *queries, *k_parts, *([] if values_from_keys else [v]))
    # log-sum-exp merge of the key splits; rows that see no key come out zero (as the reference)
    top = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.where(m > -jnp.inf, jnp.exp(m - jnp.where(top > -jnp.inf, top, 0.0)), 0.0)
    total = jnp.sum(l * weight, axis=2)
    out = jnp.sum(acc * weight[..., None], axis=2) / jnp.maximum(total, 1e-30)[..., None]
    out = out[:, :, :rows].reshape(batch, kv_heads, group, t_pad, dv)[:, :, :, :steps]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, q_heads, dv).astype(q_parts[0].dtype)


def visible_lengths(mask: jax.Array) -> jax.Array:
    """int32 [B]: one past the last key any query of the row may see (0 if none)."""
    keys = jnp.arange(mask.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(mask, keys + 1, 0), axis=(1, 2)).astype(jnp.int32)


def tree_attention(
    q_parts,
    k_parts,
    v: jax.Array | None,
    mask: jax.Array,
    *,
    scale: float | None = None,
    kv_lengths: jax.Array | None = None,
    config: BlockConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of T queries per row over S cached keys, scores summed over key parts.

    Args:
      q_parts: tuple of [B, T, Hq, D_p] query parts (GQA: one; MLA: latent and rope parts);
      k_parts: the matching key parts [B, S, Hkv, D_p] (Hq a multiple of Hkv); every D_p a power of two.
      v: [B, S, Hkv, Dv] values, or None: the values are key part 0 (absorbed MLA: the latent), read
        once per key block for both products.
      mask: bool [B, T, S].
      scale: softmax scale (default 1 / sqrt(sum of D_p)); kv_lengths: int32 [B] (clipped to [0, S]), keys >= it are
        neither read nor seen (default `visible_lengths(mask)`).
      config: the launch's tiling (default `default_block_config`, sized to the shared memory).
    Returns:
      [B, T, Hq, Dv] in the queries' dtype (softmax and sums in float32); rows with no visible key are 0.
    """
    q_parts, k_parts = tuple(q_parts), tuple(k_parts)
    if not q_parts or len(q_parts) != len(k_parts):
        raise ValueError(f"need matching query and key parts, got {len(q_parts)} and {len(k_parts)}")
    batch, steps, q_heads, _ = q_parts[0].shape
    capacity, kv_heads = k_parts[0].shape[1], k_parts[0].shape[2]
    for q, k in zip(q_parts, k_parts):
        if (
            q.shape[:3] != (batch, steps, q_heads)
            or k.shape[:3] != (batch, capacity, kv_heads)
            or q.shape[-1] != k.shape[-1]
        ):
            raise ValueError(f"query part {q.shape} does not match key part {k.shape}")
        if q.shape[-1] & (q.shape[-1] - 1):
            raise ValueError(f"head dims must be powers of two (split the keys into parts), got {q.shape[-1]}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of KV heads {kv_heads}")
    if v is not None and v.shape[:3] != (batch, capacity, kv_heads):
        raise ValueError(f"values must be [B, S, Hkv, Dv] = ({batch}, {capacity}, {kv_heads}, .), got {v.shape}")
    if mask.shape != (batch, steps, capacity):
        raise ValueError(f"mask must be [B, T, S] = ({batch}, {steps}, {capacity}), got {mask.shape}")
    key_dims = tuple(q.shape[-1] for q in q_parts)
    value_dim = key_dims[0] if v is None else v.shape[-1]
    if config is None:
        config = default_block_config(
            block_rows(q_heads // kv_heads, steps), key_dims, value_dim, jnp.dtype(q_parts[0].dtype).itemsize
        )
    elif not isinstance(config, BlockConfig) or config.block_s & (config.block_s - 1) or config.block_s < 16:
        raise ValueError(f"config must be a BlockConfig with block_s a power of two >= 16, got {config!r}")
    scale = sum(key_dims) ** -0.5 if scale is None else float(scale)
    if kv_lengths is None:
        kv_lengths = visible_lengths(mask)
    elif jnp.shape(kv_lengths) != (batch,) or not jnp.issubdtype(jnp.result_type(kv_lengths), jnp.integer):
        raise ValueError(
            f"kv_lengths must be integers [B] = ({batch},), got shape {jnp.shape(kv_lengths)} of "
            f"{jnp.result_type(kv_lengths)}"
        )
    return _tree_attention(
        q_parts,
        k_parts,
        v,
        mask,
        kv_lengths,
        scale=scale,
        config=BlockConfig(*config),
        interpret=default_interpret(interpret),
    )


def attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """Grouped-query attention in plain XLA (the models' "xla" attention).

    Args:
      q: [B, T, Hq, Dk] queries; k: [B, S, Hkv, Dk] keys; v: [B, S, Hkv, Dv] values (Hq a multiple of Hkv).
      mask: bool [B, T, S], True where query t may attend key s. A row with no True entry yields zeros.
      scale: softmax scale (default 1 / sqrt(Dk)).
    Returns:
      [B, T, Hq, Dv] in q's dtype (softmax in float32; dots at `dot_precision(q.dtype)`).
    """
    batch, steps, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    precision = dot_precision(q.dtype)
    qg = q.reshape(batch, steps, kv_heads, group, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=precision) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = weights / jnp.maximum(weights.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum(
        "bkgts,bskd->btkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision
    )
    return out.reshape(batch, steps, q_heads, v.shape[-1]).astype(q.dtype)


def tree_attention_reference(
    q_parts, k_parts, v: jax.Array | None, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """The twin: `attention_reference` over the concatenated parts (v None: key part 0)."""
    q = jnp.concatenate(q_parts, axis=-1)
    k = jnp.concatenate(k_parts, axis=-1)
    v = k_parts[0] if v is None else v
    return attention_reference(q, k, v, mask, scale=scale)
