"""Tree-verify attention benchmark: kernels/tree_attention.py vs the models' XLA attention vs the roofline.

Cases: contexts 1k..128k, N = 9, 17, 65 tree queries, B = 1 and 8, for
  mla64: absorbed MLA on one GPU: 64 query heads, one shared KV head, scores over latent 512 + rope 64,
         values the 512-dim latent (the two key parts passed separately, as deepseek_v3 does);
  mla8:  the same with 8 query heads (one shard of TP8);
  gqa:   Qwen3-8B attention: 32 query heads over 8 KV heads, head_dim 128;
  tiny:  the embedded pair's target: 4 query heads over 2 KV heads, head_dim 64.
The cache holds exactly context + N keys; every row sees its whole prefix plus its tree slots under a
random ancestor mask.

Counted per call:
  FLOPs = B * N * Hq * S * 2 * (sum of key dims + value dim)  (scores + weighted values);
  bytes = the KV cache read once (MLA: latent + rope key, 1152 B per key; GQA: K and V of 8 heads,
          4096 B per key) + the queries and outputs; the bool mask is not counted (an ideal kernel
          derives the prefix part).
  roofline time = max(bytes / copy bandwidth measured in this run, FLOPs / 790 TFLOP/s, the bf16
  matmul rate measured on this H200 kind: BENCHMARKS.md).
XLA = `tree_attention_reference` (the models' XLA path: [latent ; rope] concatenated per call, scores
materialised in float32); cases whose float32 scores would exceed 8 GB are not run on XLA.

Timing: REPS calls inside one jit (fori_loop), rotating over enough cache copies that the data of
consecutive calls does not sit in the 50 MB L2; median of 7 runs.

Usage: python -m benchmarks.bench_attention --commit $(git rev-parse --short HEAD) [--quick]
       [--variants mla64,mla8,gqa] [--contexts 1024,8192,32768,131072] [--steps 9,17,65] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    copy_bandwidth,
    device_description,
    markdown_table,
    median_seconds,
    random_tree_mask,
    write_result,
)
from ddtree_jax.engine.run import DTYPES
from ddtree_kernels.tree_attention import (
    BlockConfig,
    block_rows,
    default_block_config,
    shared_memory_bytes,
    tree_attention,
    tree_attention_reference,
)

REPS = 5
PEAK_FLOPS = 790e12  # measured bf16 matmul rate of one H200 here (BENCHMARKS.md)
L2_BYTES = 50 << 20
XLA_SCORE_LIMIT = 8e9  # bytes of float32 scores above which the XLA path is not run
VARIANTS = {
    # name: (query heads, KV heads, key part dims, value dim); MLA values are the latent (key part 0)
    "mla64": (64, 1, (512, 64), 512),
    "mla8": (8, 1, (512, 64), 512),
    "gqa": (32, 8, (128,), 128),
    "tiny": (4, 2, (64,), 64),  # the embedded pair's target (checkpoints/embedded)
}


def case_inputs(variant: str, batch: int, steps: int, context: int, copies: int, key, dtype=jnp.bfloat16):
    q_heads, kv_heads, dims, dv = VARIANTS[variant]
    capacity = context + steps
    keys = jax.random.split(key, 2 * len(dims) + 1)
    q_parts = tuple(jax.random.normal(keys[i], (REPS, batch, steps, q_heads, d), dtype) for i, d in enumerate(dims))
    k_parts = tuple(
        jax.random.normal(keys[len(dims) + i], (copies, batch, capacity, kv_heads, d), dtype)
        for i, d in enumerate(dims)
    )
    mla = len(dims) == 2  # values: the latent key part (v=None), as deepseek_v3 passes them
    v = None if mla else jax.random.normal(keys[-1], (copies, batch, capacity, kv_heads, dv), dtype)
    mask = jnp.asarray(random_tree_mask(np.random.default_rng(steps * 7 + batch), batch, steps, context))
    return q_parts, k_parts, v, mask


def counts(variant: str, batch: int, steps: int, context: int, itemsize: int = 2) -> tuple[float, float]:
    q_heads, kv_heads, dims, dv = VARIANTS[variant]
    capacity = context + steps
    mla = len(dims) == 2
    per_key = kv_heads * itemsize * (sum(dims) if mla else sum(dims) + dv)
    q_bytes = batch * steps * q_heads * itemsize * (sum(dims) + dv)
    flops = batch * steps * q_heads * capacity * 2 * (sum(dims) + dv)
    return float(flops), float(batch * capacity * per_key + q_bytes)


def timed(attend, q_parts, k_parts, v, mask) -> float:
    """Seconds per call: REPS calls inside one jit, call i on query set i and cache copy i % copies."""
    copies = k_parts[0].shape[0]

    @jax.jit
    def run(q_parts, k_parts, v, mask):
        def body(i, acc):
            c = i % copies
            ks = tuple(k[c] for k in k_parts)
            values = ks[0] if v is None else v[c]
            out = attend(tuple(q[i] for q in q_parts), ks, values, mask)
            return acc + out[:, :, 0, :8].astype(jnp.float32).sum()

        return jax.lax.fori_loop(0, REPS, body, 0.0)

    return median_seconds(run, q_parts, k_parts, v, mask) / REPS


def relative_error(q_parts, k_parts, v, mask) -> float:
    """max |kernel - XLA| / max |XLA| on query set 0 and cache copy 0 (checks the GPU compile)."""
    args = (tuple(q[0] for q in q_parts), tuple(k[0] for k in k_parts), None if v is None else v[0], mask)
    got = np.asarray(tree_attention(*args), np.float32)
    ref = np.asarray(tree_attention_reference(*args), np.float32)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def sweep(variants, copy_bw, commit, context: int = 32768) -> None:
    """Time every tiling that fits the shared memory at N = 17, B = 1 (picks the defaults)."""
    results = []
    for variant in variants:
        q_heads, kv_heads, dims, dv = VARIANTS[variant]
        steps, batch = 17, 1
        flops, nbytes = counts(variant, batch, steps, context)
        copies = int(min(16, max(1, math.ceil(2 * L2_BYTES / nbytes))))
        inputs = case_inputs(variant, batch, steps, context, copies, jax.random.key(3))
        block_m = block_rows(q_heads // kv_heads, steps)
        default = default_block_config(block_m, dims, dv)
        for block_s in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    config = BlockConfig(block_s, warps, stages)
                    smem = shared_memory_bytes(block_m, dims, dv, config)
                    if smem > 232_448:  # what the H200 reports available
                        continue
                    try:
                        seconds = timed(lambda q, k, v, m: tree_attention(q, k, v, m, config=config), *inputs)
                    except Exception as err:  # noqa: BLE001 - a tiling Triton rejects is a result of the sweep
                        print(f"{variant:5s} {config}: failed ({type(err).__name__}: {str(err)[:120]})", flush=True)
                        continue
                    row = {
                        "variant": variant,
                        "config": list(config),
                        "smem_KB": smem / 1024,
                        "us": seconds * 1e6,
                        "TFLOPs": flops / seconds / 1e12,
                        "GBps": nbytes / seconds / 1e9,
                        "default": config == default,
                    }
                    results.append(row)
                    print(
                        f"{variant:5s} {config} smem {smem / 1024:6.1f} KB: {row['us']:8.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
                        f"{row['GBps']:6.0f} GB/s{'  (default)' if row['default'] else ''}",
                        flush=True,
                    )
                    write_result("attention_sweep", {"rows": results, "copy_bandwidth_Bps": copy_bw}, commit)
        del inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--variants", default="mla64,mla8,gqa")
    parser.add_argument("--contexts", default="1024,8192,32768,131072")
    parser.add_argument("--steps", default="9,17,65")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-xla", action="store_true", help="time the kernel only")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="queries and caches")
    parser.add_argument("--quick", action="store_true", help="N = 17, B = 1, contexts 8k and 32k")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time every tiling at N = 17, B = 1, context 32k (or the last of --contexts), then stop",
    )
    args = parser.parse_args()
    contexts = [8192, 32768] if args.quick else [int(c) for c in args.contexts.split(",")]
    steps_list = [17] if args.quick else [int(n) for n in args.steps.split(",")]
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")
    on_gpu = jax.default_backend() == "gpu"
    copy_bw = copy_bandwidth(REPS) if on_gpu else float("nan")
    print(
        f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s; "
        f"peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    if args.sweep:
        return sweep(
            args.variants.split(","),
            copy_bw,
            args.commit,
            contexts[-1] if args.contexts != "1024,8192,32768,131072" else 32768,
        )
    results = []
    key = jax.random.key(0)
    dtype = DTYPES[args.dtype]
    for variant in args.variants.split(","):
        q_heads, kv_heads, dims, _ = VARIANTS[variant]
        for batch in batches:
            for steps in steps_list:
                for context in contexts:
                    flops, nbytes = counts(variant, batch, steps, context, jnp.dtype(dtype).itemsize)
                    copies = int(min(16, max(1, math.ceil(2 * L2_BYTES / nbytes))))
                    inputs = case_inputs(
                        variant, batch, steps, context, copies, jax.random.fold_in(key, context + steps), dtype
                    )
                    roof_s = max(nbytes / copy_bw, flops / PEAK_FLOPS)
                    kernel_s = timed(lambda q, k, v, m: tree_attention(q, k, v, m), *inputs)
                    score_bytes = 4 * batch * steps * q_heads * (context + steps)
                    xla_s = error = float("nan")
                    if not args.no_xla and score_bytes <= XLA_SCORE_LIMIT:
                        xla_s = timed(lambda q, k, v, m: tree_attention_reference(q, k, v, m), *inputs)
                        error = relative_error(*inputs)
                    row = {
                        "variant": variant,
                        "dtype": args.dtype,
                        "B": batch,
                        "N": steps,
                        "context": context,
                        "GFLOP": flops / 1e9,
                        "MB": nbytes / 1e6,
                        "pallas_us": kernel_s * 1e6,
                        "xla_us": xla_s * 1e6,
                        "pallas_TFLOPs": flops / kernel_s / 1e12,
                        "pallas_GBps": nbytes / kernel_s / 1e9,
                        "roofline_us": roof_s * 1e6,
                        "of_roofline": kernel_s / roof_s,
                        "speedup_vs_xla": xla_s / kernel_s,
                        "bound": "compute" if flops / PEAK_FLOPS > nbytes / copy_bw else "memory",
                        "relerr_vs_xla": error,
                    }
                    results.append(row)
                    print(
                        f"{variant:5s} B={batch} N={steps:3d} ctx={context:6d}: pallas {row['pallas_us']:9.1f} us "
                        f"({row['pallas_TFLOPs']:6.1f} TFLOP/s, {row['pallas_GBps']:6.0f} GB/s, {row['of_roofline']:5.2f}x roof "
                        f"{row['roofline_us']:.1f} us, {row['bound']})  xla {row['xla_us']:9.1f} us "
                        f"({row['speedup_vs_xla']:.2f}x; relerr {error:.1e})",
                        flush=True,
                    )
                    write_result(
                        "attention",
                        {"rows": results, "copy_bandwidth_Bps": copy_bw, "peak_flops": PEAK_FLOPS},
                        args.commit,
                    )
                    del inputs
    header = ["variant", "B", "N", "context", "pallas us", "TFLOP/s", "GB/s", "x roofline", "bound", "xla us", "vs xla"]
    table = [
        [
            r["variant"],
            r["B"],
            r["N"],
            r["context"],
            r["pallas_us"],
            f"{r['pallas_TFLOPs']:.0f}",
            f"{r['pallas_GBps']:.0f}",
            f"{r['of_roofline']:.2f}",
            r["bound"],
            r["xla_us"],
            f"{r['speedup_vs_xla']:.2f}",
        ]
        for r in results
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
