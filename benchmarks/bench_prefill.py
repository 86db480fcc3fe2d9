"""Prefill benchmark: how long the engine's prefill takes against the prompt length, chunked or whole.

For each context (prompt length) and chunk setting it compiles `engine.generate.start_state` (the target's
prefill, the first token, and for a pair with a drafter the drafter's context append) on one random prompt
(B = 1, a random-weight target in bf16: `--shape qwen3-8b` or `tiny` (Qwen3), `k2.6` (the Kimi K2.6 width,
4 layers unless --layers: MLA, 384 random INT4 experts) or `k2-tiny`) and times it (median of `--repeats`
runs, each on a fresh random prompt, `block_until_ready`; compilation timed apart). Counted per prefill of
T tokens in chunks of C (the target only; the drafter's append is a few matmuls per token, not counted):

  matmul FLOPs     2 x T x (the parameters every token multiplies: attention projections, the MLP / the
                   router, the k routed and the shared experts) + 2 x (T / C) x the LM head (the engine
                   computes the logits of one row per chunk); MLA also expands every key once
                   (W_UK, W_UV: 2 x T x H x kv_lora x (nope + v))
  attention FLOPs  layers x 2 x Hq x (Dk + Dv) x T^2 / 2  (scores and values, causal: half the square;
                   Qwen3 Dk = Dv = head_dim; MLA's expanded form Dk = nope + rope, Dv = v)
Counted are the FLOPs the problem needs, not what a path spends beyond them (the blockwise path's scores
above the diagonal, the expanded MLA form's re-expansion of the cache per chunk).
  TFLOP/s          (matmul + attention FLOPs) / seconds, and its share of the bf16 peak (790 TFLOP/s, the
                   rate measured on an H200: BENCHMARKS.md)

plus the compiled program's temporary memory (`memory_analysis().temp_size_in_bytes`): chunked, it grows
with the chunk; whole, with T x context (the score matrix) unless attention goes blockwise.

Targets (#24, one H200): the Qwen3-8B shape prefills 32k tokens in <= 3 s (>= 35% of the peak); 128k runs;
the K2.6 width (4 layers) prefills 32k and 128k tokens, at 32k >= 35% of the peak.

Usage: python -m benchmarks.bench_prefill --commit $(git rev-parse --short HEAD) [--shape qwen3-8b]
       [--contexts 2048,8192,32768] [--chunks 0,2048] [--layers N] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_engine import SHAPES
from benchmarks.common import device_description, markdown_table, write_result
from benchmarks.k26_model import k26_config, random_int4_target
from ddtree_jax import dispatch
from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.engine.generate import start_state
from ddtree_jax.models import qwen3
from ddtree_jax.options import DecodeOptions
from ddtree_jax.sampling import SamplingParams, row_keys

K2_SHAPES = {"k2.6": False, "k2-tiny": True}  # --shape -> k26_config's tiny flag (MLA + INT4 MoE targets)
PEAK_FLOPS = 790e12  # measured bf16 matmul rate of one H200 here (BENCHMARKS.md)


def prefill_flops(config, tokens: int, head_rows: int = 1) -> dict[str, float]:
    """{"matmul", "attention"} FLOPs of one T-token prefill whose LM head runs on `head_rows` rows (one per
    chunk), for a Qwen3 or a DeepSeek-V3 / K2 target (module docstring)."""
    c = config
    if isinstance(c, DeepSeekV3Config):
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        heads = c.num_heads
        q_proj = (
            c.hidden_size * c.q_lora_rank + c.q_lora_rank * heads * qk if c.q_lora_rank else c.hidden_size * heads * qk
        )
        attn_proj = (
            q_proj
            + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
            + heads * c.v_head_dim * c.hidden_size
            + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)  # every key expanded once
        )
        dense_mlp = 3 * c.hidden_size * c.intermediate_size
        moe_mlp = c.hidden_size * c.n_routed_experts + 3 * c.hidden_size * c.moe_intermediate_size * (
            c.num_experts_per_tok + c.n_shared_experts
        )
        dense_layers = min(c.first_k_dense_replace, c.num_layers)
        per_token = c.num_layers * attn_proj + dense_layers * dense_mlp + (c.num_layers - dense_layers) * moe_mlp
        pair = heads * (qk + c.v_head_dim)
    else:
        q = c.num_heads * c.head_dim
        kv = c.num_kv_heads * c.head_dim
        per_token = c.num_layers * (
            c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        )
        pair = 2 * q
    matmul = 2.0 * tokens * per_token + 2.0 * head_rows * c.vocab_size * c.hidden_size
    attention = c.num_layers * 2 * pair * tokens * tokens / 2
    return {"matmul": matmul, "attention": float(attention)}


def bench_prefill(
    config,
    params,
    *,
    context: int,
    chunk: int,
    repeats: int,
    seed: int = 0,
    attn_impl: str = "auto",
    profile_top: int = 0,
) -> dict:
    """One row: compile and time `start_state` on a `context`-token prompt (module docstring). profile_top > 0:
    also one profiled prefill, its device time by kind of op (`op_profile.kind_table`: GEMMs, each kernel by
    name, other fusions) and its `profile_top` largest ops, in the row."""
    options = DecodeOptions(prefill_chunk=chunk, attn_impl=attn_impl)

    def run(params, prompts, lengths):  # params an argument: closed over, they would be baked in as constants
        return start_state(
            config,
            params,
            None,
            prompts,
            lengths,
            SamplingParams.create(1, temperature=0.0),
            row_keys(jax.random.key(seed), jnp.arange(1)),
            jnp.full((1, 1), -1, jnp.int32),
            jnp.full((1,), 2, jnp.int32),
            max_new_tokens=2,
            method="ar",
            budget=1,
            block_size=1,
            cache_dtype=jnp.bfloat16,
            options=options,
        ).bonus

    lengths = jnp.full((1,), context, jnp.int32)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    compiled = jax.jit(run).lower(params, jax.ShapeDtypeStruct((1, context), jnp.int32), lengths).compile()
    compile_s = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    times = []
    for i in range(repeats + 1):  # the first run warms up; every run reads a fresh prompt
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (1, context)), jnp.int32)
        jax.block_until_ready(prompt)
        begin = time.perf_counter()
        jax.block_until_ready(compiled(params, prompt, lengths))
        if i:
            times.append(time.perf_counter() - begin)
    seconds = float(np.median(times))
    profile = {}
    if profile_top > 0:
        from benchmarks.op_profile import kind_table, op_kinds, op_times

        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (1, context)), jnp.int32)
        ops = op_times(compiled, params, prompt, lengths, runs=1)
        kinds = kind_table(ops, op_kinds(compiled.as_text()))  # containers (a while loop's event) left out
        profile = {
            "device_s": sum(r["us_per_run"] for r in kinds) / 1e6,
            "launches": sum(r["events_per_run"] for r in kinds),
            "kinds": kinds,
            "ops": ops,  # every op (a prefill launches a few hundred distinct ones)
        }
    chunk_len = dispatch.target_prefill_chunk(config, chunk, context, batch=1)
    flops = prefill_flops(config, context, head_rows=1 if chunk_len is None else -(-context // chunk_len))
    total = flops["matmul"] + flops["attention"]
    return {
        "context": context,
        "chunk": chunk,
        "attn_impl": attn_impl,
        "seconds": seconds,
        "tokens_per_s": context / seconds,
        "matmul_flops": flops["matmul"],
        "attention_flops": flops["attention"],
        "tflops": total / seconds / 1e12,
        "peak_share": total / seconds / PEAK_FLOPS,
        "temp_bytes": temp,
        "compile_s": compile_s,
        **({"profile": profile} if profile else {}),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown", help="the commit measured (recorded in the JSON)")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES) + sorted(K2_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    parser.add_argument("--contexts", default="2048,8192,32768", help="prompt lengths (default 2048,8192,32768)")
    parser.add_argument(
        "--chunks", default="0,2048", help="DecodeOptions.prefill_chunk values (0: auto; default 0,2048)"
    )
    parser.add_argument(
        "--attn-impls",
        default="auto",
        help="DecodeOptions.attn_impl values, one row each (auto: the causal Mosaic kernel on GPU; blockwise: XLA)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (default 3; median)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default $OUT, else benchmarks/results)")
    parser.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="also profile each row: device time by kind of op and its N largest ops (on GPU run with "
        "XLA_FLAGS=--xla_gpu_enable_command_buffer= to see the kernels inside XLA's CUDA graphs)",
    )
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    if any(c < 1 for c in contexts) or any(c < 0 for c in chunks) or args.repeats < 1:
        raise SystemExit(
            f"error: contexts >= 1, chunks >= 0, --repeats >= 1 (got {contexts}, {chunks}, {args.repeats})"
        )
    if args.shape in K2_SHAPES:
        config = k26_config(args.layers or 4, tiny=K2_SHAPES[args.shape])
    else:
        config = SHAPES[args.shape][0]
        if args.layers is not None:
            config = dataclasses.replace(config, num_layers=args.layers, tapped_layers=())
    config = dataclasses.replace(config, max_position_embeddings=max(config.max_position_embeddings, 2 * max(contexts)))
    if args.shape in K2_SHAPES:  # random INT4 experts made on the device, one layer at a time
        params = jax.jit(lambda key: random_int4_target(config, key, jnp.bfloat16))(jax.random.key(0))
    else:
        params = qwen3.init_params(config, jax.random.key(0), jnp.bfloat16)
    print(f"device: {device_description()}; commit {args.commit}; {args.shape}, {config.num_layers} layers", flush=True)
    rows = []
    for context, chunk, attn_impl in itertools.product(contexts, chunks, args.attn_impls.split(",")):
        try:
            row = bench_prefill(
                config,
                params,
                context=context,
                chunk=chunk,
                repeats=args.repeats,
                attn_impl=attn_impl,
                profile_top=args.profile_top,
            )
        except Exception as error:  # e.g. out of memory at a long context: recorded, the sweep goes on
            row = {
                "context": context,
                "chunk": chunk,
                "attn_impl": attn_impl,
                "error": f"{type(error).__name__}: {str(error)[:200]}",
            }
        rows.append(row)
        print(
            f"  context {context:>7} chunk {chunk:>5} attn {attn_impl:9s}: "
            + (
                row["error"]
                if "error" in row
                else f"{row['seconds'] * 1e3:9.1f} ms  {row['tflops']:6.1f} TFLOP/s  "
                f"temp {row['temp_bytes'] / 2**30:6.2f} GiB  (compile {row['compile_s']:.0f} s)"
            ),
            flush=True,
        )
        if "profile" in row:
            from benchmarks.op_profile import format_profile

            print(format_profile(row["profile"]["kinds"], row["profile"]["ops"], args.profile_top), flush=True)
        write_result(
            f"prefill_{args.shape}_{args.commit}",
            {"settings": vars(args), "layers": config.num_layers, "rows": rows},
            args.commit,
            args.out,
        )
    print(
        markdown_table(
            ["context", "chunk", "attention", "ms", "tokens/s", "TFLOP/s", "peak share", "temp GiB"],
            [
                [r["context"], r["chunk"] or "auto", r["attn_impl"], "error", "", "", "", ""]
                if "error" in r
                else [
                    r["context"],
                    r["chunk"] or "auto",
                    r["attn_impl"],
                    r["seconds"] * 1e3,
                    r["tokens_per_s"],
                    r["tflops"],
                    f"{r['peak_share']:.0%}",
                    r["temp_bytes"] / 2**30,
                ]
                for r in rows
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
