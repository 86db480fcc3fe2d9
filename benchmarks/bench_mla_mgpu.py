"""Absorbed-MLA tree-verify attention: the Mosaic GPU kernel (kernels/ddtree_kernels/mla_attention_mgpu.py)
vs the Triton kernel (`tree_attention`) vs the models' XLA path (`tree_attention_reference`) vs the roofline.

*mgpu_split_scores*: the same kernel with `split_scores=True` (each compute warpgroup scores half of each key
block; `attention_mgpu_e6a12ce_split_scores.json` names it `mgpu_split`); *mgpu_overlap*: `overlap=True` (a block's
scores issued with the previous block's value product, its softmax while that product runs); *mgpu_alternate*:
`alternate=True` (blocks in pairs, each compute warpgroup scoring one, P exchanged: FlashMLA's schedule).
Cases: H = 8 (one TP8 shard) and 64 (one GPU) query heads over the one shared latent KV head, N = 17 and
65 tree queries, contexts 8k and 32k, B = 1 (and B = 8 at H = 8). The cache holds context + N keys; every
row sees its prefix plus its tree slots under a random ancestor mask (`common.random_tree_mask`).

Counted first, per call (S = context + N):
  FLOPs = 2 * B * N * H * S * (576 + 512)  (scores over latent + rope, values the latent);
  bytes = the latent + rope cache read once (1,152 B a key) + the queries + the bf16 output;
  roofline = max(bytes / 4.3 TB/s (read + write copy bandwidth measured on this H200), FLOPs / 790 TFLOP/s).
Timing (`op_profile.device_seconds`): one jitted program calls the variant once on each of >= 4 input sets
(queries and cache; together larger than twice the 50 MB L2, so no call reads the previous call's data from L2;
at most MAX_SETS sets: a case whose sets stay below twice the L2 is marked `l2_resident`) and returns every
output whole; `*_us` = the program's span on the device (first kernel to last, from a profiler trace; median of
3 programs) / the number of sets: what a call costs back to back, without host dispatch. `*_wall_us` = the
program's median wall time over 7 runs / the sets (`common.in_jit_seconds`): it adds the program's dispatch and
synchronisation, ~100 us a call at 4 sets on the H200 (mla8 at 32k: 149 us wall, 53 on the device; the rows
archived before `7ba6e57` are wall times). Correctness: ||out - ref|| / ||ref|| against the XLA path on input set 0, per case
(bf16: expect ~3e-3). A variant that fails to compile or run records its error string and the rest go on.

Usage: PYTHONPATH=.:kernels python -m benchmarks.bench_mla_mgpu --commit $(git rev-parse --short HEAD) [--quick]
Writes attention_mgpu_<commit>.json to $OUT (else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.op_profile import profile_into
from ddtree_kernels.mla_attention_mgpu import BLOCK_M, mla_tree_attention, split_plan
from ddtree_kernels.tree_attention import tree_attention, tree_attention_reference

MAX_SETS = 72  # calls in one timed program (tiny CPU smoke shapes would otherwise ask for hundreds)
VARIANTS = {"mla8": 8, "mla64": 64}  # query heads


def counts(batch: int, steps: int, heads: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one call."""
    capacity = context + steps
    flops = 2 * batch * steps * heads * capacity * (576 + 512)
    nbytes = batch * capacity * 1152 + batch * steps * heads * 2 * (576 + 512)
    return float(flops), float(nbytes)


def input_sets(batch: int, steps: int, heads: int, context: int, key) -> list[tuple]:
    """`common.rotating_set_count` (q_latent, q_rope, latent, rope_key, mask) sets of bf16 [B, N, H, 512], [B, N, H,
    64], [B, capacity, 1, 512], [B, capacity, 1, 64] and the shared bool mask [B, N, capacity]; capacity: context + N
    in whole 64-key blocks (`common.block_capacity`), the tail never visible."""
    _, nbytes = counts(batch, steps, heads, context)
    capacity = common.block_capacity(context + steps, 64)
    mask = common.padded_tree_mask(batch, steps, context, capacity)
    out = []
    for i in range(common.rotating_set_count(nbytes, MAX_SETS)):
        k = jax.random.split(jax.random.fold_in(key, i), 4)
        out.append(
            (
                jax.random.normal(k[0], (batch, steps, heads, 512), jnp.bfloat16),
                jax.random.normal(k[1], (batch, steps, heads, 64), jnp.bfloat16),
                jax.random.normal(k[2], (batch, capacity, 1, 512), jnp.bfloat16),
                jax.random.normal(k[3], (batch, capacity, 1, 64), jnp.bfloat16),
                mask,
            )
        )
    return out


ATTEND = {
    "mgpu": jax.jit(lambda ql, qr, lat, rk, mask: mla_tree_attention(ql, qr, lat, rk, mask)),
    # split_scores: each compute warpgroup scores half of a key block (no score computed twice)
    "mgpu_split_scores": jax.jit(
        lambda ql, qr, lat, rk, mask: mla_tree_attention(ql, qr, lat, rk, mask, split_scores=True)
    ),
    # overlap: block i's scores issued with block i - 1's value product, its softmax while that product runs
    "mgpu_overlap": jax.jit(lambda ql, qr, lat, rk, mask: mla_tree_attention(ql, qr, lat, rk, mask, overlap=True)),
    # alternate: key blocks in pairs, one scored by each compute warpgroup, P exchanged (FlashMLA's schedule)
    "mgpu_alternate": jax.jit(lambda ql, qr, lat, rk, mask: mla_tree_attention(ql, qr, lat, rk, mask, alternate=True)),
    "pallas": jax.jit(lambda ql, qr, lat, rk, mask: tree_attention((ql, qr), (lat, rk), None, mask)),
    "xla": jax.jit(lambda ql, qr, lat, rk, mask: tree_attention_reference((ql, qr), (lat, rk), None, mask)),
}


def mgpu_with_splits(num_splits: int):
    """The Mosaic kernel at a fixed number of key splits (the `--splits` sweep)."""
    return jax.jit(lambda ql, qr, lat, rk, mask: mla_tree_attention(ql, qr, lat, rk, mask, num_splits=num_splits))


def run_case(
    variant: str,
    batch: int,
    steps: int,
    context: int,
    key,
    split_sweep: tuple[int, ...] = (),
    profile_top: int = 0,
    impls: tuple[str, ...] = tuple(ATTEND),
) -> dict:
    heads = VARIANTS[variant]
    flops, nbytes = counts(batch, steps, heads, context)
    rows = steps * heads
    splits, per_split = split_plan(batch, rows, context + steps, 64, None)
    row = {
        "variant": variant,
        "B": batch,
        "N": steps,
        "context": context,
        **common.roofline_columns(flops, nbytes),
        "mgpu_grid": [math.ceil(rows / BLOCK_M), splits, batch],
        "mgpu_blocks_per_split": per_split,
    }
    sets = input_sets(batch, steps, heads, context, key)
    row["l2_resident"] = len(sets) * nbytes < 2 * common.L2_BYTES  # MAX_SETS reached before twice the L2
    common.time_variants_into(row, ATTEND, sets, flops=flops, nbytes=nbytes, timed=impls)  # the rest: nan
    if profile_top:  # device time per op of one call on the first set (op_profile): where the us go
        for name in ("mgpu", "mgpu_split_scores", "mgpu_overlap", "mgpu_alternate", "xla"):
            if name in impls:
                profile_into(row, name, ATTEND[name], sets, profile_top)
    common.split_sweep_into(row, split_sweep, mgpu_with_splits, sets, error_limit=200)
    row["rel_err"] = row.get("mgpu_rel_err", float("nan"))
    for name in ("mgpu_TFLOPs", "mgpu_GBps", "mgpu_of_roofline"):
        row.setdefault(name, float("nan"))
    del sets
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="N = 17, B = 1 only")
    parser.add_argument("--variants", default="mla8,mla64")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument(
        "--splits", default="", help="also time the Mosaic kernel at these key-split counts (e.g. 4,16,64)"
    )
    parser.add_argument("--batches", default="", help="override the batch sizes (default: 1, and 8 for mla8)")
    parser.add_argument("--steps", default="", help="override the tree sizes N (default: 17 and 65; 17 with --quick)")
    common.add_profile_top_argument(parser)
    parser.add_argument(
        "--impls", default=",".join(ATTEND), help=f"the paths timed, of {list(ATTEND)} (mgpu is always timed)"
    )
    parser.add_argument("--out", help="directory for the JSON (default $OUT, else benchmarks/results)")
    args = parser.parse_args()
    impls = tuple(sorted(set(args.impls.split(",")) | {"mgpu"}))
    if set(impls) - set(ATTEND):
        raise SystemExit(f"unknown --impls {sorted(set(impls) - set(ATTEND))}; choose from {list(ATTEND)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    cases = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
        batches = [1] if args.quick or variant != "mla8" else [1, 8]
        if args.batches:
            batches = [int(b) for b in args.batches.split(",")]
        step_list = [17] if args.quick else [17, 65]
        if args.steps:
            step_list = [int(n) for n in args.steps.split(",")]
        for batch in batches:
            for steps in step_list:
                cases += [(variant, batch, steps, context) for context in contexts]
    print(common.roofline_header(args.commit), flush=True)
    results = []
    key = jax.random.key(0)
    for variant, batch, steps, context in cases:
        sweep = tuple(int(n) for n in args.splits.split(",") if n)
        row = run_case(
            variant,
            batch,
            steps,
            context,
            jax.random.fold_in(key, context + steps + batch),
            sweep,
            args.profile_top,
            impls,
        )
        results.append(row)
        others = (
            f"split_scores {row['mgpu_split_scores_us']:8.1f} us"
            f" (rel err {row.get('mgpu_split_scores_rel_err', float('nan')):.1e})  overlap {row['mgpu_overlap_us']:8.1f} us"
            f" (rel err {row.get('mgpu_overlap_rel_err', float('nan')):.1e})  alternate {row['mgpu_alternate_us']:8.1f} us"
            f" (rel err {row.get('mgpu_alternate_rel_err', float('nan')):.1e})  pallas {row['pallas_us']:8.1f} us  "
            f"xla {row['xla_us']:8.1f} us"
        )
        print(common.mgpu_case_line(f"{variant:5s}", row, others), flush=True)
        common.write_result(f"attention_mgpu_{args.commit}", common.roofline_payload(results), args.commit, args.out)
    header = ["variant", *common.MGPU_TABLE_HEADER, "x roof", "rel err"]
    header += [
        "split_scores us",
        "split_scores TFLOP/s",
        "overlap us",
        "overlap TFLOP/s",
        "alternate us",
        "pallas us",
        "xla us",
        "xla / mgpu",
    ]
    table = [
        [
            r["variant"],
            *common.mgpu_table_cells(r),
            f"{r['mgpu_of_roofline']:.2f}",
            f"{r['rel_err']:.1e}",
            r["mgpu_split_scores_us"],
            f"{r.get('mgpu_split_scores_TFLOPs', float('nan')):.0f}",
            r["mgpu_overlap_us"],
            f"{r.get('mgpu_overlap_TFLOPs', float('nan')):.0f}",
            r["mgpu_alternate_us"],
            r["pallas_us"],
            r["xla_us"],
            f"{r['xla_us'] / r['mgpu_us']:.2f}",
        ]
        for r in results
    ]
    print("\n" + common.markdown_table(header, table))


if __name__ == "__main__":
    main()
