"""Tree rejection sampling benchmark: the fused Pallas kernel vs the XLA pipeline vs the HBM roofline.

For each (B, N, V, filters), the same tree, logits (bf16, random normal x 3) and keys go through
  xla      verify_step(impl="xla"):    processed_probs (softmax, top-p by a full sort) + verify_sampling
  pallas   verify_step(impl="pallas")'s path (`pallas_verify_step`, so --no-cond can pass the kernel's
           skip_with_cond=False): ddtree_kernels.tree_sampling (row statistics + walk), no [B, N, V] probs
Both include the same sibling order and coin draws. Timings are per verification inside one jit that
runs REPS verifications back to back on different keys (lax.fori_loop; no Python dispatch), median of
several such runs. Roofline: the logits read once (B * N * V * 2 bytes) at the copy bandwidth measured
once per run on a 1 GiB buffer (read + write bytes / time). Agreement: share of rows with identical
tokens between the two.

Targets (H200): pallas >= 10x faster than xla with top-p; within 3x of the roofline for
B * N >= 64 rows; <= 20 us for B = 1, N = 17.

Usage: python -m benchmarks.bench_tree_sampling --commit $(git rev-parse --short HEAD) [--quick]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_description, markdown_table, median_seconds, write_result
from ddtree_jax.sampling import SamplingParams, draw_coins
from ddtree_jax.tree import build_tree, verification_order
from ddtree_jax.verify import VerifyResult, verify_step
from ddtree_jax.verify.step import mask_invalid_rows
from ddtree_kernels.tree_sampling import tree_sampling_from_logits

REPS = 10


def _tree(batch, slots, depth, vocab, seed):
    draft = jax.random.normal(jax.random.key(seed), (batch, depth, vocab), jnp.bfloat16) * 3
    return build_tree(draft, slots - 1)


def pallas_verify_step(tree, logits, params, keys, *, skip_with_cond: bool) -> VerifyResult:
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
    )
    return mask_invalid_rows(VerifyResult(*arrays), slot_valid, tree)


def verify_once(tree, logits, params, keys, *, impl: str, skip_with_cond: bool = True) -> VerifyResult:
    """One verification: impl "xla" is `verify_step(impl="xla")`, "pallas" `pallas_verify_step`."""
    if impl == "pallas":
        return pallas_verify_step(tree, logits, params, keys, skip_with_cond=skip_with_cond)
    return verify_step(tree, logits, params, keys, impl=impl)


@functools.partial(jax.jit, static_argnames=("impl", "reps", "skip_with_cond"))
def _repeated(tree, logits, params, key, *, impl, reps, skip_with_cond):
    """reps verifications with fresh keys; returns the sum of emitted counts (keeps every rep live)."""
    batch = logits.shape[0]

    def body(i, total):
        keys = jax.random.split(jax.random.fold_in(key, i), batch)
        result = verify_once(tree, logits, params, keys, impl=impl, skip_with_cond=skip_with_cond)
        return total + result.num_accepted.sum() + result.tokens[:, 0].sum()

    return jax.lax.fori_loop(0, reps, body, jnp.int32(0))


def run_case(batch, slots, vocab, top_p, copy_bw, seed=0, skip_with_cond=True):
    depth = 8
    tree = _tree(batch, slots, depth, vocab, seed)
    logits = jax.random.normal(jax.random.key(seed + 1), (batch, slots, vocab), jnp.bfloat16) * 3
    params = SamplingParams.create(batch, temperature=1.0, top_p=top_p)
    key = jax.random.key(seed + 2)
    out = {"B": batch, "N": slots, "V": vocab, "top_p": top_p}
    for impl in ("xla", "pallas"):
        start = time.perf_counter()
        run = functools.partial(_repeated, impl=impl, reps=REPS, skip_with_cond=skip_with_cond)
        jax.block_until_ready(run(tree, logits, params, key))
        out[f"{impl}_compile_s"] = time.perf_counter() - start
        out[f"{impl}_us"] = median_seconds(run, tree, logits, params, key) / REPS * 1e6
    keys = jax.random.split(key, batch)
    a = verify_once(tree, logits, params, keys, impl="xla")
    b = verify_once(tree, logits, params, keys, impl="pallas", skip_with_cond=skip_with_cond)
    out["agree"] = float((np.asarray(a.tokens) == np.asarray(b.tokens)).all(axis=1).mean())
    nbytes = logits.size * logits.dtype.itemsize
    out["roofline_us"] = nbytes / copy_bw * 1e6
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
    args = parser.parse_args()
    vocabs = [int(v) for v in args.vocabs.split(",")]
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
                r = run_case(batch, slots, vocab, top_p, copy_bw, skip_with_cond=not args.no_cond)
                rows.append(r)
                print(
                    f"B={batch:3d} N={slots:4d} V={vocab} top_p={top_p}: xla {r['xla_us']:9.1f} us  "
                    f"pallas {r['pallas_us']:8.1f} us  roofline {r['roofline_us']:7.1f} us  "
                    f"speedup {r['speedup']:6.1f}x  x_roofline {r['x_roofline']:5.1f}  agree {r['agree']:.3f}",
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
