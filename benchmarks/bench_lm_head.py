"""The LM head under tensor parallelism: gather the logits, or select vocab-parallel.

On a mesh of every device present ("model" = all of them), with K2.6's vocabulary (163,840) split across
"model", per decode step:

  drafter top-K   the tree builder's per-depth top-K of the drafter's logits [B, L, V] (L = block - 1
                  depths, K = min(budget, ...)): `sharding.vocab_parallel.sharded_top_k_log_probs` with
                  impl "gathered" (all-gather [B, L, V] then select) vs "vocab_parallel" (local top-K, two
                  scalar reductions, a K-candidate gather);
  verify gather   the all-gather of the target's verify logits [B, N, V] (bf16) that the sampler needs
                  (its filters read whole rows; no vocab-parallel sampler exists): the cost the gathered
                  design pays at verification, against the same logits' local read.

Counted: bytes each device receives. Times: REPS calls inside one jit, median of 7 runs.

Usage: python -m benchmarks.bench_lm_head --commit $(git rev-parse --short HEAD) [--vocab 163840]
       (GPU: nvidia-h200-x2 or larger; CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 for a smoke run)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.common import device_description, markdown_table, median_seconds, write_result
from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.rules import MODEL
from ddtree_jax.tree.vocab_parallel import sharded_top_k_log_probs

REPS = 10


def timed(fn, x) -> float:
    """Seconds per call: REPS calls on x + i inside one jit (no reuse across iterations)."""

    @jax.jit
    def run(x):
        def body(i, acc):
            out = fn(x + i.astype(x.dtype))
            return acc + jnp.sum(jax.tree.leaves(out)[0][..., :1].astype(jnp.float32))

        return lax.fori_loop(0, REPS, body, 0.0)

    return median_seconds(run, x) / REPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--depths", default="7,15", help="drafter depths L (block size - 1)")
    parser.add_argument("--ks", default="8,64", help="top-K per depth (min(budget, V))")
    parser.add_argument("--slots", default="9,17,65", help="verify slots N for the logits gather")
    args = parser.parse_args()
    parts = jax.device_count()
    mesh = make_mesh(model=parts, data=1)
    spec = NamedSharding(mesh, PartitionSpec(None, None, MODEL))
    print(
        f"device: {device_description()}; commit {args.commit}; vocabulary {args.vocab} over {parts} devices",
        flush=True,
    )
    rows = []
    key = jax.random.key(0)
    with jax.set_mesh(mesh):
        for batch in (int(b) for b in args.batches.split(",")):
            for depth in (int(d) for d in args.depths.split(",")):
                logits = jax.device_put(jax.random.normal(key, (batch, depth, args.vocab), jnp.bfloat16) * 3, spec)
                for k in (int(k) for k in args.ks.split(",")):
                    row = {"case": "drafter top-K", "B": batch, "rows": depth, "K": k}
                    for impl in ("gathered", "vocab_parallel"):
                        row[f"{impl}_us"] = timed(lambda x: sharded_top_k_log_probs(x, k, impl=impl), logits) * 1e6
                    row["gathered_MB_in"] = batch * depth * args.vocab * 2 * (parts - 1) / parts / 1e6
                    row["vocab_parallel_MB_in"] = batch * depth * k * 8 * (parts - 1) / 1e6
                    row["speedup"] = row["gathered_us"] / row["vocab_parallel_us"]
                    rows.append(row)
                    print(
                        f"top-K B={batch} L={depth:2d} K={k:3d}: gathered {row['gathered_us']:8.1f} us  vocab-parallel "
                        f"{row['vocab_parallel_us']:8.1f} us  ({row['speedup']:.2f}x)",
                        flush=True,
                    )
                    write_result("lm_head", {"rows": rows, "devices": parts, "vocab": args.vocab}, args.commit)
            for slots in (int(n) for n in args.slots.split(",")):
                logits = jax.device_put(jax.random.normal(key, (batch, slots, args.vocab), jnp.bfloat16), spec)
                gather = jax.shard_map(
                    lambda x: lax.all_gather(x, MODEL, axis=2, tiled=True),
                    mesh=mesh,
                    in_specs=PartitionSpec(None, None, MODEL),
                    out_specs=PartitionSpec(),
                    check_vma=False,
                )
                row = {
                    "case": "verify gather",
                    "B": batch,
                    "rows": slots,
                    "K": None,
                    "gathered_us": timed(gather, logits) * 1e6,
                    "gathered_MB_in": batch * slots * args.vocab * 2 * (parts - 1) / parts / 1e6,
                }
                rows.append(row)
                print(
                    f"verify gather B={batch} N={slots:3d}: {row['gathered_us']:8.1f} us "
                    f"({row['gathered_MB_in']:.1f} MB in per device)",
                    flush=True,
                )
                write_result("lm_head", {"rows": rows, "devices": parts, "vocab": args.vocab}, args.commit)
    table = [
        [
            r["case"],
            r["B"],
            r["rows"],
            r["K"] or "",
            r["gathered_us"],
            r.get("vocab_parallel_us", ""),
            f"{r['speedup']:.2f}" if "speedup" in r else "",
            f"{r['gathered_MB_in']:.2f}",
            f"{r['vocab_parallel_MB_in']:.3f}" if "vocab_parallel_MB_in" in r else "",
        ]
        for r in rows
    ]
    print(
        "\n"
        + markdown_table(
            [
                "case",
                "B",
                "rows (L or N)",
                "K",
                "gathered us",
                "vocab-parallel us",
                "speed-up",
                "gathered MB in",
                "vocab-parallel MB in",
            ],
            table,
        )
    )


if __name__ == "__main__":
    main()
