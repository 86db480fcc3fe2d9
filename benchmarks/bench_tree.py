"""Tree-builder benchmark: the jit builder vs a plain-XLA builder vs the reference heap.

Shapes from the issue: L = 15 draft depths, V = 151936 (Qwen3 vocabulary), bf16 drafter logits;
budget 64 and 256 at B = 1, budget 64 at B = 32 (targets: 50 us, 100 us, 500 us on an H200).

Variants (same inputs, one run):
  jit/pallas      build_tree(impl="pallas"): the tree_build kernels (top-K, then the on-chip selection)
  jit/prefilter   build_tree, top-K by the exact chunk-max prefilter (the default on large vocabularies)
  jit/xla-topk    build_tree with lax.top_k over the full row per depth (the "plain XLA builder")
  reference       jax.device_get(logits) + the numpy/heapq heap per row (what a host builder costs)
Two timings per jit variant:
  call   one jitted call + block_until_ready (includes Python dispatch, ~10-20 us)
  step   per tree inside one jit that builds 8 trees back to back (lax.map): the cost inside a decode step
Stage split (step timing): the top-K stage alone, for each selection method.
Roofline: reading the logits once at the measured ~3.1 TB/s XLA copy rate (the floor of any builder).

Usage: python -m benchmarks.bench_tree --commit $(git rev-parse --short HEAD) [--quick]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_description, markdown_table, time_calls, write_result
from ddtree_jax.tree import build_tree, build_tree_reference, top_k_log_probs
from ddtree_jax.tree.build import build_tree_unchecked, kernel_top_k, kernel_top_k_logits, kernel_top_k_logits_fits
from ddtree_jax.tree.compare import compare_to_reference
from ddtree_jax.tree.synthetic import synthetic_draft_logits
from ddtree_kernels.tree_build import tree_select

COPY_BW = 3.1e12  # bytes/s, measured XLA device-to-device copy on the H200 (performance_notes.md)


def _inputs(batch, depth, vocab, dtype, count, seed=0):
    keys = jax.random.split(jax.random.key(seed), count)
    return [synthetic_draft_logits(k, batch, depth, vocab, dtype=dtype) for k in keys]


def _per_tree_us(fn, stacked, runs: int) -> dict:
    """time_calls summary (us) of fn(stacked), one jit over the 8 trees of `stacked`, divided per tree."""
    summary = time_calls(fn, [(stacked,)], runs=runs, warmup=3).summary_us()
    return {k: (v / 8 if k.endswith("_us") else v) for k, v in summary.items()}


IMPLS = ("pallas", "prefilter", "xla")  # the variants `--impls` names (`_builder_args`)


def _builder_args(impl: str) -> dict:
    """build_tree_unchecked's (topk_impl, impl) for a variant name: "pallas" = the kernels, else the XLA
    builder with that top-K."""
    return {"topk_impl": "auto", "impl": "pallas"} if impl == "pallas" else {"topk_impl": impl, "impl": "xla"}


def _topk_stage(x, k, impl):
    if impl == "pallas":  # the builder's own top-K stage (one kernel, or the chunked pair past MAX_ROW)
        return kernel_top_k_logits(x, k)[1] if kernel_top_k_logits_fits(x.shape[-1], k) else kernel_top_k(x, k)[1]
    return top_k_log_probs(x, k, impl=impl)[1]


def _check_against_reference(logits, budget, impl, rows=2):
    """Exactness on this device: per row 'exact', 'near-tie' (allowed swap) or 'mismatch'."""
    tree = build_tree(logits, budget, **_builder_args(impl))
    host = np.asarray(jax.device_get(logits).astype(np.float32))
    return [
        compare_to_reference(tree, b, build_tree_reference(host[b], budget)) for b in range(min(rows, logits.shape[0]))
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="small shapes, few reps (CPU smoke run)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 50; --quick: 3)")
    parser.add_argument("--cases", help="comma-separated BxBUDGET list, e.g. 1x64,32x64 (default: the full set)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="variants to time (module docstring)")
    parser.add_argument(
        "--select-warps", default=None, help="also time the selection kernel alone at these warps, e.g. 1,2,4"
    )
    parser.add_argument("--vocab", type=int, default=None, help="V (default 151936; 8192 = the embedded pair)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the prefilter chunk sweep")
    args = parser.parse_args(argv)

    depth, vocab = (15, args.vocab or 151936) if not args.quick else (4, args.vocab or 4096)
    cases = [(1, 64), (1, 256), (32, 64), (1, 16), (1, 1024)] if not args.quick else [(1, 16), (2, 32)]
    reps = args.reps if args.reps is not None else (3 if args.quick else 50)
    if reps < 1:
        parser.error(f"--reps must be >= 1, got {reps}")
    # every list parsed here, before anything is compiled (a bad entry used to fail after the timings)
    if args.cases:
        try:
            cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
        except ValueError:
            parser.error(f"--cases {args.cases!r}: expected BxBUDGET entries, e.g. 1x64,32x64")
        if any(len(case) != 2 or min(case) < 1 for case in cases):
            parser.error(f"--cases {args.cases!r}: expected BxBUDGET entries of integers >= 1, e.g. 1x64,32x64")
    impls = args.impls.split(",")
    bad = [impl for impl in impls if impl not in IMPLS]
    if bad or len(set(impls)) != len(impls):
        parser.error(f"--impls {args.impls!r}: expected distinct entries of {', '.join(IMPLS)}")
    select_warps = []
    if args.select_warps:
        try:
            select_warps = [int(w) for w in args.select_warps.split(",")]
        except ValueError:
            parser.error(f"--select-warps {args.select_warps!r}: expected comma-separated integers, e.g. 1,2,4")
        if any(w < 1 for w in select_warps):
            parser.error(f"--select-warps {args.select_warps!r}: warps must be >= 1")
    print(f"device: {device_description()}; L = {depth}, V = {vocab}, bf16 logits", flush=True)
    rows, records = [], []
    for batch, budget in cases:
        inputs = _inputs(batch, depth, vocab, jnp.bfloat16, 4)
        floor_us = batch * depth * vocab * 2 / COPY_BW * 1e6
        rec = {"batch": batch, "budget": budget, "depth": depth, "vocab": vocab, "roofline_us": floor_us}
        for impl in impls:
            call = functools.partial(
                build_tree_unchecked, root_tokens=jnp.zeros((batch,), jnp.int32), budget=budget, **_builder_args(impl)
            )
            t0 = time.perf_counter()
            jax.block_until_ready(call(inputs[0]))
            rec[f"{impl}_compile_s"] = time.perf_counter() - t0
            print(
                f"  B={batch} budget={budget} {impl}: compile + first run {rec[f'{impl}_compile_s']:.1f} s", flush=True
            )
            rec[f"{impl}_call"] = time_calls(call, [(x,) for x in inputs], runs=reps, warmup=3).summary_us()
            stacked = jnp.stack(inputs + inputs)  # 8 trees per jit call
            step = jax.jit(
                lambda xs, impl=impl: jax.lax.map(
                    lambda x: build_tree_unchecked(
                        x, jnp.zeros((batch,), jnp.int32), budget=budget, **_builder_args(impl)
                    ).tokens,
                    xs,
                )
            )
            rec[f"{impl}_step"] = _per_tree_us(step, stacked, max(5, reps // 5))
            k = min(budget, vocab)
            topk = jax.jit(lambda xs, impl=impl: jax.lax.map(lambda x: _topk_stage(x, k, impl), xs))
            rec[f"{impl}_topk_step"] = _per_tree_us(topk, stacked, max(5, reps // 5))
            rec[f"{impl}_exact_rows"] = _check_against_reference(inputs[1], budget, impl)
        if batch * budget <= 32 * 64:

            def host(x):
                arr = np.asarray(jax.device_get(x).astype(np.float32))
                return [build_tree_reference(arr[b], budget) for b in range(batch)]

            t = time.perf_counter()
            for x in inputs:
                host(x)
            rec["reference_us"] = (time.perf_counter() - t) / len(inputs) * 1e6
        records.append(rec)
        write_result(f"bench_tree_V{vocab}", {"cases": records}, args.commit)  # partial results survive a timeout
        nan = {"median_us": float("nan")}
        rows.append(
            [
                batch,
                budget,
                rec.get("pallas_step", nan)["median_us"],
                rec.get("pallas_call", nan)["median_us"],
                rec.get("pallas_topk_step", nan)["median_us"],
                rec.get("prefilter_step", nan)["median_us"],
                rec.get("prefilter_call", nan)["median_us"],
                rec.get("prefilter_topk_step", nan)["median_us"],
                rec.get("xla_step", nan)["median_us"],
                rec.get("xla_call", nan)["median_us"],
                rec.get("xla_topk_step", nan)["median_us"],
                rec.get("reference_us", float("nan")),
                floor_us,
                ",".join(rec.get("pallas_exact_rows", [])),
                ",".join(rec.get("prefilter_exact_rows", [])),
            ]
        )
        print(f"  done B={batch} budget={budget}", flush=True)
    sweep = []
    if select_warps:
        for rec in records:
            rec["select_warps_us"] = _select_warps_sweep(rec["batch"], rec["budget"], depth, vocab, select_warps, reps)
    if not args.no_sweep:
        sweep = _chunk_sweep(depth, vocab, reps)
    header = [
        "B",
        "budget",
        "pallas step us",
        "pallas call us",
        "pallas top-K us",
        "prefilter step us",
        "prefilter call us",
        "prefilter top-K us",
        "xla step us",
        "xla call us",
        "xla top-K us",
        "reference heap us",
        "read-once floor us",
        "pallas vs reference",
        "prefilter vs reference",
    ]
    table = markdown_table(header, rows)
    path = write_result(f"bench_tree_V{vocab}", {"cases": records, "chunk_sweep": sweep, "table": table}, args.commit)
    print(table)
    print(f"written {path}")


def _select_warps_sweep(batch, budget, depth, vocab, warps, reps):
    """The selection kernel alone (`tree_select` on the per-depth top-K of 8 different trees), per tree, at
    each number of warps: {warps: median us}."""
    k = min(budget, vocab)
    stacked = jnp.stack(_inputs(batch, depth, vocab, jnp.bfloat16, 4) * 2)
    top_lp = jax.jit(jax.vmap(lambda x: kernel_top_k(x, k)[0]))(stacked)  # [8, B, L, K]
    out = {}
    for w in warps:
        fn = jax.jit(lambda lps, w=w: jax.lax.map(lambda lp: tree_select(lp, budget, num_warps=w)[3], lps))
        out[w] = _per_tree_us(fn, top_lp, max(5, reps // 5))["median_us"]
        print(f"  B={batch} budget={budget} tree_select at {w} warps: {out[w]:.1f} us", flush=True)
    return out


def _chunk_sweep(depth, vocab, reps):
    """The top-K stage: prefilter chunk-length sweep (B = 1, K = 64 and 256)."""
    sweep = []
    inputs = _inputs(1, depth, vocab, jnp.bfloat16, 4)
    stacked = jnp.stack(inputs + inputs)
    for k in (64, 256):
        for chunk in (16, 32, 64, 128, 256, 512):
            fn = jax.jit(
                lambda xs, k=k, chunk=chunk: jax.lax.map(
                    lambda x: top_k_log_probs(x, k, impl="prefilter", chunk=chunk)[1], xs
                )
            )
            us = _per_tree_us(fn, stacked, max(5, reps // 5))["median_us"]
            sweep.append({"k": k, "chunk": chunk, "topk_step_us": us})
            print(f"  top-K prefilter k={k} chunk={chunk}: {us:.1f} us", flush=True)
    return sweep


if __name__ == "__main__":
    main()
