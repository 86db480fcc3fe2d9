"""Weight-streaming matmul benchmark: kernels/decode_matmul.py vs plain XLA vs the copy bandwidth.

Per matmul (shapes of Qwen3-8B and Kimi K2.6, weights [N, K] = (out, in)), at M = 1, 8, 17, 65, 257
activation rows: time of the Pallas kernel and of the XLA reference (`x @ dense(w).T`, what the models
run without kernels), each inside one jit running REPS products on different activations, and the
effective bandwidth = weight bytes / time against the copy bandwidth measured in the same run (1 GiB
buffer, read + write). INT4 weights: 0.5 byte per weight + bf16 scales per 32; FP8: 1 byte + block
scales. The grouped MoE case: 8 * T assignments over 384 K2.6 INT4 experts (routing drawn uniformly),
bytes = the distinct experts touched.

Whole forwards (the issue's second table) come from `benchmarks/bench_engine.py --matmul-impl pallas`
(AR step and verify forwards of the Qwen3-8B-shaped target against plain XLA).

Targets (issue 12): each matmul >= 80% of the copy bandwidth for M <= 65.

Usage: python benchmarks/bench_matmul.py --commit $(git rev-parse --short HEAD) [--quick] [--shapes tiny]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.common import copy_bandwidth, device_description, markdown_table, median_seconds, write_result  # noqa: E402
from ddtree_jax.models.quant import Fp8BlockWeight, Int4Weight, dense  # noqa: E402
from kernels.decode_matmul import grouped_matmul, matmul  # noqa: E402

REPS = 10
SHAPES = {
    # name: (N, K, format)
    "qwen3-8b": [("q_proj", 4096, 4096, "bf16"), ("kv_proj", 1024, 4096, "bf16"), ("gate/up", 12288, 4096, "bf16"),
                 ("down", 4096, 12288, "bf16"), ("lm_head", 151936, 4096, "bf16")],
    "k2.6": [("q_b_proj", 64 * 192, 1536, "bf16"), ("o_proj", 7168, 64 * 128, "bf16"), ("dense gate", 18432, 7168, "bf16"),
             ("expert gate (int4)", 2048, 7168, "int4"), ("expert down (int4)", 7168, 2048, "int4"),
             ("dsv3 o_proj (fp8)", 7168, 16384, "fp8")],
    "tiny": [("tiny", 320, 256, "bf16"), ("tiny int4", 320, 256, "int4"), ("tiny fp8", 256, 256, "fp8")],
}


def _weight(n, k, fmt, key):
    if fmt == "bf16":
        return jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02
    if fmt == "int4":
        packed = jax.random.randint(key, (n, k // 8), -(2**31), 2**31 - 1, jnp.int32)
        return Int4Weight(packed, jnp.full((n, k // 32), 0.01, jnp.bfloat16))
    w = (jax.random.normal(key, (n, k)) * 0.5).astype(jnp.float8_e4m3fn)
    return Fp8BlockWeight(w, jnp.full((-(-n // 128), -(-k // 128)), 0.02, jnp.float32))


def _nbytes(weight) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weight))




def _timed(op, xs, weight):
    """Seconds per product: REPS products on REPS activations inside one jit."""
    @jax.jit
    def run(xs, weight):
        return jax.lax.fori_loop(0, REPS, lambda i, acc: acc + op(xs[i], weight).astype(jnp.float32).sum(), 0.0)

    return median_seconds(run, xs, weight) / REPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shapes", default="qwen3-8b,k2.6")
    parser.add_argument("--rows", default="1,8,17,65,257")
    parser.add_argument("--quick", action="store_true", help="M = 1 and 17 only")
    args = parser.parse_args()
    rows_list = [1, 17] if args.quick else [int(m) for m in args.rows.split(",")]
    copy_bw = copy_bandwidth(REPS) if jax.default_backend() == "gpu" else float("nan")
    print(f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    results = []
    key = jax.random.key(1)
    for shape_set in args.shapes.split(","):
        for name, n, k, fmt in SHAPES[shape_set]:
            weight = _weight(n, k, fmt, jax.random.fold_in(key, n * 7 + k))
            nbytes = _nbytes(weight)
            for m in rows_list:
                xs = jax.random.normal(jax.random.fold_in(key, m), (REPS, m, k), jnp.bfloat16)
                kernel_s = _timed(lambda x, w: matmul(x, w), xs, weight)
                xla_s = _timed(lambda x, w: jnp.einsum("mk,nk->mn", x, dense(w, x.dtype)), xs, weight)
                row = {"set": shape_set, "name": name, "N": n, "K": k, "format": fmt, "M": m, "weight_MB": nbytes / 1e6,
                       "pallas_us": kernel_s * 1e6, "xla_us": xla_s * 1e6, "pallas_GBps": nbytes / kernel_s / 1e9,
                       "xla_GBps": nbytes / xla_s / 1e9, "pallas_of_copy": nbytes / kernel_s / copy_bw}
                results.append(row)
                print(f"{shape_set:8s} {name:20s} M={m:4d}: pallas {row['pallas_us']:9.1f} us ({row['pallas_GBps']:7.0f} GB/s, "
                      f"{100 * row['pallas_of_copy']:5.1f}% of copy)  xla {row['xla_us']:9.1f} us ({row['xla_GBps']:7.0f} GB/s)",
                      flush=True)
                write_result("matmul", {"rows": results, "copy_bandwidth_Bps": copy_bw}, args.commit)
    if "k2.6" in args.shapes:  # the MoE hot path: T tokens x top-8 of 384 INT4 experts
        experts = 384
        weight = Int4Weight(jax.random.randint(key, (experts, 2048, 7168 // 8), -(2**31), 2**31 - 1, jnp.int32),
                            jnp.full((experts, 2048, 7168 // 32), 0.01, jnp.bfloat16))
        for tokens in (1, 17, 65):
            assign = tokens * 8
            chosen = np.random.default_rng(tokens).integers(0, experts, assign)
            sizes = jnp.asarray(np.bincount(chosen, minlength=experts), jnp.int32)
            distinct = len(set(chosen.tolist()))
            xs = jax.random.normal(key, (REPS, assign, 7168), jnp.bfloat16)
            kernel_s = _timed(lambda x, w: grouped_matmul(x, w, sizes), xs, weight)
            nbytes = distinct * 2048 * 7168 * (0.5 + 2 / 32)
            row = {"set": "k2.6", "name": f"grouped experts gate, T={tokens}", "M": assign, "distinct_experts": distinct,
                   "weight_MB": nbytes / 1e6, "pallas_us": kernel_s * 1e6, "pallas_GBps": nbytes / kernel_s / 1e9,
                   "pallas_of_copy": nbytes / kernel_s / copy_bw}
            results.append(row)
            print(f"grouped INT4 experts T={tokens:3d} ({distinct} distinct): {row['pallas_us']:9.1f} us "
                  f"({row['pallas_GBps']:7.0f} GB/s, {100 * row['pallas_of_copy']:5.1f}% of copy)", flush=True)
            write_result("matmul", {"rows": results, "copy_bandwidth_Bps": copy_bw}, args.commit)
    header = ["set", "matmul", "M", "weight MB", "pallas us", "pallas GB/s", "% of copy", "xla us", "xla GB/s"]
    table = [[r["set"], r["name"], r["M"], f"{r['weight_MB']:.1f}", r["pallas_us"], f"{r['pallas_GBps']:.0f}",
              f"{100 * r['pallas_of_copy']:.0f}", r.get("xla_us", ""), f"{r['xla_GBps']:.0f}" if "xla_GBps" in r else ""]
             for r in results]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
