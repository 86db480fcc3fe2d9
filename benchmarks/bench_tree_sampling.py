"""Tree rejection sampling benchmark: the fused Pallas kernel vs the XLA pipeline vs the HBM roofline.

For each (B, N, V, filters), the same tree, logits (bf16, random normal x 3) and keys go through
  xla      verify_step(impl="xla"):    processed_probs (softmax, top-p by a full sort) + verify_sampling
  pallas   verify_step(impl="pallas")'s path (`pallas_verify_step`, so --no-cond can pass the kernel's
           skip_with_cond=False): ddtree_kernels.tree_sampling (row statistics + walk), no [B, N, V] probs
Both include the same sibling order and coin draws. Timing: one jitted verification per call, queued
back to back (`time_calls(pipeline=...)`: async dispatch, so the host's dispatch gaps do not count once
the device is the bottleneck), each call on its own input set (logits and keys) out of a rotation larger
than 3x the L2, so every call reads fresh logits from HBM and no work is loop-invariant (an earlier
version looped inside one jit over keys only, and XLA hoisted the softmax and sort of the XLA path out
of the loop). Median of several samples. Roofline: the logits read once (B * N * V * 2 bytes) at the copy bandwidth measured
once per run on a 1 GiB buffer (read + write bytes / time). Agreement: share of rows with identical
tokens between the two.

Targets (H200): B = 1, N = 65, V = 151936: pallas <= 25 us without filters, <= 50 us with top-p 0.9;
B = 8, N = 65, top-p: <= 400 us.

Usage: python -m benchmarks.bench_tree_sampling --commit $(git rev-parse --short HEAD) [--quick]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_description, markdown_table, time_calls, write_result
from benchmarks.op_profile import op_times
from ddtree_jax.sampling import SamplingParams, draw_coins
from ddtree_jax.tree import build_tree, verification_order
from ddtree_jax.verify import VerifyResult, verify_step
from ddtree_jax.verify.step import mask_invalid_rows
from ddtree_kernels.tree_sampling import SINGLE_TILING, SingleTiling, tree_sampling_from_logits

REPS = 10


def _tree(batch, slots, depth, vocab, seed):
    draft = jax.random.normal(jax.random.key(seed), (batch, depth, vocab), jnp.bfloat16) * 3
    return build_tree(draft, slots - 1)


def kernel_layout(layout: str) -> tuple[str, SingleTiling]:
    """A --layouts entry -> (the kernel's layout, its single-layout tiling): "auto", "single", "spans", or
    "single:WxB" (W warps, B-element search loads)."""
    name, _, tiling = layout.partition(":")
    if not tiling:
        return name, SINGLE_TILING
    warps, block = (int(v) for v in tiling.split("x"))
    return name, SingleTiling(warps=warps, search_block=block)


def pallas_verify_step(tree, logits, params, keys, *, skip_with_cond: bool, layout: str = "auto") -> VerifyResult:
    """`verify_step(impl="pallas")` without a mesh, with the kernel's `skip_with_cond` chosen: the same key
    split, sibling order ("draft") and coins, `ddtree_kernels.tree_sampling.tree_sampling_from_logits` on logits
    [B, N, V], and its invalid rows masked -> VerifyResult [B, L + 1]."""
    split = jax.vmap(lambda k: jax.random.split(k, 3))(keys)
    next_token, next_sibling = verification_order(tree, "draft", split[:, 0])
    coins = draw_coins(split[:, 1], (tree.tokens.shape[1],))
    *arrays, slot_valid = tree_sampling_from_logits(
        tree.tokens,
        next_token,
        next_sibling,
        logits,
        params.as_rows(),
        coins,
        draw_coins(split[:, 2], ()),
        max_accept=tree.max_depth,
        skip_with_cond=skip_with_cond,
        layout=kernel_layout(layout)[0],
        tiling=kernel_layout(layout)[1],
    )
    return mask_invalid_rows(VerifyResult(*arrays), slot_valid, tree)


def verify_once(
    tree, logits, params, keys, *, impl: str, skip_with_cond: bool = True, layout: str = "auto"
) -> VerifyResult:
    """One verification: impl "xla" is `verify_step(impl="xla")`, "pallas" `pallas_verify_step` with the
    kernel's `layout` ("single": one program per row; "spans"; "auto")."""
    if impl == "pallas":
        return pallas_verify_step(tree, logits, params, keys, skip_with_cond=skip_with_cond, layout=layout)
    return verify_step(tree, logits, params, keys, impl=impl)


L2_BYTES = 50 * 2**20  # the H200's L2: rotating inputs must exceed it several times over
ROTATE_BYTES = 3 * L2_BYTES  # at least this many bytes of distinct logits per timed rotation
MAX_ROTATE_BYTES = 8 * 2**30
MAX_SETS = 64  # B = 1, N = 9, V = 151936 (2.7 MB a set) needs 56


def input_sets(batch, slots, vocab, seed, tree, params, dtype=jnp.bfloat16):
    """Distinct (tree, logits, params, keys) sets that together exceed ROTATE_BYTES (at least 2): every timed
    call reads logits no earlier call read, so neither XLA (no loop-invariant work to hoist: each call is
    its own program run) nor the L2 cache can skip the vocabulary passes."""
    one = batch * slots * vocab * jnp.dtype(dtype).itemsize
    count = int(min(max(2, -(-ROTATE_BYTES // one)), max(2, MAX_ROTATE_BYTES // one), MAX_SETS))
    sets = []
    for r in range(count):
        logits = jax.random.normal(jax.random.key(seed + 101 + r), (batch, slots, vocab), dtype) * 3
        keys = jax.random.split(jax.random.key(seed + 7 + r), batch)
        sets.append((tree, logits, params, keys))
    return sets


def column(layout: str) -> str:
    """The result key prefix of the pallas path at a kernel layout."""
    return "pallas" if layout == "auto" else "pallas_" + layout.replace(":", "_")


def run_case(
    batch,
    slots,
    vocab,
    top_p,
    copy_bw,
    seed=0,
    skip_with_cond=True,
    runs=7,
    layouts=("auto",),
    dtype=None,
    profile=False,
):
    """xla and pallas (per kernel layout: `pallas_us` for "auto", `pallas_<layout>_us` otherwise) on the same
    rotating input sets; speedup and x_roofline are the first layout's."""
    dtype = dtype or jnp.bfloat16
    depth = 8
    tree = _tree(batch, slots, depth, vocab, seed)
    params = SamplingParams.create(batch, temperature=1.0, top_p=top_p)
    sets = input_sets(batch, slots, vocab, seed, tree, params, dtype)
    out = {"B": batch, "N": slots, "V": vocab, "top_p": top_p, "logits": jnp.dtype(dtype).name, "input_sets": len(sets)}
    pipeline = max(REPS, len(sets))
    columns = [("xla", "xla", "auto")] + [(column(layout), "pallas", layout) for layout in layouts]
    for name, impl, layout in columns:
        run = jax.jit(functools.partial(verify_once, impl=impl, skip_with_cond=skip_with_cond, layout=layout))
        start = time.perf_counter()
        jax.block_until_ready(run(*sets[0]))
        out[f"{name}_compile_s"] = time.perf_counter() - start
        timing = time_calls(run, sets, runs=runs, warmup=len(sets), pipeline=pipeline)
        out[f"{name}_us"] = timing.median * 1e6
        out[f"{name}_timing"] = timing.summary_us()
        if profile:  # the device's own time (kernels summed from a trace): no host dispatch in it
            ops = op_times(run, *sets[0], runs=3)
            out[f"{name}_device_us"] = sum(op["us_per_run"] for op in ops)
            out[f"{name}_launches"] = sum(op["events_per_run"] for op in ops)
            out[f"{name}_top_ops"] = ops[:8]
    first = columns[1][0]
    a = verify_once(*sets[0], impl="xla")
    b = verify_once(*sets[0], impl="pallas", skip_with_cond=skip_with_cond, layout=layouts[0])
    out["agree"] = float((np.asarray(a.tokens) == np.asarray(b.tokens)).all(axis=1).mean())
    nbytes = batch * slots * vocab * jnp.dtype(dtype).itemsize
    out["roofline_us"] = nbytes / copy_bw * 1e6
    out["pallas_us"] = out[f"{first}_us"]
    out["speedup"] = out["xla_us"] / out["pallas_us"]
    out["x_roofline"] = out["pallas_us"] / out["roofline_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="B = 1 and 8, N = 17 and 65, V = 163840 only")
    parser.add_argument("--cases", help="comma-separated BxN (e.g. 1x17,8x65): only these, at --vocabs")
    parser.add_argument("--vocabs", default="151936,163840")
    parser.add_argument(
        "--no-cond",
        action="store_true",
        help="launch unneeded search passes (rows inactive) instead of skipping them with lax.cond",
    )
    parser.add_argument(
        "--layouts",
        default="auto",
        help="the kernel's layouts to time side by side: auto, single (one program per row), spans, "
        "single:WxB (W warps, B-element search loads; e.g. single:8x1024)",
    )
    parser.add_argument("--logit-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also the device time and launches of one verification per path (op_profile; the timed "
        "columns queue calls from the host, which small cases can be bound by)",
    )
    args = parser.parse_args()
    vocabs = [int(v) for v in args.vocabs.split(",")]
    layouts = tuple(args.layouts.split(","))
    if args.cases:
        cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    elif args.quick:
        cases, vocabs = [(b, n) for b in (1, 8) for n in (17, 65)], [163840]
    else:
        cases = [(b, n) for b in (1, 8, 32) for n in (9, 17, 65, 257)]
    copy_bw = copy_bandwidth(REPS)
    print(f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for vocab in vocabs:
        for batch, slots in cases:
            for top_p in (1.0, 0.9):
                r = run_case(
                    batch,
                    slots,
                    vocab,
                    top_p,
                    copy_bw,
                    skip_with_cond=not args.no_cond,
                    layouts=layouts,
                    dtype=jnp.dtype(args.logit_dtype),
                    profile=args.profile,
                )
                rows.append(r)
                extra = "".join(f"  {layout} {r[f'{column(layout)}_us']:8.1f} us" for layout in layouts[1:])
                print(
                    f"B={batch:3d} N={slots:4d} V={vocab} {r['logits']} top_p={top_p}: xla {r['xla_us']:9.1f} us  "
                    f"pallas {r['pallas_us']:8.1f} us{extra}  roofline {r['roofline_us']:7.1f} us  "
                    f"speedup {r['speedup']:6.1f}x  x_roofline {r['x_roofline']:5.1f}  agree {r['agree']:.3f}",
                    flush=True,
                )
                if args.profile:
                    print(
                        "    device: "
                        + "  ".join(
                            f"{name} {r[name + '_device_us']:.1f} us in {r[name + '_launches']:.0f} launches"
                            for name in ["xla"] + [column(layout) for layout in layouts]
                        ),
                        flush=True,
                    )
    header = ["B", "N", "V", "top_p", "xla us", "pallas us", "roofline us", "speedup", "pallas/roofline", "agree"]
    table = [
        [
            r["B"],
            r["N"],
            r["V"],
            r["top_p"],
            r["xla_us"],
            r["pallas_us"],
            r["roofline_us"],
            f"{r['speedup']:.1f}x",
            f"{r['x_roofline']:.1f}x",
            f"{r['agree']:.3f}",
        ]
        for r in rows
    ]
    print("\n" + markdown_table(header, table))
    path = write_result(
        "tree_sampling" + ("_nocond" if args.no_cond else ""),
        {"rows": rows, "reps_per_timing": REPS, "copy_bandwidth_Bps": copy_bw, "skip_with_cond": not args.no_cond},
        args.commit,
    )
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
