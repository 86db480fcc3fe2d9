"""Device time of the decode step's small kernels, variant by variant, read from a profiler trace.

At the embedded pair's shape (V = 8,192, 15 draft depths, 1-65 tree slots) the builder's and the walk's
kernels run 1-90 us, below what a host-timed loop resolves (`bench_tree_sampling` measured every variant at
75-250 us per call there: host dispatch). This benchmark sums each variant's kernel time on the device
(`benchmarks.op_profile.op_times`: the trace's events of the variant's own pallas_call, nothing else), so
the variants can be ranked and the dispatch rules set from it:

  topk       `tree_build.tree_topk` per method (extract / search / resident) at k = budget, [15, V] rows;
             and the builder's whole top-K stage from bf16 logits, every op: XLA log-softmax + row flags +
             the kernel against the fused `tree_topk_logits`
  slots      `tree_build.tree_slots` (selection + layout) and `tree_select` (selection alone) per budget
  row_stats  `tree_sampling.row_stats`, layout "single", per SingleTiling, T = 0 and T = 1 with top-p 0.95,
             over B x N rows (N = budget + 1)

Every call reads its own input set out of a rotation (fresh random logits each time; nothing is
loop-invariant). Bytes: the rows read once; the roofline is those bytes at the copy bandwidth measured in
the same run (these kernels are latency-bound: the ratio says how far). Prints a table and writes
`small_kernels_<commit>.json` under --out / $OUT.

    PYTHONPATH=.:kernels python -m benchmarks.bench_small_kernels --commit $(git rev-parse --short HEAD)
    PYTHONPATH=.:kernels python -m benchmarks.bench_small_kernels --quick   # CPU smoke run (interpreted)
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_description, markdown_table, write_result
from benchmarks.op_profile import op_times
from ddtree_kernels import tree_build, tree_sampling

POOL = 8  # input sets in the rotation


def _kernel_us(fn, arg_sets, runs: int) -> float:
    """Device us per call of fn's pallas kernels (the ops whose name says pallas / custom call), each call on
    the next input set of the rotation."""
    cycle = itertools.cycle(arg_sets)
    rows = op_times(lambda: fn(*next(cycle)), runs=runs)
    kernel = [r for r in rows if "pallas" in r["op"] or "custom" in r["op"]]
    return sum(r["us_per_run"] for r in (kernel or rows))


def _device_us(fn, arg_sets, runs: int) -> float:
    """Device us per call of every op fn launches (kernels and XLA fusions alike)."""
    cycle = itertools.cycle(arg_sets)
    return sum(r["us_per_run"] for r in op_times(lambda: fn(*next(cycle)), runs=runs))


def _unfused_topk(logits, k: int, method: str):
    """What the builder ran before `tree_topk_logits`: XLA's log-softmax and the row flags, then the kernel."""
    x = logits.astype(jnp.float32)
    dead = jnp.all(x == -jnp.inf, axis=-1)
    invalid = jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1)
    x = jnp.where(dead[:, None], 0.0, x)
    values, ids = tree_build.tree_topk(jax.nn.log_softmax(x, axis=-1), k, method=method)
    return values, ids, dead, invalid


def _logits(rng, shape, dtype):
    return [jnp.asarray(rng.standard_normal(shape) * 3, dtype) for _ in range(POOL)]


def topk_rows(vocab: int, budgets, runs: int, bandwidth: float, depths: int = 15) -> list[dict]:
    rng = np.random.default_rng(0)
    inputs = [(jax.nn.log_softmax(x, axis=-1),) for x in _logits(rng, (depths, vocab), jnp.float32)]
    out = []
    for budget in budgets:
        k = min(budget, vocab)
        for method in ("extract", "search", "resident"):
            fn = jax.jit(lambda v, m=method, k=k: tree_build.tree_topk(v, k, method=m))
            us = _kernel_us(fn, inputs, runs)
            floor = depths * vocab * 4 / bandwidth * 1e6
            out.append(
                {"kernel": "topk", "variant": method, "budget": budget, "rows": depths, "us": us, "roofline_us": floor}
            )
        # the builder's whole top-K stage from bf16 logits, every op counted: XLA log-softmax + flags + the
        # kernel, against the fused kernel (`tree_topk_logits`)
        method = tree_build.resolve_topk_method("auto", k)
        raw = [(x,) for x in _logits(rng, (depths, vocab), jnp.bfloat16)]
        floor = depths * vocab * 2 / bandwidth * 1e6
        for variant, fn in (
            (f"{method}: XLA log-softmax + flags + kernel (all ops)", lambda x, k=k: _unfused_topk(x, k, method)),
            (f"{method}: fused tree_topk_logits (all ops)", lambda x, k=k: tree_build.tree_topk_logits(x, k)),
        ):
            us = _device_us(jax.jit(fn), raw, runs)
            out.append(
                {"kernel": "topk", "variant": variant, "budget": budget, "rows": depths, "us": us, "roofline_us": floor}
            )
    return out


def slots_rows(vocab: int, budgets, runs: int, bandwidth: float, depths: int = 15) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for budget in budgets:
        k = min(budget, vocab)
        sets = []
        for x in _logits(rng, (1, depths, vocab), jnp.float32):
            lp, ids = tree_build.tree_topk_reference(jax.nn.log_softmax(x[0], axis=-1), k)
            sets.append((lp[None], ids[None]))
        live, root, ok = jnp.ones((1, depths), bool), jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)
        slots = jax.jit(lambda lp, ids, b=budget: tree_build.tree_slots(lp, ids, live, root, ok, b))
        select = jax.jit(lambda lp, ids, b=budget: tree_build.tree_select(lp, b))
        for variant, fn in (("tree_slots", slots), ("tree_select", select)):
            out.append(
                {
                    "kernel": "slots",
                    "variant": variant,
                    "budget": budget,
                    "rows": 1,
                    "us": _kernel_us(fn, sets, runs),
                    "roofline_us": depths * k * 8 / bandwidth * 1e6,
                }
            )
    return out


def row_stats_rows(vocab: int, cases, tilings, runs: int, bandwidth: float) -> list[dict]:
    rng = np.random.default_rng(2)
    out = []
    for batch, slots in cases:
        inputs = _logits(rng, (batch * slots, vocab), jnp.bfloat16)
        for temperature, top_p in ((0.0, 1.0), (1.0, 0.95)):
            settings = jnp.asarray(np.tile([temperature, 0.0, top_p, 0.0], (batch, 1)), jnp.float32)
            for tiling in tilings:
                fn = jax.jit(
                    lambda x, t=tiling, s=slots: tree_sampling.row_stats(
                        x, settings, layout="single", tiling=t, rows_per_setting=s
                    )
                )
                resident = vocab <= tiling.stats_block
                warps = tree_sampling._single_stats_warps(vocab, tiling)  # the warps the kernel runs with
                label = f"{warps}w, " + ("row in registers" if resident else f"streamed, {tiling.search_block}")
                out.append(
                    {
                        "kernel": "row_stats",
                        "variant": label,
                        "T": temperature,
                        "top_p": top_p,
                        "B": batch,
                        "N": slots,
                        "rows": batch * slots,
                        "us": _kernel_us(fn, [(x,) for x in inputs], runs),
                        "roofline_us": batch * slots * vocab * 2 / bandwidth * 1e6,
                    }
                )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--cases", default="1x1,1x17,1x65", help="BxN row-statistics cases")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--kernels", default="topk,slots,row_stats", help="which tables (default all three)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 runs (CPU smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    vocab, runs = args.vocab, args.runs
    tilings = [
        tree_sampling.SingleTiling(stats_block=2048),  # the row streamed, 16 thresholds a pass
        tree_sampling.SingleTiling(warps=8, search_block=1024, stats_block=1024),
        tree_sampling.SingleTiling(stats_block=16384),  # the row in registers (bisection), >= 1 warp per 1,024
        tree_sampling.SingleTiling(warps=16, stats_block=16384),
    ]
    if args.quick:
        vocab, budgets, cases, runs, tilings = 512, [8], [(1, 3)], 2, tilings[::2]
    bandwidth = copy_bandwidth()
    print(f"device: {device_description()}; commit {args.commit}; V = {vocab}; copy {bandwidth / 1e12:.2f} TB/s")
    kernels = set(args.kernels.split(","))
    if not kernels <= {"topk", "slots", "row_stats"}:
        raise SystemExit(f"error: --kernels takes topk, slots, row_stats; got {args.kernels!r}")
    rows = topk_rows(vocab, budgets, runs, bandwidth) if "topk" in kernels else []
    rows += slots_rows(vocab, budgets, runs, bandwidth) if "slots" in kernels else []
    rows += row_stats_rows(vocab, cases, tilings, runs, bandwidth) if "row_stats" in kernels else []
    table = [
        [
            r["kernel"],
            r["variant"],
            r.get("budget", ""),
            f"{r.get('B', '')}x{r.get('N', '')}" if "B" in r else "",
            f"T={r['T']:g} p={r['top_p']:g}" if "T" in r else "",
            r["rows"],
            r["us"],
            r["roofline_us"],
            f"{r['us'] / max(r['roofline_us'], 1e-9):.0f}x",
        ]
        for r in rows
    ]
    print(
        markdown_table(
            ["kernel", "variant", "budget", "BxN", "sampling", "rows", "device us", "roofline us", "x roofline"], table
        )
    )
    path = write_result(
        f"small_kernels_{args.commit}",
        {
            "settings": {"vocab": vocab, "budgets": budgets, "cases": cases, "runs": runs, "copy_bandwidth": bandwidth},
            "results": rows,
        },
        args.commit,
        args.out,
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
