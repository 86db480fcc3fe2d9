"""Skinny weight-streaming matmul: the Mosaic GPU kernel (kernels/ddtree_kernels/skinny_matmul_mgpu.py) vs XLA
(`x @ w.T`, what the models run) vs the copy-bandwidth roofline.

Cases: the Qwen3-8B weights (N, K) = q/o proj (4096, 4096), k/v proj (1024, 4096), gate/up (12288, 4096), down
(4096, 12288) and the LM head (151936, 4096), each at M = 1, 17, 65 and 128 token rows (decode, and DDTree
verify of 16 / 64 / 127 tree nodes + root). --quick: M = 65, q/o, gate/up and down.

Counted first, per call: bytes = W read once (2 N K) + x (2 M K) + y (2 M N); FLOPs = 2 M N K;
roofline = max(bytes / 4.3 TB/s (read + write copy bandwidth measured on this H200), FLOPs / 790 TFLOP/s).
Timing (`op_profile.device_seconds`, as bench_gqa_mgpu): one jitted program calls the variant once on each of
>= 4 input sets, each a fresh x AND a fresh W (a model's layers never share a weight, so a call must not find
its W in the 50 MB L2: the sets of one case hold >= 2 x L2 of weights, up to MAX_SETS), and returns every
output; `*_us` = the device span of the program / the sets (the kernel and its wrapper's XLA ops: x's row pad,
the split-K sum). GB/s = bytes / time; `of_roof` = roofline time / time (1.0 = at the roofline);
speed-up = XLA us / kernel us; `*_wall_us`: the wall time of the same in-jit calls / the sets
(`common.in_jit_seconds`: CUDA graphs on, which the profiler turns off, but host dispatch and sync included);
`model_us`: the plan's `estimate_seconds` (to recalibrate the model). Correctness: max |y - ref| / max |ref| (and the Frobenius relative error)
against `skinny_matmul_reference` on input set 0 (bf16 output: expect ~4e-3).

--stacked L: every weight stacked [L, N, K] as a model's layer scan holds it, both variants timed inside a
`lax.scan` over the L layers: "xla" scans the stack as its input (each layer's weight sliced out, as the
models' scans do; XLA copies a slice it cannot fuse into its GEMM), "mgpu" reads each layer in place
(`skinny_matmul(..., layer=)`); `*_us` is per layer, the device's busy time in kernels (`op_profile.
device_busy_seconds`: every gap between kernels left out, the scan's between iterations, its predicate read back to
the host, among them; a first
run timed the span and measured that gap, ~20 us a layer for both). --weights k26_q_a,k26_kv_a,k26_o_shard (and the k26_* rest): the K2.6 TP8
shard's attention projections (q_a / kv_a replicated, o_proj's 1/8 columns: K = 1,024 of 8,192).
--sweep: also time the kernel at other tilings (--sweep-block-n x --sweep-block-k x --sweep-splits, each at
the most stages that fit) and print the best against the default `plan`.
--small: a CPU smoke run (tiny shapes, interpret mode, wall-clock `common.in_jit_seconds`, 2 sets): checks that
the script runs, the numbers mean nothing.

Usage: PYTHONPATH=.:kernels python -m benchmarks.bench_skinny_mgpu --commit $(git rev-parse --short HEAD) [--quick]
  [--sweep --sweep-block-n 64,128,256 --sweep-block-k 64,128 --sweep-splits 1,2,4,8,16]
Writes skinny_mgpu_<commit>.json to --out (default $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import itertools
import math

import jax
import jax.numpy as jnp

from benchmarks.common import (
    device_description,
    in_jit_seconds,
    markdown_table,
    max_relative_error,
    relative_error,
    write_result,
)
from benchmarks.op_profile import device_busy_seconds, device_seconds
from ddtree_kernels.skinny_matmul_mgpu import (
    BLOCK_KS,
    BLOCK_NS,
    compute_wgs,
    estimate_seconds,
    fit_stages,
    padded_rows,
    plan,
    skinny_matmul,
    skinny_matmul_reference,
    smem_bytes,
)

COPY_BANDWIDTH = 4.3e12  # bytes/s read + write, XLA copy on this H200 (BENCHMARKS.md)
PEAK_FLOPS = 790e12  # bf16 matmul rate measured on this H200
L2_BYTES = 50 << 20
MIN_SETS = 4
MAX_SETS = 16
WEIGHTS = {  # name: (N, K)
    "qo_proj": (4096, 4096),
    "kv_proj": (1024, 4096),
    "gate_up": (12288, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
    "k26_q_a": (1536, 7168),  # Kimi K2.6 q_a_proj (replicated under TP)
    "k26_kv_a": (576, 7168),  # kv_a_proj_with_mqa (replicated)
    "k26_o_shard": (7168, 1024),  # o_proj, one TP8 shard's columns (8 heads x 128)
    # the rest of the shard's dense projections in dispatch.IN_PLACE_PROJECTIONS: q_b (8 heads x 192 rows), the shared
    # expert's gate / up and down (256 of 2,048 columns), the dense layer's FFN (2,304 of 18,432)
    "k26_q_b_shard": (1536, 1536),
    "k26_shared_gate_up": (256, 7168),
    "k26_shared_down": (7168, 256),
    "k26_dense_gate_up": (2304, 7168),
    "k26_dense_down": (7168, 2304),
}
ROWS = (1, 17, 65, 128)
QUICK_WEIGHTS = ("qo_proj", "gate_up", "down")
SMALL_WEIGHTS = {"small_a": (256, 256), "small_b": (128, 512)}  # --small (interpret mode on the CPU)
SMALL_ROWS = (1, 17)


def counts(m: int, n: int, k: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one call."""
    return float(2 * m * n * k), float(2 * (n * k + m * k + m * n))


def num_sets(nbytes: float, small: bool) -> int:
    if small:
        return 2
    return min(MAX_SETS, max(MIN_SETS, math.ceil(2 * L2_BYTES / nbytes)))


def input_sets(m: int, n: int, k: int, count: int, key, layers: int = 0) -> list[tuple]:
    """`count` (x, w) sets, each fresh: x ~ N(0, 1), w ~ N(0, 1) / sqrt(K) (outputs of order 1); w [N, K], or
    [layers, N, K] with layers."""
    out = []
    for i in range(count):
        kx, kw = jax.random.split(jax.random.fold_in(key, i))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w_shape = (layers, n, k) if layers else (n, k)
        w = (jax.random.normal(kw, w_shape, jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        out.append((x, w))
    return out


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def _timer(small: bool, stacked: bool = False):
    if small:  # the CPU has no device timeline worth reading: wall time of the in-jit calls
        return lambda fn, sets, runs: in_jit_seconds(fn, sets, runs=1)
    if stacked:  # kernels only: the scan's per-iteration gaps (its predicate read back) are the loop's, not the layer's
        return lambda fn, sets, runs: device_busy_seconds(fn, sets, runs=runs)
    return lambda fn, sets, runs: device_seconds(fn, sets, runs=runs)


def sweep_configs(m: int, n: int, k: int, block_ns, block_ks, splits_list) -> list[tuple[int, int, int, int]]:
    """Valid (block_n, block_k, stages, splits) of the sweep, each at the most stages that fit."""
    out = []
    for block_n, block_k, splits in itertools.product(block_ns, block_ks, splits_list):
        if n % block_n or k % (block_k * splits):
            continue
        if (block_n // compute_wgs(block_n)) * padded_rows(m) > 128 * 128:
            continue
        stages = fit_stages(m, block_n, block_k, splits, k)
        if stages >= 2 or k // (block_k * splits) == 1:
            out.append((block_n, block_k, stages, splits))
    return out


def scanned(matmul_layer):
    """(x [M, K], stack [L, N, K]) -> [L, M, N]: matmul_layer(x, stack, layer) in a lax.scan over the layers."""

    def run(x, stack):
        def step(_, layer):
            return None, matmul_layer(x, stack, layer)

        return jax.lax.scan(step, None, jnp.arange(stack.shape[0], dtype=jnp.int32))[1]

    return run


def scanned_xla(x, stack):
    """The models' form: the stack scanned as the loop's input (each layer's weight sliced out), x @ w.T."""
    return jax.lax.scan(lambda _, w: (None, x @ w.T), None, stack)[1]


def run_case(name: str, m: int, n: int, k: int, key, args) -> dict:
    flops, nbytes = counts(m, n, k)
    roof_s = max(nbytes / COPY_BANDWIDTH, flops / PEAK_FLOPS)
    block_n, block_k, stages, splits = plan(m, n, k)
    layers = args.stacked
    sets_count = num_sets(nbytes * max(layers, 1), args.small)
    row = {
        "weight": name,
        "N": n,
        "K": k,
        "M": m,
        "MB": nbytes / 1e6,
        "GFLOP": flops / 1e9,
        "roofline_us": roof_s * 1e6,
        "bound": "compute" if flops / PEAK_FLOPS > nbytes / COPY_BANDWIDTH else "memory",
        "sets": sets_count,
        "plan": {"block_n": block_n, "block_k": block_k, "stages": stages, "splits": splits},
        "grid": [n // block_n, splits],
        "model_us": estimate_seconds(m, n, k, block_n, block_k, stages, splits) * 1e6,
        "smem_bytes": smem_bytes(m, block_n, block_k, stages, splits),
        "stacked_layers": layers,
    }
    interpret = True if args.small else None
    if layers:  # per layer of a scan over the stack (`scanned`): the kernel in place, XLA on scanned slices
        variants = {
            "mgpu": jax.jit(scanned(lambda x, w, layer: skinny_matmul(x, w, layer=layer, interpret=interpret))),
            "xla": jax.jit(scanned_xla),
        }
        reference = jax.jit(scanned(lambda x, w, layer: skinny_matmul_reference(x, w, layer=layer)))
    else:
        variants = {
            "mgpu": jax.jit(lambda x, w: skinny_matmul(x, w, interpret=interpret)),
            "xla": jax.jit(lambda x, w: x @ w.T),
        }
        reference = skinny_matmul_reference
    sets = input_sets(m, n, k, sets_count, key, layers)
    timer = _timer(args.small, bool(layers))
    ref = reference(*sets[0])
    for variant, fn in variants.items():
        try:
            out = fn(*sets[0])
            row[f"{variant}_max_err"] = max_relative_error(out, ref)
            row[f"{variant}_rel_err"] = relative_error(out, ref)
            seconds = timer(fn, sets, 3) / max(layers, 1)
            row[f"{variant}_us"] = seconds * 1e6
            if not args.small:  # wall time of the same in-jit calls (CUDA graphs on, host sync included)
                row[f"{variant}_wall_us"] = in_jit_seconds(fn, sets) * 1e6 / max(layers, 1)
            row[f"{variant}_GBps"] = nbytes / seconds / 1e9
            row[f"{variant}_of_roof"] = roof_s / seconds
        except Exception as err:  # noqa: BLE001 - a variant that fails to compile or run is a result
            row[f"{variant}_error"] = _error(err)
        for metric in ("us", "wall_us", "GBps", "of_roof", "max_err", "rel_err"):
            row.setdefault(f"{variant}_{metric}", float("nan"))
    row["speedup"] = row["xla_us"] / row["mgpu_us"]
    if args.sweep and not layers:
        block_ns = [int(v) for v in args.sweep_block_n.split(",") if v]
        block_ks = [int(v) for v in args.sweep_block_k.split(",") if v]
        splits_list = [int(v) for v in args.sweep_splits.split(",") if v]
        sweep = {}
        for config in sweep_configs(m, n, k, block_ns, block_ks, splits_list):
            bn, bk, st, sp = config
            fn = jax.jit(
                lambda x, w, bn=bn, bk=bk, st=st, sp=sp: skinny_matmul(
                    x, w, block_n=bn, block_k=bk, stages=st, splits=sp, interpret=interpret
                )
            )
            label = f"bn{bn}_bk{bk}_st{st}_s{sp}"
            try:
                err = max_relative_error(fn(*sets[0]), ref)
                model = estimate_seconds(m, n, k, bn, bk, st, sp) * 1e6
                sweep[label] = {"us": timer(fn, sets, 1) * 1e6, "max_err": err, "model_us": model}
            except Exception as e:  # noqa: BLE001
                sweep[label] = {"error": _error(e)}
        row["sweep"] = sweep
        timed = {label: r["us"] for label, r in sweep.items() if "us" in r}
        if timed:
            best = min(timed, key=timed.get)
            row["sweep_best"] = best
            row["sweep_best_us"] = timed[best]
    del sets
    return row


def cases(args) -> list[tuple[str, int, int, int]]:
    if args.small:
        return [(name, m, n, k) for name, (n, k) in SMALL_WEIGHTS.items() for m in SMALL_ROWS]
    names = [w for w in args.weights.split(",") if w] if args.weights else list(WEIGHTS)
    if args.quick and not args.weights:
        names = list(QUICK_WEIGHTS)
    for name in names:
        if name not in WEIGHTS:
            raise SystemExit(f"unknown weight {name!r}; choose from {sorted(WEIGHTS)}")
    rows = (
        [65] if args.quick and not args.rows else [int(r) for r in (args.rows or ",".join(map(str, ROWS))).split(",")]
    )
    return [(name, m, *WEIGHTS[name]) for name in names for m in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", help="directory for the JSON (default $OUT, else benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="M = 65 on q/o, gate/up and down only")
    parser.add_argument("--small", action="store_true", help="CPU smoke run: tiny shapes, interpret mode")
    parser.add_argument("--weights", default="", help=f"comma list of {sorted(WEIGHTS)} (default: all)")
    parser.add_argument("--rows", default="", help="comma list of M (default 1,17,65,128; --quick 65)")
    parser.add_argument("--sweep", action="store_true", help="also time other tilings of the kernel")
    parser.add_argument(
        "--stacked", type=int, default=0, help="L: weights stacked [L, N, K], timed per layer of a scan (docstring)"
    )
    parser.add_argument("--sweep-block-n", default=",".join(map(str, BLOCK_NS)))
    parser.add_argument("--sweep-block-k", default="64,128")
    parser.add_argument("--sweep-splits", default="1,2,4,8,16")
    args = parser.parse_args(argv)
    for value in args.sweep_block_k.split(","):
        if value and int(value) not in BLOCK_KS:
            raise SystemExit(f"--sweep-block-k {value} not in {BLOCK_KS}")
    print(
        f"device: {device_description()}; commit {args.commit}; roofline {COPY_BANDWIDTH / 1e12:.1f} TB/s, "
        f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s" + ("; --small: interpret mode, wall times" if args.small else ""),
        flush=True,
    )
    results = []
    key = jax.random.key(0)
    if args.stacked and args.sweep:
        raise SystemExit("--sweep times unstacked weights; leave out --stacked")
    name = (
        f"skinny_mgpu_{args.commit}"
        + ("_small" if args.small else "")
        + (f"_stacked{args.stacked}" if args.stacked else "")
    )
    for weight, m, n, k in cases(args):
        row = run_case(weight, m, n, k, jax.random.fold_in(key, m * 7919 + n + k), args)
        results.append(row)
        errors = "; ".join(f"{key_}: {v}" for key_, v in row.items() if key_.endswith("_error"))
        p = row["plan"]
        print(
            f"{weight:8s} N={n:6d} K={k:5d} M={m:3d} ({row['MB']:7.1f} MB, {row['GFLOP']:6.2f} GFLOP, roof "
            f"{row['roofline_us']:7.1f} us) plan bn{p['block_n']} bk{p['block_k']} st{p['stages']} s{p['splits']}: "
            f"mgpu {row['mgpu_us']:8.1f} us ({row['mgpu_GBps']:5.0f} GB/s, {row['mgpu_of_roof']:4.2f} of roof, "
            f"max err {row['mgpu_max_err']:.1e})  xla {row['xla_us']:8.1f} us ({row['xla_GBps']:5.0f} GB/s)  "
            f"speed-up {row['speedup']:4.2f}"
            + (f"  [{errors}]" if errors else "")
            + (f"\n      sweep best {row['sweep_best']} {row['sweep_best_us']:.1f} us" if "sweep_best" in row else ""),
            flush=True,
        )
        write_result(
            name,
            {"rows": results, "copy_bandwidth_Bps": COPY_BANDWIDTH, "peak_flops": PEAK_FLOPS, "small": args.small},
            args.commit,
            args.out,
        )
    header = ["weight", "N", "K", "M", "MB", "GFLOP", "roof us", "plan (bn, bk, st, s)", "model us", "mgpu us"]
    header += ["mgpu GB/s"]
    header += ["of roof", "xla us", "xla GB/s", "xla of roof", "speed-up", "mgpu wall us", "xla wall us", "max err"]
    table = [
        [
            r["weight"],
            r["N"],
            r["K"],
            r["M"],
            r["MB"],
            f"{r['GFLOP']:.2f}",
            r["roofline_us"],
            "{block_n}, {block_k}, {stages}, {splits}".format(**r["plan"]),
            r["model_us"],
            r["mgpu_us"],
            f"{r['mgpu_GBps']:.0f}",
            f"{r['mgpu_of_roof']:.2f}",
            r["xla_us"],
            f"{r['xla_GBps']:.0f}",
            f"{r['xla_of_roof']:.2f}",
            f"{r['speedup']:.2f}",
            r["mgpu_wall_us"],
            r["xla_wall_us"],
            f"{r['mgpu_max_err']:.1e}",
        ]
        for r in results
    ]
    print("\n" + markdown_table(header, table))
    if args.sweep:
        print("\nsweep (us):")
        for r in results:
            timed = {label: s["us"] for label, s in r.get("sweep", {}).items() if "us" in s}
            ranked = sorted(timed.items(), key=lambda kv: kv[1])[:5]
            print(
                f"  {r['weight']} M={r['M']}: plan {r['mgpu_us']:.1f}; " + ", ".join(f"{a} {b:.1f}" for a, b in ranked)
            )
    failed = [r for r in results if "mgpu_error" in r or not r["mgpu_max_err"] < 2e-2]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
