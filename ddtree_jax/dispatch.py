"""Every "auto" choice of the library in one place: the one backend check, the implementation names,
each rule's measured threshold, and `decode_plan`, which answers "what runs on this device at this
budget?" (`python -m ddtree_jax dispatch --backend gpu --budget 32`).

The rules, by stage (the measurements are BENCHMARKS.md's, one H200):

  attention   GQA with <= AUTO_PALLAS_GQA_QUERIES queries per row (<= AUTO_PALLAS_GQA_SHORT_QUERIES against
              <= AUTO_PALLAS_GQA_SHORT_KEYS keys): the Pallas tree-attention kernel (1.9-2.3x XLA at N = 17,
              contexts 8k-128k; a tie at N = 65 there; one launch a layer instead of XLA's ~8 at the
              embedded pair's short contexts: DDTree 64 end to end 1.27x); float32 inputs only up to
              AUTO_PALLAS_MAX_F32_ROWS query rows per KV head (the embedded pair in float32: 1.2-1.8x XLA at
              2 x 16 rows, 0.19-0.26x at 2 x 17). Absorbed MLA (decode / verify, <= AUTO_PALLAS_MLA_QUERIES
              queries, >= AUTO_PALLAS_MLA_MIN_KEYS cache rows, bf16): the Mosaic GPU kernel
              (`mla_attention_mgpu`; `mla_attention_kernel`): 1.2-1.7x XLA from 8k keys, a tie or a loss
              at 1k-4k with 64 heads (attention_mgpu_003b11c.json); the K2.6 TP8 shard's whole step 8-11%
              faster with it (k26_tp8_shard_003b11c.json). GQA decode / verify calls that take the kernel
              against >= AUTO_MOSAIC_GQA_MIN_KEYS cache rows (bf16, head dims 64 / 128): the Mosaic GPU GQA
              kernel (`gqa_attention_mgpu`; `gqa_attention_kernel`): by device time 1.19 / 1.51 / 1.95x the
              Triton kernel at 1k / 8k / 32k keys (gqa_mgpu_42be6ae.json). Causal prefill chunks (> AUTO_PALLAS_MAX_QUERIES
              queries, GQA, bf16, head dims the kernel takes): the Mosaic GPU flash-attention kernel
              (`prefill_attention_mgpu`; `prefill_attention_kernel`): 550-650 TFLOP/s at a 2,048-query chunk
              against 69-78 for the blockwise XLA path (prefill_attention_a7d24fc.json); the Qwen3-8B 32k
              prefill 8.86 -> 1.41 s. Other long blocks: XLA, blockwise past BLOCKWISE_MIN_SCORES.
  MLA form    absorbed MLA (attention over the latent cache, W_UK folded into the queries) for decode and
              verify; the expanded form (per-head keys and values from the latent, one key block at a
              time) for prefill chunks long enough that it needs fewer FLOPs (`mla_form`: more than ~171
              queries at K2's shape, by FLOP count; not measured on the GPU yet).
  matmul      quantised weights (INT4, block FP8) at <= AUTO_PALLAS_MAX_ROWS rows: the weight-streaming
              kernel (1.2-3.4x dequantise + XLA at M = 1-17; 0.25-0.64x at M = 65-257 on INT4); bf16
              weights: XLA (the kernel slowed the whole Qwen3-8B forward: 15.9 against 10.0 ms at T = 1);
              "mosaic" takes the Mosaic GPU weight-streaming kernel (`skinny_matmul_mgpu`) for bf16 weights of
              >= MOSAIC_MATMUL_MIN_OUT rows (1.04-1.25x XLA per product at 65 rows on the H200), "auto" not yet
              (AUTO_MOSAIC_MATMUL: not measured inside a whole forward). In the DeepSeek-V3 layer scan on GPU,
              the dense projections IN_PLACE_PROJECTIONS names reach the layer stacked and the skinny kernel
              reads their layer in place (`stacked_in_place`), where XLA copied them out of their stacks every
              layer (q_a_proj at 1 row, every dense weight but the router at 8+): q_a_proj and the dense FFN
              from 1 row, kv_a / q_b / o_proj and the shared expert from 8. The K2.6 shard's 61-layer step at
              4k: AR 8.91 -> 8.49 ms, DDTree 16 23.20 -> 20.97 ms (the same run, off against on).
  moe         routed experts on GPU: up to GPU_GATHER_MAX_ASSIGNMENTS (tokens x top-k) the in-place
              "decode" kernels (INT4 experts; "gather" for others; AR on the 61-layer K2.6 shard 8.49 ->
              7.75 ms), the grouped kernel ("pallas") beyond (a tie with gather up to 16 assignments, 2.4x at
              72); off GPU:
              "gather" while assignments <= experts, else the dense "reference". Inside "pallas", INT4
              experts at prefill sizes take the Mosaic GPU grouped kernel (`grouped_int4_kernel`: 2.3x the
              Triton kernel's prefill tiling at a 2,048-token K2.6 chunk), smaller calls the Triton kernel (the
              streamed Mosaic kernel, "stream", built for them, measured 1.17-1.22x slower at 9-65 tokens:
              not "auto").
              Their sort by expert (`moe_sort`): by comparisons ("rank", one fusion) on GPU up to
              RANK_SORT_MAX_ASSIGNMENTS, XLA's sort beyond and off GPU. The Triton kernel's gate / up rows
              (`grouped_gather`): gathered into expert order by XLA; "kernel" (reading the tokens in place
              through a row index) measured a tie in the 4-layer K2.6 shard step (2.725 against 2.722 ms at
              DDTree 16), "xla_apart" (the gather behind an optimization barrier) one in the 61-layer step
              (17.15 against 17.13 ms at DDTree 8, H200), so neither is "auto".
              The router's top-k (`router_topk`): `lax.top_k`; "rank" (each expert's rank by comparisons, the
              same experts in the same order) on request up to RANK_TOPK_MAX_ROWS tokens, not yet timed on the
              GPU.
  sampling    the fused tree-sampling kernel on GPU, the XLA walk elsewhere.
  tree        the tree builder on GPU: the Pallas top-K and best-first selection kernels
              (`ddtree_kernels.tree_build`; one launch each instead of ~100 small XLA kernels); XLA elsewhere.
  top-k       the XLA tree builder's per-depth selection: "prefilter" (exact two-stage) where it shrinks the
              problem (`prefilter_pays`), else `lax.top_k` over the row.
  dtype       the weights' (and KV caches') dtype: on GPU the checkpoint's own (bf16 for the embedded pair
              and every HF release the library loads: tensor-core matmuls; the embedded pair's quick e2e set
              at bf16 against float32: chain 2.25x AR against 1.6x, DDTree 64 2.61x against 1.9x), float32
              elsewhere (XLA's CPU backend emulates bf16 dots, and the CPU tests' tolerances are float32's).
  layer loop  the model's default ("auto").
  prefill     prompts longer than PREFILL_CHUNK tokens (for targets with routed experts, PREFILL_TOKENS_MOE
              tokens over the batch: a chunk streams every expert's weights once) prefill in chunks of that
              many tokens (a scan
              over chunks, each attending the cache written so far plus itself), and attention with at
              least BLOCKWISE_MIN_SCORES scores per row and head runs "blockwise" (an online softmax over
              key blocks in XLA, any backend): memory grows with the chunk, not with prompt x context.
  gen. loop   `generate`'s while_loop compiled with XLA's command buffers extended to WHILE and CONDITIONAL
              (`loop_compiler_options`): the whole loop is one CUDA graph with on-device control flow, so a
              decode step waits on no host round trip (the loop predicate read back, the next graph launched).
              On the embedded pair, T = 0: AR 266 -> 213 us a step, chain 704 -> 577, DDTree 64 937 -> 780
              (the step's device time). An XLA_FLAGS setting of xla_gpu_enable_command_buffer wins.
  split-K     XLA splits the K of small-M GEMMs (split-K 8 on the embedded pair's 17-65-row GEMMs, partial
              sums reduced by the next fusion); for a target of hidden size <= SPLIT_K_MAX_HIDDEN `generate`
              compiles with xla_gpu_experimental_force_split_k = 1 (`loop_compiler_options`). Embedded pair
              (hidden 256), T = 0, step device time (step_loop_T0_*_splitk_*.json): the tree forward 218.5 ->
              194.6 us for DDTree 64 (65 rows), 199.8 -> 188.8 for the chain (17); whole step 384 -> 363 and
              332 -> 322 us. Larger models keep XLA's choice (unmeasured: their weight-read-bound GEMMs need
              the split's parallelism). An XLA_FLAGS setting of the option wins.

Off GPU every "auto" is XLA: interpret-mode Pallas is for tests, not speed. The Mosaic GPU kernels (wgmma, TMA)
compile for Hopper only (compute capability 9.x: `mosaic_gpu`); on any other GPU every choice above that names one
falls back to the Triton kernel or XLA it was measured against. Precision: every kernel
computes float32 inputs at float32 and bf16 inputs on the bf16 tensor-core path (`ddtree_kernels.tiling`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax

from ddtree_kernels import (
    gqa_attention_mgpu,
    grouped_int4_mgpu,
    mla_attention_mgpu,
    prefill_attention_mgpu,
    skinny_matmul_mgpu,
)
from ddtree_kernels import moe_decode as moe_decode_kernels
from ddtree_kernels.tree_build import CHUNK as TOPK_CHUNK
from ddtree_kernels.tree_build import MAX_ROW

SPLIT_K_MAX_HIDDEN = 1024  # targets up to this hidden size compile `generate` without split-K (module docstring)
ATTENTION_IMPLS = ("xla", "blockwise", "pallas", "auto")
MATMUL_IMPLS = ("xla", "pallas", "mosaic", "auto")
MOE_IMPLS = ("auto", "gather", "ragged", "pallas", "decode", "ep", "reference")
VERIFY_IMPLS = ("xla", "pallas", "auto")
TOPK_IMPLS = ("auto", "xla", "prefilter")
TREE_IMPLS = ("xla", "pallas", "auto")
BUILD_TOPK_IMPLS = TOPK_IMPLS + ("vocab_parallel",)  # the tree builder's: the vocabulary split over "model"
LAYER_LOOPS = ("auto", "scan", "unrolled")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")  # "auto": `weights_dtype`

AUTO_PALLAS_MAX_QUERIES = 32  # decode / verify calls: up to this many queries per row (longer: prefill-sized)
# GQA attention: the tree-attention kernel up to AUTO_PALLAS_GQA_QUERIES queries per row at any context, and up
# to AUTO_PALLAS_GQA_SHORT_QUERIES against <= AUTO_PALLAS_GQA_SHORT_KEYS cache rows. H200, the embedded pair
# (~470 cache rows), T = 0 end to end: DDTree 64 (65 queries) 11,205 tok/s with it against 8,837 with XLA's
# ~8 launches a layer, DDTree 128 (129) 8,852 against 6,925 (e2e_embedded_T0_9ff412f*.json); at 8k-128k
# keys N = 65 is a tie (BENCHMARKS.md, tree-verify attention) and N = 129 is not measured.
AUTO_PALLAS_GQA_QUERIES = 65
AUTO_PALLAS_GQA_SHORT_QUERIES = 129
AUTO_PALLAS_GQA_SHORT_KEYS = 2048
# Absorbed MLA on GPU: the Mosaic GPU kernel (`ddtree_kernels.mla_attention_mgpu`) for decode / verify calls of
# up to AUTO_PALLAS_MLA_QUERIES queries per row against at least AUTO_PALLAS_MLA_MIN_KEYS cache rows (module
# docstring); the Triton kernel is what "pallas" runs for MLA off GPU and on float32 inputs. H200, B = 1, device
# us per call, kernel / XLA (attention_mgpu_003b11c.json): 64 heads, N = 65, 1k keys 109 / 80 (XLA ahead), N = 17,
# 4k 88 / 86 (a tie); from 8k the kernel leads everywhere (8 heads 32k: 121 / 165; 64 heads 32k: 277 / 471).
AUTO_PALLAS_MLA_QUERIES = 65
# GQA decode / verify calls (<= AUTO_PALLAS_GQA_QUERIES queries) that take the tree-attention kernel ("pallas", or
# "auto" above): on GPU, bf16, head dims in MOSAIC_GQA_HEAD_DIMS and at least AUTO_MOSAIC_GQA_MIN_KEYS cache rows in
# whole 64-key blocks, the Mosaic GPU kernel (`ddtree_kernels.gqa_attention_mgpu`: every key block read once per KV
# head for all its query heads x tree rows), else the Triton one. H200, Qwen3-8B shape, B = 1, N = 17, device us per
# call (op_profile, 42be6ae, gqa_mgpu_42be6ae.json), Mosaic / Triton / XLA: 1k keys 16.8 / 20.0 / 31.3, 8k 27.6 / 41.5 /
# 89.2, 32k 63.6 / 124.2 / 266.8, so from 1k, the shortest context measured (8k until the wall-clock times of
# c95440b, which hold each call's dispatch, showed a tie at 1k). Not measured: N = 65, B > 1, head dim 64 at >= 1k
# keys (the rule takes them on the B = 1, N = 17 evidence).
AUTO_MOSAIC_GQA_MIN_KEYS = 1024
MOSAIC_GQA_HEAD_DIMS = gqa_attention_mgpu.HEAD_DIMS
AUTO_PALLAS_MLA_MIN_KEYS = 2048
# Causal prefill chunks (queries > AUTO_PALLAS_MAX_QUERIES) on GPU in bf16: the Mosaic GPU flash-attention kernel
# (`ddtree_kernels.prefill_attention_mgpu`) where its head dims fit, instead of the blockwise / dense XLA path.
AUTO_PREFILL_KERNEL = True
# ... and for the expanded MLA form's prefill chunks (Dk = nope + rope = 192, Dv = 128 at K2's shape): H200, K2.6
# width (4 layers, 64 heads), a 32,768-token prompt in 2,048-token chunks, the whole prefill 1.65 s with the kernel
# against 3.16 s blockwise (prefill_k2.6_79f25c7.json; shorter prompts not measured)
AUTO_PREFILL_KERNEL_MLA = True
PREFILL_KERNEL_KEY_DIMS = (64, 128, 192, 256)
PREFILL_KERNEL_VALUE_DIMS = (64, 128)
AUTO_PALLAS_MAX_F32_ROWS = 32  # ... and, for float32 inputs, up to this many query rows (group x N) per KV head
BLOCKWISE_MIN_SCORES = 1 << 24  # attention: blockwise (online softmax) from this many scores per row and head
BLOCKWISE_KEYS = 1024  # keys per block of blockwise attention
# KV caches hold whole blocks of this many rows (the engine's `cache_capacity`, the memory planner): the Mosaic GPU
# attention kernels' TMA reads whole key blocks (64 keys for MLA, 128 for the causal prefill), so a ragged capacity
# would make the MLA kernel pad, i.e. copy, the cache on every call and keep the prefill kernel off
CACHE_ROW_MULTIPLE = 128
PREFILL_CHUNK = 2048  # "auto" prefills prompts longer than this in chunks of this many tokens
# ... and MoE targets in chunks of about this many tokens over the batch (rows x chunk; the chunk in whole
# PREFILL_CHUNK_STEP tokens, >= PREFILL_CHUNK): a chunk's routed-expert matmuls stream every expert's weights once,
# so more tokens a chunk is fewer passes over them (K2.6 width, 4 layers, 32k tokens, B = 1 on the H200, efb2e2f:
# 860 ms in 2,048-token chunks, 703 in 8,192: 32% -> 39% of the bf16 peak; ~170 rows an expert a chunk)
PREFILL_TOKENS_MOE = 8192
PREFILL_CHUNK_STEP = 1024
AUTO_PALLAS_MAX_ROWS = 32  # matmul: the weight-streaming kernel up to this many rows (quantised weights)
# dense bf16 weights on GPU: the Mosaic GPU weight-streaming kernel (`skinny_matmul_mgpu`) under matmul_impl="mosaic";
# "auto" takes it only once AUTO_MOSAIC_MATMUL (not yet measured inside a whole forward on the H200)
AUTO_MOSAIC_MATMUL = False
# ... and only for weights of at least this many output rows: on the H200 (device time, M = 1-128, skinny_mgpu JSON
# of session 16) the kernel led XLA by 4-25% on Qwen3-8B's q / o, gate / up and down, and lost on the 1,024-row
# k / v projections (0.52-0.96x): too few 64-row stripes to stream the weight without a split-K sum after it
MOSAIC_MATMUL_MIN_OUT = 2048
# The DeepSeek-V3 layer scan slices each layer's parameters out of their stacks. At one token row XLA fuses that
# slice into its GEMMs, except q_a_proj's (K2.6: 1,536 x 7,168, 22 MB), copied out of the stack every layer for a
# split-K Triton GEMM (one H200 4-layer profile: 10.7 us a layer beside a 6.5 us GEMM); at 8+ rows (chain, trees)
# it copies every dense weight of the layer (the dumped HLO of the 4-layer shard's chain step: kv_a, q_b, o_proj,
# the router and the shared expert, ~44 MB a layer, as async copies). These projections go to the layer stacked
# instead (`stacked_in_place`), read in place by the skinny kernel, from the row counts given here; the router
# stays sliced (`moe.route` computes in float32: not the skinny kernel's bf16).
IN_PLACE_PROJECTIONS = {
    "q_a_proj": 1,
    **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), 1),  # the dense layers' FFN
    **dict.fromkeys(("kv_a_proj", "o_proj", "q_b_proj", "shared_gate", "shared_up", "shared_down"), 8),
}
IN_PLACE_MAX_ROWS = 65  # the most rows measured (B x T); larger calls keep the sliced XLA GEMM
# Measured on one H200, the K2.6 TP8 shard's 4-layer step (command buffers off, device time): AR, q_a_proj in
# place, 631 -> 603 and 633 -> 605 us in two runs; DDTree 16 (17 rows), the projections of both tables in place,
# 2,168 -> 2,040 us (q_a_proj alone: 2,175, a tie; this table alone: not timed). Per projection in a layer scan (bench_skinny_mgpu --stacked 8, kernels'
# busy time): q_a 1.54-1.68x XLA at 1-65 rows; kv_a 0.65x at 1 row, 1.18-1.22x at 9-65; o_proj's shard 0.82x at
# 1 row, 1.70-1.88x at 9-65; q_b's shard 0.64x at 1 row, 1.11-1.18x at 9-65; the shared expert's gate / up 0.55x
# at 1, 1.08-1.17x at 9-65, its down 0.73x at 1, 1.20-1.35x at 9-65; the dense FFN's gate / up 1.76-1.89x and down
# 2.07-2.16x at 1-65 rows (every shape checked against the twin compiled on the GPU,
# `test_compiled_k26_shard_projections_stacked_on_gpu`; in the 4-layer AR step the dense FFN's three in-place calls
# tie XLA's fused gate / up GEMM + down: 35.5 against 33.7 us). The chain's 8 rows: the same copies in its dumped
# HLO. The 61-layer step at 4k, off -> on: AR 8.91 -> 8.49 ms, DDTree 16 23.20 -> 20.97 ms.
AUTO_IN_PLACE = True
TREE_TOPK_MAX_ROW = MAX_ROW  # the top-K kernel holds rows up to this long; longer ones are cut into chunks
TREE_TOPK_CHUNK = TOPK_CHUNK  # ... of at least this many logits (`tree_topk_chunk`)
# ... but only when AUTO_TREE_TOPK_CHUNKED: on the H200 (V = 151,936, L = 15, bf16, bench_tree_V151936_7ba6e57.json)
# the chunked top-K stage measured slower than the XLA prefilter + one kernel a row: 102 against 85 us at budget 64,
# 143 against 113 at 256 (its 285 programs each run the latency-bound bisection; more programs add waves, not speed)
AUTO_TREE_TOPK_CHUNKED = False
GPU_GATHER_MAX_ASSIGNMENTS = 16  # MoE on GPU: up to this many (token, expert) assignments, no grouped kernel: ...
# ... INT4 experts take the in-place "decode" kernels (`moe.routed_decode`: `moe_decode`) where AUTO_MOE_DECODE, other
# weights the gather: the 61-layer K2.6 TP8 shard's AR step (8 assignments a layer) took
# 7.75 / 7.72 ms in the loop on "decode" against 8.49 on "gather" (one H200, 7258db7, two runs of one session,
# BENCHMARKS.md); at 4 layers the two had tied (0.745 / 0.746 ms)
AUTO_MOE_DECODE = True
# The grouped INT4 expert matmul of prefill-sized calls (more than MOSAIC_GROUPED_MIN_ROWS assignments an expert
# on average): the Mosaic GPU kernel (`grouped_int4_mgpu`) where it takes the shapes; on the H200 at a 2,048-token
# K2.6 chunk (16,384 assignments over 384 experts, ~43 an expert; 39f2627, scales read in place) 3,182 / 3,563 us
# (gate / down) against the Triton kernel's one-dot tiling at 6,996 / 7,708 (its best tiling of that sweep: 5,258 /
# 5,096). The threshold is the Triton prefill tiling's, not measured
# for this kernel; under "ep" the count includes the assignments routed to other devices' experts (run as local
# expert 0's rows), so a B = 8 tree verify may take it: also not measured.
AUTO_MOSAIC_GROUPED = True
MOSAIC_GROUPED_MIN_ROWS = 32
# Below prefill sizes: "stream" = the streamed Mosaic GPU kernel (`grouped_int4_stream_mgpu`: persistent CTAs, each
# streaming many experts' tiles through one TMA ring), built for the tree sizes (1-2 rows an expert) at which the
# Triton kernel reaches 28-58% of the copy bandwidth (#26's bar: 70%). Exact in Mosaic GPU interpret mode and lowered
# for "cuda" on the CPU. On one H200 (42be6ae, BENCHMARKS.md) it is exact but slower than the Triton kernel at
# every size: gate T = 9 / 17 / 65 122-130 / 154-178 / 317-354 us against 100.6 / 131.8 / 269.5, so "auto" keeps "triton".
GROUPED_INT4_DECODES = ("auto", "triton", "stream")
GROUPED_INT4_DECODE = "auto"
# inside the "decode" MoE path (`moe.routed_decode`): the Mosaic decode form (`grouped_int4_mgpu.
# gathered_int4_matmul`: one 8-row tile an assignment, scales and codes read in place, K split over the SMs) is
# off: on the H200 (21a7ef0, K2.6 TP8 shard experts) it took 53.3 us at one token (8 assignments) and 139.4 at four,
# against the Triton `moe_decode` kernels' 29.1 / 75.3 and the gather path's 41.7 / 156.6 (BENCHMARKS.md)
AUTO_MOSAIC_DECODE = False
# the measured range (8 and 32 assignments); each assignment streams its expert once, repeats included (no
# deduplication), so a tree's hundreds of assignments belong to the grouped kernel
MOSAIC_DECODE_MAX_ASSIGNMENTS = 32
# The routed experts' sort by expert ("pallas" / "ragged" MoE): "rank" = each assignment's sorted position counted by
# comparisons (A x A, one fusion) and its inverse by a scatter, up to RANK_SORT_MAX_ASSIGNMENTS (a B = 8 tree's 1,088:
# 1.2 M comparisons); "argsort" = XLA's sort (on GPU a sort kernel a call, plus a second sort for the inverse before
# `moe.sort_by_expert`). "auto" takes "rank" on GPU up to that size. With the grouped tile table's prefix sums
# (`decode_matmul._exclusive_prefix_sum`) it took the 4-layer K2.6 shard's DDTree 16 step (136 assignments a layer,
# 8fec69d, command buffers off) from 2,293.9 to 2,244.7 us of device time and 3.25 to 3.10 ms in the loop.
MOE_SORTS = ("auto", "argsort", "rank")
MOE_SORT = "auto"
RANK_SORT_MAX_ASSIGNMENTS = 2048
# The router's top-k experts a token (`moe.route`): "lax" = `lax.top_k` (in the 4-layer K2.6 shard's AR profile on
# one H100, 25f5f18: a top-k fusion and a slice, 6.9 us a MoE layer); "rank" = `moe.top_k_by_rank`, up to
# RANK_TOPK_MAX_ROWS token rows (lax.top_k beyond: [rows, E, E] comparisons, 147 k a token at E = 384): each expert's
# rank counted by comparisons (one reduction) and the k best picked by rank (one reduction for the experts, one for
# their scores, which XLA may fuse), the same experts in the same order (ties to the lower index, as lax.top_k).
# "rank" is not yet timed on the GPU, so "auto" takes "lax" (tp_shard_step --router-topk compares them).
ROUTER_TOPKS = ("auto", "lax", "rank")
ROUTER_TOPK = "auto"
RANK_TOPK_MAX_ROWS = 128
# The grouped Triton expert kernel's gate / up activations ("pallas" MoE path, `moe.routed_pallas`): "kernel" hands
# the kernel the layer's token rows [T, D] and each sorted assignment's token (`decode_matmul.grouped_matmul`'s
# row_index), each row read in place; "xla" gathers the T x top-k rows into expert order first. In the 4-layer K2.6
# shard's DDTree 16 profile (17 tokens, 136 assignments, 8fec69d) the gather, with the pad and the plane transpose of
# the gathered [136, 7168] rows, was one fusion of 16.9 us a layer; "kernel" transposes 17 rows instead. On one H200
# (42be6ae): the gate call 1.09x / 1.00x / 1.06x faster at T = 9 / 17 / 65, the 4-layer DDTree 16 step in the loop a
# tie (2.725 against 2.722 ms), so "auto" keeps "xla". "xla_apart": the same gather, materialised behind an
# optimization barrier so that XLA cannot fuse it into the kernel's pad and plane transpose. The fused form reads the
# gathered rows with the transpose's strides: in the 4-layer chain step on one H100 (07977f7) that fusion took 16.7 us
# a MoE layer for 64 rows. Apart, the gather copies whole rows and the transpose is XLA's own; in the 61-layer K2.6
# shard step on one H200 (7258db7) it tied: chain 14.61 against 14.55 ms, DDTree 8 17.15 against 17.13. Not "auto".
GROUPED_GATHERS = ("auto", "xla", "xla_apart", "kernel")
GROUPED_GATHER = "auto"
# The router's logits from this many rows (B x T) as one bf16 GEMM with float32 accumulation (`router_bf16_gemm`):
# in the 4-layer K2.6 shard's DDTree 16 profile (17 rows, 8fec69d) the float32 path cost a float32 copy of the
# router (5.1 us a layer) and a float32 cuBLAS GEMM (10.6 us a layer); at 1 row (AR) XLA fuses it into one
# reduction. The bf16 GEMM itself is not yet timed on the GPU.
ROUTER_BF16_MIN_ROWS = 8
# generate's loop: XLA's default command-buffer commands plus WHILE and CONDITIONAL (CUDA conditional nodes)
LOOP_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def backend() -> str:
    """The one backend check of the library: "gpu", "cpu" or "tpu"."""
    return jax.default_backend()


def _on_gpu(backend_name: str | None) -> bool:
    return (backend_name or backend()) == "gpu"


# the Mosaic GPU kernels' wgmma exists on compute capability 9.x only (Hopper: H100, H200, H800, GH200)
MOSAIC_GPU_MAJOR = 9


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of this process's first GPU on CUDA; None off CUDA (CPU, TPU, ROCm)."""
    return _device_capability() if backend() == "gpu" else None


@functools.cache
def _device_capability() -> tuple[int, int] | None:
    """The first device's CUDA compute capability, read once (only ever called on the GPU backend)."""
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):  # not a CUDA device (ROCm names its gfx arch)
        return None


def mosaic_gpu(backend_name: str | None = None) -> bool:
    """Whether the Mosaic GPU kernels run: on a Hopper GPU (`gpu_compute_capability` 9.x). `backend_name` "gpu"
    named off a GPU (a plan for another machine: `decode_plan`, the tests) stands for the project's GPU, an H200."""
    if not _on_gpu(backend_name):
        return False
    if backend() != "gpu":
        return True
    capability = gpu_compute_capability()
    hopper = capability is not None and capability[0] == MOSAIC_GPU_MAJOR
    if not hopper:
        _warn_no_mosaic(capability)
    return hopper


@functools.cache
def _warn_no_mosaic(capability) -> None:
    """Says once a process that this GPU runs the Triton / XLA paths where an H200 runs a Mosaic GPU kernel."""
    warnings.warn(
        f"this GPU's compute capability is {capability}, not {MOSAIC_GPU_MAJOR}.x (Hopper): the Mosaic GPU kernels are "
        "off and their choices fall back to the Triton kernels / XLA (dispatch.mosaic_gpu)",
        stacklevel=3,
    )


def _check(kind: str, impl: str, allowed: tuple[str, ...]) -> None:
    if impl not in allowed:
        raise ValueError(f"{kind} impl must be one of {allowed}, got {impl!r}")


def attention_impl(
    impl: str,
    *,
    queries: int | None = None,
    keys: int | None = None,
    mla: bool = False,
    group: int = 1,
    float32: bool = False,
    mla_dims: tuple[int, int] | None = None,
    backend_name: str | None = None,
) -> str:
    """ "xla", "blockwise" or "pallas" for a call with `queries` query positions per row (None: a decode /
    verify step) against `keys` cache rows (None: unknown) of a GQA (mla=False) or absorbed-MLA layer with
    `group` query heads per KV head, its inputs float32 (float32=True) or bf16; mla_dims: the MLA layer's
    (latent, rope) dims (None: K2's 512, 64): "auto" takes the kernel only where the Mosaic one runs."""
    _check("attention", impl, ATTENTION_IMPLS)
    if impl != "auto":
        return impl
    long = queries is not None and queries > AUTO_PALLAS_MAX_QUERIES  # a prefill, not a decode step
    if long and keys is not None and queries * keys >= BLOCKWISE_MIN_SCORES:
        return "blockwise"  # any backend: the dense path's float32 scores would be >= 64 MB per row and head
    if not _on_gpu(backend_name):
        return "xla"
    if mla:
        decode = queries is None or queries <= AUTO_PALLAS_MLA_QUERIES
        enough_keys = keys is None or keys >= AUTO_PALLAS_MLA_MIN_KEYS
        mosaic = mla_attention_kernel(bfloat16=not float32, dims=mla_dims, backend_name=backend_name) == "mosaic"
        return "pallas" if decode and enough_keys and mosaic else "xla"
    if float32 and group * (queries or 1) > AUTO_PALLAS_MAX_F32_ROWS:
        return "xla"
    if queries is None or queries <= AUTO_PALLAS_GQA_QUERIES:
        return "pallas"
    short = keys is not None and keys <= AUTO_PALLAS_GQA_SHORT_KEYS
    return "pallas" if short and queries <= AUTO_PALLAS_GQA_SHORT_QUERIES else "xla"


def prefill_attention_kernel(
    impl: str,
    *,
    queries: int,
    keys: int,
    key_dim: int,
    value_dim: int,
    bfloat16: bool,
    mla: bool = False,
    backend_name: str | None = None,
) -> str:
    """ "mosaic" (`prefill_attention_mgpu.causal_prefill_attention`) or "none" (the `attention_impl` path with
    the mask) for a causal prefill call of `queries` query rows against `keys` cache rows (mla: the expanded
    MLA form's per-head keys): the kernel on GPU for bf16 inputs whose head dims it takes and whose cache is
    whole 64-key blocks, under "pallas" and, for prefill-sized calls (more than AUTO_PALLAS_MAX_QUERIES
    queries; MLA only once AUTO_PREFILL_KERNEL_MLA), under "auto"."""
    _check("attention", impl, ATTENTION_IMPLS)
    fits = key_dim in PREFILL_KERNEL_KEY_DIMS and value_dim in PREFILL_KERNEL_VALUE_DIMS and keys % 64 == 0
    if impl in ("xla", "blockwise") or not (mosaic_gpu(backend_name) and bfloat16 and fits):
        return "none"
    if not prefill_attention_mgpu.causal_masking_safe():
        return "none"  # a CUDA runtime whose ptxas miscompiles this causal masking (the kernel's docstring)
    enabled = AUTO_PREFILL_KERNEL_MLA if mla else AUTO_PREFILL_KERNEL
    if impl == "auto" and (queries <= AUTO_PALLAS_MAX_QUERIES or not enabled):
        return "none"
    return "mosaic"


MOSAIC_MLA_DIMS = (mla_attention_mgpu.LATENT_DIM, mla_attention_mgpu.ROPE_DIM)  # (latent, rope) it takes


def mla_attention_kernel(
    *, bfloat16: bool, dims: tuple[int, int] | None = None, backend_name: str | None = None
) -> str:
    """The kernel behind attn_impl "pallas" for absorbed MLA: "mosaic" (`mla_attention_mgpu`: TMA + wgmma,
    bf16, latent 512 and rope 64 (`dims`, None: those) only) on a Hopper GPU (`mosaic_gpu`), else "triton"
    (`tree_attention`; in interpret mode off GPU, where Mosaic GPU's interpreter runs a CTA's warpgroups as host
    threads, much slower)."""
    fits = dims is None or tuple(dims) == MOSAIC_MLA_DIMS
    return "mosaic" if mosaic_gpu(backend_name) and bfloat16 and fits else "triton"


# the Mosaic MLA kernel's schedule inside the models (`mla_schedule_options`): "default" (each compute warpgroup
# scores every key block: the fastest measured at N = 17), "split_scores" (each scores half a block, lock-stepped:
# 5.7-7.3% faster at N = 65 with 64 heads), "overlap" (FA3's intra-warpgroup overlap: 15-37% slower), "alternate"
# (FlashMLA's pairs: not yet compiled on the GPU). A research knob (`tp_shard_step --mla-schedule`), not an auto choice.
# Absorbed MLA's two per-head products with W_UK / W_UV (q_latent = q_nope . W_UK, out = o_latent . W_UV^T) at
# up to this many token rows (B x T) written as a broadcast product and a sum (a column reduction over W_UK's
# rows, a row reduction over W_UV's), not as dots. In the K2.6 shard's AR step (1 row) XLA rewrites the dots as
# reductions that want both weights transposed to [H, kv_lora, 128] and transposes them every layer (2.9 + 3.6 us,
# `input_transpose_fusion{,.1}` in its HLO); at 8 rows it runs GEMMs on the stored layout. 0: the dots everywhere.
# Timed on one H200 (the 4-layer shard's AR step, command buffers off, device time, `55611f1`): 603.0 us with the
# dots, 601.3 with the reductions (1 row): a tie, so the dots stay.
MLA_REDUCE_MAX_ROWS = 0
MLA_SCHEDULES = ("default", "split_scores", "overlap", "alternate")
MLA_SCHEDULE = "default"
# Absorbed MLA's per-head products around the Mosaic kernel as Triton kernels reading kv_b_proj's rows in place (the
# layer scan passes it stacked), `ddtree_kernels.head_projections`: MLA_ABSORB, q_latent = q_nope . W_UK in one launch
# (`absorb`), in place of W_UK's per-layer transpose and the product (2.7 + 1.6 us a MoE layer in the 4-layer shard's
# AR profile on an H100, `25f5f18`); MLA_MERGE_UP, each head's W_UV applied in the merge of the kernel's key splits
# (`merge_up`), in place of the merge's three reductions and W_UV's transpose and product (4.5 + 5.7 us). Off until
# measured in the step (`tp_shard_step --mla-absorb off,on --mla-merge-up off,on`).
MLA_ABSORB = False
MLA_MERGE_UP = False


def mla_head_kernels(*, mosaic: bool, weight_bfloat16: bool, nope: int, width: int) -> tuple[bool, bool]:
    """(absorb, merge_up): whether absorbed MLA takes W_UK's product (MLA_ABSORB) and W_UV's with the split merge
    (MLA_MERGE_UP) in `head_projections`' kernels: on the Mosaic kernel (`mosaic`: `mla_attention_kernel` chose it),
    with a bf16 kv_b_proj, nope (W_UK's rows a head) a power of two and v_head_dim (`width`) a multiple of 32."""
    kernels = mosaic and weight_bfloat16
    return (
        MLA_ABSORB and kernels and nope > 0 and nope & (nope - 1) == 0,
        MLA_MERGE_UP and kernels and width % 32 == 0,
    )


def head_kernels_in_place(name: str, backend_name: str | None = None) -> bool:
    """Whether a layer scan passes `name` stacked (a `LayerOf`) for `mla_head_kernels`' kernels to read in place:
    kv_b_proj, while MLA_ABSORB or MLA_MERGE_UP, on a Hopper GPU (the other paths slice the layer out, as before)."""
    return (MLA_ABSORB or MLA_MERGE_UP) and name == "kv_b_proj" and mosaic_gpu(backend_name)


def mla_schedule_options(schedule: str | None = None) -> dict[str, bool]:
    """`mla_attention_mgpu.mla_tree_attention`'s schedule flags for `schedule` (None: MLA_SCHEDULE)."""
    schedule = MLA_SCHEDULE if schedule is None else schedule
    if schedule not in MLA_SCHEDULES:
        raise ValueError(f"unknown MLA kernel schedule {schedule!r}; expected one of {MLA_SCHEDULES}")
    return {name: schedule == name for name in MLA_SCHEDULES[1:]}


def gqa_attention_kernel(
    *,
    queries: int | None,
    keys: int,
    head_dim: int,
    value_dim: int,
    bfloat16: bool,
    backend_name: str | None = None,
) -> str:
    """The kernel behind attn_impl "pallas" (or "auto"'s "pallas") for a GQA call of `queries` query positions
    per row (None: a decode / verify step) against `keys` cache rows: "mosaic" (`gqa_attention_mgpu`: TMA +
    wgmma) on a Hopper GPU (`mosaic_gpu`) for bf16 decode / verify calls (<= AUTO_PALLAS_GQA_QUERIES queries) at head dims it takes
    (keys and values alike) from AUTO_MOSAIC_GQA_MIN_KEYS keys in whole 64-key blocks (no padded copy of the
    cache), where it measured faster than the Triton kernel; else "triton" (`tree_attention`)."""
    fits = head_dim == value_dim and head_dim in MOSAIC_GQA_HEAD_DIMS
    decode = queries is None or queries <= AUTO_PALLAS_GQA_QUERIES
    long = keys >= AUTO_MOSAIC_GQA_MIN_KEYS and keys % 64 == 0
    return "mosaic" if mosaic_gpu(backend_name) and bfloat16 and fits and decode and long else "triton"


MLA_FORMS = ("auto", "absorbed", "expanded")


def mla_form(
    form: str,
    *,
    queries: int | None,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> str:
    """ "absorbed" or "expanded" MLA for `queries` query positions per row (None: a decode / verify step).

    Per head, the absorbed form costs 2 (2 kv_lora + rope) FLOPs per (query, key) pair; the expanded form
    2 (nope + rope + v) per pair plus 2 kv_lora (nope + v) per key to expand the latent (once per call),
    so it needs fewer FLOPs once queries x (2 kv_lora - nope - v) > kv_lora (nope + v): more than 170.7
    queries at K2's 512 / 128 / 64 / 128. Decode and verify steps (<= AUTO_PALLAS_MAX_QUERIES queries)
    stay absorbed: their cost is reading the latent cache once."""
    if form not in MLA_FORMS:
        raise ValueError(f"MLA form must be one of {MLA_FORMS}, got {form!r}")
    if form != "auto":
        return form
    if queries is None or queries <= AUTO_PALLAS_MAX_QUERIES:
        return "absorbed"
    saved = 2 * kv_lora_rank - qk_nope_head_dim - v_head_dim  # per (query, key) pair and head, / 2
    expansion = kv_lora_rank * (qk_nope_head_dim + v_head_dim)  # per key and head, / 2
    return "expanded" if saved > 0 and queries * saved > expansion else "absorbed"


def weights_dtype(requested: str, backend_name: str | None = None) -> str:
    """ "float32", "bfloat16" or "checkpoint" (the dtype the checkpoint stores, as HF's torch_dtype="auto")
    for the dtype a pair's weights load in and its KV caches hold: "auto" is "checkpoint" on GPU, else
    "float32"."""
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {requested!r}")
    if requested != "auto":
        return requested
    return "checkpoint" if _on_gpu(backend_name) else "float32"


def skinny_takes(rows: int, weight_shape: tuple[int, ...] | None) -> bool:
    """Whether `skinny_matmul_mgpu.skinny_matmul` takes x [rows, K] @ W[N, K]^T as it is: 1..MAX_ROWS rows, N and
    K whole 64-element tiles (the weight is never padded)."""
    if weight_shape is None or len(weight_shape) != 2:
        return False
    n, k = weight_shape
    return 1 <= rows <= skinny_matmul_mgpu.MAX_ROWS and n % 64 == 0 and k % 64 == 0


def mosaic_matmul_fits(rows: int, weight_shape: tuple[int, ...] | None) -> bool:
    """`skinny_takes` and N >= MOSAIC_MATMUL_MIN_OUT (where it measured faster than XLA on an unstacked weight)."""
    return skinny_takes(rows, weight_shape) and weight_shape[0] >= MOSAIC_MATMUL_MIN_OUT


def matmul_in_place(
    rows: int, weight_shape: tuple[int, ...], *, quantized: bool, bfloat16: bool, backend_name: str | None = None
) -> bool:
    """Whether `models.layers.linear` reads a layer of stacked weights (a `LayerOf`) in place: on GPU, by the
    Mosaic skinny kernel, for a dense bf16 product it takes (`skinny_takes`); elsewhere the layer is sliced."""
    return mosaic_gpu(backend_name) and not quantized and bfloat16 and skinny_takes(rows, weight_shape)


def stacked_in_place(name: str, rows: int, backend_name: str | None = None) -> bool:
    """Whether a layer scan passes the dense projection `name` stacked (a `LayerOf`, read in place by `linear`)
    for `rows` token rows: AUTO_IN_PLACE, on GPU, for the IN_PLACE_PROJECTIONS from their row counts up to
    IN_PLACE_MAX_ROWS (under a mesh as well: `linear` reads each shard's part, `models.layers._linear_in_place`)."""
    if not (AUTO_IN_PLACE and name in IN_PLACE_PROJECTIONS and mosaic_gpu(backend_name)):
        return False
    return IN_PLACE_PROJECTIONS[name] <= rows <= IN_PLACE_MAX_ROWS


def matmul_impl(
    impl: str,
    *,
    rows: int,
    quantized: bool,
    backend_name: str | None = None,
    weight_shape: tuple[int, ...] | None = None,
    bfloat16: bool = False,
) -> str:
    """ "xla", "pallas" (`decode_matmul`, Triton) or "mosaic" (`skinny_matmul_mgpu`) for x [rows, in] @ weight^T,
    the weight quantised (INT4 / block FP8) or not. "mosaic" is taken on GPU for a dense bf16 weight
    (weight_shape [out, in], bfloat16: x and the weight both bf16) that `mosaic_matmul_fits`, and falls back to
    "xla" anywhere else (and on GPUs other than Hopper, `mosaic_gpu`); "auto" gives it those calls only once
    AUTO_MOSAIC_MATMUL."""
    _check("matmul", impl, MATMUL_IMPLS)
    mosaic = mosaic_gpu(backend_name) and not quantized and bfloat16 and mosaic_matmul_fits(rows, weight_shape)
    if impl == "mosaic":
        return "mosaic" if mosaic else "xla"
    if impl != "auto":
        return impl
    if not _on_gpu(backend_name):
        return "xla"
    if not quantized:
        return "mosaic" if AUTO_MOSAIC_MATMUL and mosaic else "xla"
    return "pallas" if rows <= AUTO_PALLAS_MAX_ROWS else "xla"


def moe_impl(assignments: int, experts: int, backend_name: str | None = None, *, int4: bool = True) -> str:
    """The routed experts' "auto" dispatch for `assignments` (tokens x top-k) over `experts` experts: on GPU, up to
    GPU_GATHER_MAX_ASSIGNMENTS, "decode" for INT4 experts (`int4`; AUTO_MOE_DECODE) else "gather", "pallas" beyond;
    elsewhere "gather" / "reference". Under an expert-parallel mesh pass "ep" instead ("decode" and "pallas" run on
    the TP split)."""
    if _on_gpu(backend_name):
        if assignments <= GPU_GATHER_MAX_ASSIGNMENTS:
            return "decode" if AUTO_MOE_DECODE and int4 else "gather"
        return "pallas"
    return "gather" if assignments <= experts else "reference"


def router_topk(rows: int) -> str:
    """How `moe.route` picks the top-k experts of `rows` tokens: "rank" (`moe.top_k_by_rank`) where ROUTER_TOPK is
    "rank" and rows <= RANK_TOPK_MAX_ROWS, else "lax" (`lax.top_k`; "auto" is "lax": "rank" is not yet measured on
    the GPU)."""
    _check("router top-k", ROUTER_TOPK, ROUTER_TOPKS)
    return "rank" if ROUTER_TOPK == "rank" and rows <= RANK_TOPK_MAX_ROWS else "lax"


def moe_sort(assignments: int, backend_name: str | None = None) -> str:
    """How `moe.sort_by_expert` orders `assignments` (token, expert) pairs by expert: MOE_SORT unless "auto";
    "auto": "rank" on GPU up to RANK_SORT_MAX_ASSIGNMENTS, else "argsort"."""
    _check("moe sort", MOE_SORT, MOE_SORTS)
    if MOE_SORT != "auto":
        return MOE_SORT
    return "rank" if _on_gpu(backend_name) and assignments <= RANK_SORT_MAX_ASSIGNMENTS else "argsort"


def grouped_gather() -> str:
    """Where the "pallas" MoE path's grouped Triton kernel gets its gate / up rows in expert order: GROUPED_GATHER
    unless "auto"; "auto": "xla" (the gather before the kernel; "xla_apart": that gather kept out of the kernel's
    layout transpose by an optimization barrier; "kernel": read in place through a row index)."""
    _check("grouped gather", GROUPED_GATHER, GROUPED_GATHERS)
    return "xla" if GROUPED_GATHER == "auto" else GROUPED_GATHER


def router_bf16_gemm(rows: int, x_dtype, router_dtype) -> bool:
    """Whether `moe.route` computes its float32 logits as one bf16 GEMM accumulating in float32 (exact bf16
    products, so the float32 logits up to summation order): for bf16 activations and router from ROUTER_BF16_MIN_ROWS
    rows, where the float32 path copies the router to float32 and runs a float32 GEMM a layer; fewer rows keep the
    float32 path, which XLA fuses into one reduction reading the router as stored."""
    bf16 = jax.numpy.bfloat16
    return rows >= ROUTER_BF16_MIN_ROWS and jax.numpy.dtype(x_dtype) == bf16 and jax.numpy.dtype(router_dtype) == bf16


def grouped_int4_kernel(rows: int, weight_shape: tuple[int, ...], x_dtype, backend_name: str | None = None) -> str:
    """Which kernel runs a grouped INT4 expert matmul of `rows` assignments over weights [..., E, N, K] (the
    "pallas" MoE path): "mosaic" (`grouped_int4_mgpu.grouped_int4_matmul`) on a Hopper GPU for bf16 rows at prefill
    sizes (> MOSAIC_GROUPED_MIN_ROWS an expert on average) and shapes it takes (N a multiple of its 128-column
    CTA, K of its 256-element steps); below them "stream" (`grouped_int4_stream_mgpu.streamed_int4_matmul`, same
    shapes) where GROUPED_INT4_DECODE says so; else "triton" (`decode_matmul.grouped_matmul`)."""
    _check("grouped INT4 decode kernel", GROUPED_INT4_DECODE, GROUPED_INT4_DECODES)
    experts, n, k = weight_shape[-3:]
    takes = (
        n % grouped_int4_mgpu.BLOCK_N == 0
        and k % grouped_int4_mgpu.SCALE_STEP == 0
        and jax.numpy.dtype(x_dtype) == jax.numpy.bfloat16
    )
    if not (mosaic_gpu(backend_name) and takes):
        return "triton"
    if rows > MOSAIC_GROUPED_MIN_ROWS * experts:
        return "mosaic" if AUTO_MOSAIC_GROUPED else "triton"
    return "stream" if GROUPED_INT4_DECODE == "stream" else "triton"


def decode_moe_kernel(
    assignments: int, weight_shapes: list[tuple[int, ...]], x_dtype, backend_name: str | None = None
) -> str:
    """Which kernels run the "decode" MoE path's INT4 expert matmuls (`moe.routed_decode`) for `assignments`
    (token, expert) pairs over the gate / up / down weights [..., E, N, K]: "mosaic" (`grouped_int4_mgpu.
    gathered_int4_matmul`) where AUTO_MOSAIC_DECODE is on (off: measured slower), on GPU for bf16 activations, up to
    MOSAIC_DECODE_MAX_ASSIGNMENTS, on shapes it takes (N a multiple of its 128-column CTA, K of its 256-element
    steps); else "triton" (`moe_decode`, which takes up to its MAX_ASSIGNMENTS and falls back to "gather" above)."""
    takes = all(
        shape[-2] % grouped_int4_mgpu.BLOCK_N == 0 and shape[-1] % grouped_int4_mgpu.SCALE_STEP == 0
        for shape in weight_shapes
    )
    bf16 = jax.numpy.dtype(x_dtype) == jax.numpy.bfloat16
    fits = assignments <= MOSAIC_DECODE_MAX_ASSIGNMENTS
    return "mosaic" if AUTO_MOSAIC_DECODE and mosaic_gpu(backend_name) and takes and bf16 and fits else "triton"


def local_expert_impl(assignments: int, local_experts: int, backend_name: str | None = None) -> str:
    """The dispatch inside the expert-parallel region over one device's experts: "gather" / "pallas" on
    GPU (same threshold as `moe_impl`), "gather" / "dense" elsewhere."""
    if _on_gpu(backend_name):
        return "gather" if assignments <= GPU_GATHER_MAX_ASSIGNMENTS else "pallas"
    return "gather" if assignments <= local_experts else "dense"


def prefill_chunk(requested: int, prompt_len: int, moe: bool = False, batch: int = 1) -> int | None:
    """Prompt tokens per prefill chunk, or None for one unchunked prefill: `requested` (DecodeOptions.
    prefill_chunk) > 0 chunks prompts longer than it; 0 ("auto") chunks prompts longer than PREFILL_CHUNK
    (2,048 tokens: enough rows to keep the matmuls compute-bound, and a prefill's workspace that grows
    monotonically with the prompt, which the memory planner's max_context search needs); for a target
    with routed experts (`moe`) at `batch` rows, chunks of PREFILL_TOKENS_MOE / batch tokens (in whole
    PREFILL_CHUNK_STEPs, at least PREFILL_CHUNK: 8,192 at batch 1, 4,096 at 2, 2,048 from 3 rows)."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"prefill_chunk must be an int >= 0 (0: auto), got {requested!r}")
    chunk = requested or (moe_prefill_chunk(batch) if moe else PREFILL_CHUNK)
    return chunk if prompt_len > chunk else None


def target_prefill_chunk(config, requested: int, prompt_len: int, batch: int = 1) -> int | None:
    """`prefill_chunk` for a target config: MoE (routed experts) or not, read from the config."""
    return prefill_chunk(requested, prompt_len, moe=getattr(config, "n_routed_experts", 0) > 0, batch=batch)


def moe_prefill_chunk(batch: int) -> int:
    """The auto prefill chunk of a target with routed experts at `batch` rows (`prefill_chunk`)."""
    tokens = PREFILL_TOKENS_MOE // max(1, batch) // PREFILL_CHUNK_STEP * PREFILL_CHUNK_STEP
    return max(PREFILL_CHUNK, tokens)


def loop_compiler_options(xla_flags: str | None = None, hidden_size: int | None = None) -> dict:
    """The compiler options of `generate`'s jit (module docstring, "gen. loop" and "split-K"): command
    buffers that also capture WHILE and CONDITIONAL, and for a target of hidden size <= SPLIT_K_MAX_HIDDEN
    no split-K in XLA's GEMMs. An option that XLA_FLAGS (or `xla_flags`) sets itself is left to it (e.g. an
    empty xla_gpu_enable_command_buffer, to see every kernel in a profile). XLA's CPU backend ignores both."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    options: dict = {}
    if "xla_gpu_enable_command_buffer" not in flags:
        options["xla_gpu_enable_command_buffer"] = LOOP_COMMAND_BUFFER
    return {**options, **gemm_compiler_options(flags, hidden_size)}


def gemm_compiler_options(xla_flags: str | None = None, hidden_size: int | None = None) -> dict:
    """The GEMM part of `loop_compiler_options` (module docstring, "split-K"), for any jit of a decode step:
    {xla_gpu_experimental_force_split_k: 1} for a target of hidden size <= SPLIT_K_MAX_HIDDEN unless XLA_FLAGS
    (or `xla_flags`) sets the option itself; else {}."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    small = hidden_size is not None and hidden_size <= SPLIT_K_MAX_HIDDEN
    if small and "xla_gpu_experimental_force_split_k" not in flags:
        return {"xla_gpu_experimental_force_split_k": 1}
    return {}


def verify_impl(impl: str, backend_name: str | None = None) -> str:
    """ "xla" or "pallas" for tree rejection sampling."""
    _check("sampling", impl, VERIFY_IMPLS)
    if impl != "auto":
        return impl
    return "pallas" if _on_gpu(backend_name) else "xla"


def tree_impl(impl: str, backend_name: str | None = None) -> str:
    """ "xla" or "pallas" for the DDTree builder (top-K and the best-first selection)."""
    _check("tree", impl, TREE_IMPLS)
    if impl != "auto":
        return impl
    return "pallas" if _on_gpu(backend_name) else "xla"


def tree_topk_chunk(vocab: int, k: int) -> int | None:
    """The tree builder's top-K chunk for rows longer than the kernel's (V > TREE_TOPK_MAX_ROW): the smallest power
    of two from tree_build.CHUNK whose ceil(V / chunk) x min(k, chunk) candidates fit one kernel row
    (`tree_topk_logits_chunked`: rows x chunks programs, then one over the candidates); None where no chunk does
    (the builder then prefilters in XLA). V <= TREE_TOPK_MAX_ROW, or AUTO_TREE_TOPK_CHUNKED off: None (one program
    a row, or the prefilter)."""
    if vocab <= TREE_TOPK_MAX_ROW or not AUTO_TREE_TOPK_CHUNKED:
        return None
    chunk = TREE_TOPK_CHUNK
    while chunk <= TREE_TOPK_MAX_ROW:
        candidates = -(-vocab // chunk) * min(k, chunk)
        if 1 << max(candidates - 1, 0).bit_length() <= TREE_TOPK_MAX_ROW:
            return chunk
        chunk *= 2
    return None


def prefilter_chunk(vocab: int, k: int) -> int:
    """The prefilter's chunk: a power of two near sqrt(V / K), balancing its two top_k sizes V / chunk and
    K * chunk."""
    target = math.sqrt(vocab / max(k, 1))
    return int(min(1024, max(8, 2 ** round(math.log2(max(target, 1.0))))))


def prefilter_pays(vocab: int, k: int) -> bool:
    chunk = prefilter_chunk(vocab, k)
    return vocab // chunk + k * chunk < vocab // 2


def topk_impl(impl: str, *, vocab: int, k: int) -> str:
    """ "xla" or "prefilter" for the per-depth top-K (the same on every backend: both are XLA)."""
    _check("top-k", impl, TOPK_IMPLS)
    if impl != "auto":
        return impl
    return "prefilter" if prefilter_pays(vocab, k) else "xla"


@dataclasses.dataclass(frozen=True)
class StageChoice:
    stage: str
    choice: str
    why: str


def decode_plan(
    options,
    target_config,
    *,
    method: str,
    budget: int,
    block_size: int,
    batch: int = 1,
    float32: bool = False,
    keys: int | None = None,
    backend_name: str | None = None,
) -> list[StageChoice]:
    """What one decode step runs with these `options` (an `options.DecodeOptions`) on a target of
    `target_config` with float32 (float32=True) or bf16 weights and caches, after `keys` committed tokens
    (None: unknown; the attention rules see the cache's rows: those + the step's slots, in whole
    CACHE_ROW_MULTIPLE blocks): one StageChoice per decision, after the "auto" rules above. The engine allocates
    the cache for the whole request (prompt + max_new_tokens + slots), so a run's attention kernel follows that
    capacity: pass it as `keys` (less the slots) to see what a given request runs."""
    options.check_step(method, budget=budget, block_size=block_size)  # the method, the budget, the block size
    if batch < 1 or (keys is not None and keys < 0):
        raise ValueError(f"batch must be >= 1 and keys >= 0 (or None), got batch {batch}, keys {keys}")
    backend_name = backend_name or backend()
    slots = 1 if method == "ar" else (budget + 1 if method == "ddtree" else block_size)
    rows = batch * slots
    mla = hasattr(target_config, "kv_lora_rank")
    group = 1 if mla else target_config.num_heads // target_config.num_kv_heads
    plan = []
    if method != "ar":
        vocab, k = target_config.vocab_size, min(budget, target_config.vocab_size) if method == "ddtree" else 1
        if method == "ddtree":
            builder = tree_impl(options.tree_impl, backend_name)
            plan.append(StageChoice("tree builder", builder, f"budget {budget}, K = {k}"))
            if options.topk_impl == "vocab_parallel":
                topk = "vocab_parallel"
            elif builder == "pallas" and options.topk_impl == "auto":
                chunk = tree_topk_chunk(vocab, k)
                if vocab <= TREE_TOPK_MAX_ROW:
                    topk = "pallas"
                else:
                    topk = "pallas after the prefilter" if chunk is None else f"pallas in chunks of {chunk}"
            else:
                topk = topk_impl(options.topk_impl, vocab=vocab, k=k)
            plan.append(StageChoice("tree top-k", topk, f"V = {vocab}, K = {k}"))
    mla_dims = (target_config.kv_lora_rank, target_config.qk_rope_head_dim) if mla else None
    if keys is not None:  # the committed tokens -> the cache's rows, whole blocks as the engine allocates them
        keys = -(-(keys + slots) // CACHE_ROW_MULTIPLE) * CACHE_ROW_MULTIPLE
    attention = attention_impl(
        options.attn_impl,
        queries=slots,
        keys=keys,
        mla=mla,
        group=group,
        float32=float32,
        mla_dims=mla_dims,
        backend_name=backend_name,
    )
    if mla:
        kernel = mla_attention_kernel(bfloat16=not float32, dims=mla_dims, backend_name=backend_name)
    else:
        gqa = dict(queries=slots, head_dim=target_config.head_dim, value_dim=target_config.head_dim)
        gqa.update(bfloat16=not float32, backend_name=backend_name)
        if keys is None:  # the kernel depends on the cache's rows
            long_kernel = gqa_attention_kernel(keys=AUTO_MOSAIC_GQA_MIN_KEYS, **gqa)
            kernel = (
                "triton"
                if long_kernel == "triton"
                else f"{long_kernel} from {AUTO_MOSAIC_GQA_MIN_KEYS} cache rows, else triton"
            )
        else:
            kernel = gqa_attention_kernel(keys=keys, **gqa)
    plan.append(
        StageChoice(
            "tree-forward attention",
            attention,
            f"{'absorbed MLA' if mla else 'GQA'}, {slots} queries per row"
            + (f" (the {kernel} kernel)" if attention == "pallas" else "")
            + ("" if keys is None else f" against {keys} cache rows")
            + (f" x {group} heads per KV head, float32" if float32 else ""),
        )
    )
    plan.append(
        StageChoice(
            "tree-forward matmul",
            matmul_impl(
                options.matmul_impl,
                rows=rows,
                quantized=False,
                backend_name=backend_name,
                weight_shape=(target_config.hidden_size, target_config.hidden_size),  # the o_proj shape, for "mosaic"
                bfloat16=not float32,
            ),
            f"{rows} rows, bf16 / float weights (INT4 and FP8 weights: the kernel up to {AUTO_PALLAS_MAX_ROWS} rows)",
        )
    )
    if hasattr(target_config, "n_routed_experts"):
        assignments = rows * target_config.num_experts_per_tok
        choice = (
            options.moe_impl
            if options.moe_impl != "auto"
            else moe_impl(
                assignments, target_config.n_routed_experts, backend_name, int4=target_config.expert_format == "int4"
            )
        )
        detail = f"{assignments} assignments over {target_config.n_routed_experts} experts"
        if choice == "pallas":  # inside the grouped path: the INT4 kernel, the sort, where gate / up rows come from
            gate_shape = (
                target_config.n_routed_experts,
                target_config.moe_intermediate_size,
                target_config.hidden_size,
            )
            x_dtype = jax.numpy.float32 if float32 else jax.numpy.bfloat16
            int4 = grouped_int4_kernel(assignments, gate_shape, x_dtype, backend_name)
            detail += (
                f"; INT4 experts on the {int4} grouped kernel, sorted by {moe_sort(assignments, backend_name)}"
                + (f", gate / up rows gathered by {grouped_gather()}" if int4 == "triton" else "")
            )
        if choice == "decode":
            detail += (
                "; INT4 experts read in place by the moe_decode kernels, other weights gathered"
                if assignments <= moe_decode_kernels.MAX_ASSIGNMENTS
                else f"; gathered (above the moe_decode kernels' {moe_decode_kernels.MAX_ASSIGNMENTS} assignments)"
            )
        detail += f"; the router's top-k by {router_topk(rows)}"
        plan.append(StageChoice("tree-forward MoE", choice, detail))
    verifier = options.verifier
    plan.append(
        StageChoice(
            "rejection walk",
            "xla" if verifier != "sampling" else verify_impl(options.verify_impl, backend_name),
            f"{verifier} verifier",
        )
    )
    plan.append(
        StageChoice("layer loop", options.layer_loop, "the model's default" if options.layer_loop == "auto" else "set")
    )
    loop = loop_compiler_options(hidden_size=target_config.hidden_size)
    if _on_gpu(backend_name):
        no_split = "xla_gpu_experimental_force_split_k" in loop
        plan.append(
            StageChoice(
                "GEMM split-K",
                "off" if no_split else "XLA's choice",
                f"hidden {target_config.hidden_size} "
                + ("<=" if target_config.hidden_size <= SPLIT_K_MAX_HIDDEN else ">")
                + f" SPLIT_K_MAX_HIDDEN = {SPLIT_K_MAX_HIDDEN}",
            )
        )
    plan.append(
        StageChoice(
            "generation loop",
            ("one CUDA graph" if loop else "XLA_FLAGS' command buffers") if _on_gpu(backend_name) else "xla",
            f"{options.steps_per_iteration} step(s) per iteration"
            + ("; while and conditional captured" if loop and _on_gpu(backend_name) else ""),
        )
    )
    return plan
