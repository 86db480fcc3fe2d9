"""ddtree_kernels: the Pallas GPU kernels of ddtree-jax, each beside its pure-jnp `*_reference` twin,
and the quantised weight formats they read. Imports only jax (and numpy), so it is tested and reused on
its own.

  decode_matmul        weight-streaming matmul (bf16 / f32 / INT4 / block-FP8 weights) and its grouped (MoE) form
  tree_attention       tree-verify attention (GQA and absorbed MLA), flash-decoding over the cache
  mla_attention_mgpu   absorbed-MLA tree-verify attention on Mosaic GPU (Hopper TMA + wgmma)
  gqa_attention_mgpu   GQA tree-verify attention on Mosaic GPU (not yet run on a GPU; not wired in)
  prefill_attention_mgpu  causal prefill-chunk attention on Mosaic GPU (FlashAttention-3 style, per-row offset)
  grouped_int4_mgpu    grouped INT4 MoE matmul on Mosaic GPU (prefill chunks; a per-assignment decode form)
  grouped_int4_stream_mgpu  the same at tree sizes: persistent CTAs streaming many experts through one TMA ring
  head_projections     absorbed MLA's per-head products around the attention kernel: W_UK (absorb), split merge + W_UV
  mosaic_common        what the Mosaic GPU attention kernels share (P @ V accumulation, mask bits, split merge)
  moe_decode           INT4 MoE decode: the chosen experts read in place (moe_impl "decode", "auto" at <= 16 on GPU)
  tree_build           DDTree construction: per-depth top-K and the best-first selection (with the tree's layout)
  tree_sampling        target-only tree rejection sampling, fused from the logits
  sampling_reference   the pure-jnp definitions tree_sampling computes (processed probabilities, the walk)
  quant                INT4 pack-quantized and block-FP8 weights
  tiling               what every kernel plans with: the GPU it fills, shared memory, precision, interpret mode

Precision contract: float32 inputs are computed at float32 (IEEE dots), bfloat16 on the bf16 tensor-core
path with float32 accumulation (`tiling`).
"""

from ddtree_kernels import (
    decode_matmul,
    gqa_attention_mgpu,
    head_projections,
    mla_attention_mgpu,
    moe_decode,
    mosaic_common,
    prefill_attention_mgpu,
    quant,
    sampling_reference,
    tiling,
    tree_attention,
    tree_build,
    tree_sampling,
)
from ddtree_kernels.gqa_attention_mgpu import gqa_tree_attention, gqa_tree_attention_reference
from ddtree_kernels.mla_attention_mgpu import mla_tree_attention, mla_tree_attention_reference
from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention, causal_prefill_attention_reference

__all__ = [
    "causal_prefill_attention",
    "causal_prefill_attention_reference",
    "decode_matmul",
    "gqa_attention_mgpu",
    "gqa_tree_attention",
    "gqa_tree_attention_reference",
    "mla_attention_mgpu",
    "moe_decode",
    "mosaic_common",
    "prefill_attention_mgpu",
    "mla_tree_attention",
    "mla_tree_attention_reference",
    "quant",
    "sampling_reference",
    "head_projections",
    "tiling",
    "tree_attention",
    "tree_build",
    "tree_sampling",
]
