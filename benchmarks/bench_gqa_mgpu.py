"""GQA tree-verify attention: the Mosaic GPU kernel (kernels/ddtree_kernels/gqa_attention_mgpu.py) vs the Triton
kernel (`tree_attention`, the current GPU default for GQA) vs the models' XLA path (`tree_attention_reference`)
vs the roofline.

Cases: Qwen3-8B (Hq 32, Hkv 8, D 128) at N = 17 and 65 tree queries, contexts 1k, 8k and 32k, B = 1 (and
B = 8 at N = 17); the embedded pair's shape (Hq 4, Hkv 2, D 64) at context 512, N = 17 and 65, B = 1. The
cache holds context + N keys, its capacity rounded up to whole 64-key blocks (as an engine allocates it: the
Mosaic kernel's TMA reads whole key blocks, a ragged capacity would make its wrapper copy the cache); every
row sees its prefix plus its tree slots under a random ancestor mask (`common.random_tree_mask`).

Counted first, per call (S = context + N, the keys a row sees; G = Hq / Hkv):
  FLOPs = 4 * B * N * Hq * S * D  (QK^T and PV);
  bytes = K + V read once (4 * B * S * Hkv * D) + the queries and the bf16 output (4 * B * N * Hq * D) + the
          bool mask (B * N * S);
  roofline = max(bytes / 4.3 TB/s (read + write copy bandwidth measured on this H200), FLOPs / 790 TFLOP/s).
Timing (`op_profile.device_seconds`, as bench_mla_mgpu): one jitted program calls the variant once on each
of >= 4 input sets (queries, cache and mask; together larger than twice the 50 MB L2, so no call reads the
previous call's data from L2, up to MAX_SETS calls: the embedded pair's 0.3 MB sets stay L2-resident, flagged
`l2_resident` in its rows) and returns every output whole; `*_us` = the program's span on the device / the
sets (no host dispatch); `*_wall_us` = its wall time / the sets (`common.in_jit_seconds`; the rows archived
before `7ba6e57` are wall times). Correctness: ||out - ref|| / ||ref|| against the XLA path on input
set 0 (bf16: expect ~3e-3). A variant that fails to compile or run records its error string and the rest
go on.

Usage: PYTHONPATH=.:kernels python -m benchmarks.bench_gqa_mgpu --commit $(git rev-parse --short HEAD) [--quick]
  [--splits 4,8,16,32] [--block-kv 64]
Writes gqa_mgpu_<commit>.json to --out (default $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.op_profile import profile_into
from ddtree_kernels.gqa_attention_mgpu import BLOCK_M, gqa_tree_attention, row_plan, smem_plan, split_plan
from ddtree_kernels.tree_attention import tree_attention, tree_attention_reference

MAX_SETS = 32  # calls in one timed program (the embedded pair would ask for ~340: it stays L2-resident)
CAPACITY_BLOCK = 64
SHAPES = {"qwen3_8b": (32, 8, 128), "embedded": (4, 2, 64)}  # (Hq, Hkv, D)


def counts(shape: str, batch: int, steps: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one call."""
    q_heads, kv_heads, head_dim = SHAPES[shape]
    keys = context + steps
    flops = 4 * batch * steps * q_heads * keys * head_dim
    nbytes = 4 * batch * keys * kv_heads * head_dim + 4 * batch * steps * q_heads * head_dim + batch * steps * keys
    return float(flops), float(nbytes)


def input_sets(shape: str, batch: int, steps: int, context: int, key) -> list[tuple]:
    """`common.rotating_set_count` (q, k, v, mask) sets: fresh queries and cache each, the mask shared."""
    q_heads, kv_heads, head_dim = SHAPES[shape]
    _, nbytes = counts(shape, batch, steps, context)
    capacity = common.block_capacity(context + steps, CAPACITY_BLOCK)
    mask = common.padded_tree_mask(batch, steps, context, capacity)
    out = []
    for i in range(common.rotating_set_count(nbytes, MAX_SETS)):
        k = jax.random.split(jax.random.fold_in(key, i), 3)
        out.append(
            (
                jax.random.normal(k[0], (batch, steps, q_heads, head_dim), jnp.bfloat16),
                jax.random.normal(k[1], (batch, capacity, kv_heads, head_dim), jnp.bfloat16),
                jax.random.normal(k[2], (batch, capacity, kv_heads, head_dim), jnp.bfloat16),
                mask,
            )
        )
    return out


def variants(block_kv: int) -> dict:
    return {
        "mgpu": jax.jit(lambda q, k, v, mask: gqa_tree_attention(q, k, v, mask, block_kv=block_kv)),
        "triton": jax.jit(lambda q, k, v, mask: tree_attention((q,), (k,), v, mask)),
        "xla": jax.jit(lambda q, k, v, mask: tree_attention_reference((q,), (k,), v, mask)),
    }


def mgpu_with_splits(num_splits: int, block_kv: int):
    """The Mosaic kernel at a fixed number of key splits (the `--splits` sweep)."""
    return jax.jit(lambda q, k, v, mask: gqa_tree_attention(q, k, v, mask, block_kv=block_kv, num_splits=num_splits))


def run_case(
    shape: str, batch: int, steps: int, context: int, key, block_kv: int, split_sweep=(), profile_top: int = 0
) -> dict:
    q_heads, kv_heads, head_dim = SHAPES[shape]
    flops, nbytes = counts(shape, batch, steps, context)
    rows = steps * (q_heads // kv_heads)
    capacity = common.block_capacity(context + steps, CAPACITY_BLOCK)
    compute_wgs, row_blocks = row_plan(rows)
    splits, per_split = split_plan(batch, kv_heads, rows, capacity, block_kv, None)
    stages, smem = smem_plan(head_dim, block_kv, compute_wgs, -(-steps // 32), interpret=False)
    sets_count = common.rotating_set_count(nbytes, MAX_SETS)
    row = {
        "shape": shape,
        "Hq": q_heads,
        "Hkv": kv_heads,
        "D": head_dim,
        "B": batch,
        "N": steps,
        "context": context,
        **common.roofline_columns(flops, nbytes),
        "sets": sets_count,
        "l2_resident": sets_count * nbytes < 2 * common.L2_BYTES,
        "mgpu_block_kv": block_kv,
        "mgpu_grid": [row_blocks, splits, batch * kv_heads],
        "mgpu_rows_per_cta": compute_wgs * BLOCK_M,
        "mgpu_blocks_per_split": per_split,
        "mgpu_stages": stages,
        "mgpu_smem_bytes": smem,
    }
    attend = variants(block_kv)
    sets = input_sets(shape, batch, steps, context, key)
    common.time_variants_into(row, attend, sets, flops=flops, nbytes=nbytes)
    if profile_top:  # device time per op of one call on the first set (op_profile): where the us go
        for name in ("mgpu", "xla"):
            profile_into(row, name, attend[name], sets, profile_top)
    common.split_sweep_into(row, split_sweep, lambda num_splits: mgpu_with_splits(num_splits, block_kv), sets)
    row["rel_err"] = row.get("mgpu_rel_err", float("nan"))
    for name in attend:
        for metric in ("TFLOPs", "GBps", "of_roofline"):
            row.setdefault(f"{name}_{metric}", float("nan"))
    del sets
    return row


def cases(quick: bool, contexts: list[int], shapes: list[str]) -> list[tuple[str, int, int, int]]:
    """(shape, B, N, context): Qwen3-8B at N 17 / 65 (B 1, and 8 at N 17) over `contexts`; the embedded pair
    at context 512. --quick: N = 17, B = 1."""
    out = []
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
        steps_list = [17] if quick else [17, 65]
        shape_contexts = contexts if shape == "qwen3_8b" else [512]
        for steps in steps_list:
            batches = [1, 8] if shape == "qwen3_8b" and steps == 17 and not quick else [1]
            out += [(shape, batch, steps, context) for batch in batches for context in shape_contexts]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", help="directory for the JSON (default $OUT, else benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="N = 17, B = 1 only")
    parser.add_argument("--shapes", default="qwen3_8b,embedded", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--contexts", default="1024,8192,32768", help="Qwen3-8B contexts (embedded: 512)")
    common.add_profile_top_argument(parser)
    parser.add_argument("--block-kv", type=int, default=64, help="the Mosaic kernel's key block (64 or 128)")
    parser.add_argument(
        "--splits", default="", help="also time the Mosaic kernel at these key-split counts (e.g. 4,8,16,32)"
    )
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    sweep = tuple(int(n) for n in args.splits.split(",") if n)
    print(common.roofline_header(args.commit), flush=True)
    results = []
    key = jax.random.key(0)
    for shape, batch, steps, context in cases(args.quick, contexts, args.shapes.split(",")):
        case_key = jax.random.fold_in(key, context + steps + batch)
        row = run_case(shape, batch, steps, context, case_key, args.block_kv, sweep, args.profile_top)
        results.append(row)
        others = f"triton {row['triton_us']:8.1f} us  xla {row['xla_us']:8.1f} us"
        print(common.mgpu_case_line(f"{shape:8s}", row, others), flush=True)
        common.write_result(f"gqa_mgpu_{args.commit}", common.roofline_payload(results), args.commit, args.out)
    header = ["shape", *common.MGPU_TABLE_HEADER, "GB/s", "x roof", "rel err"]
    header += ["triton us", "xla us", "vs triton", "vs xla", "L2"]
    table = [
        [
            r["shape"],
            *common.mgpu_table_cells(r),
            f"{r['mgpu_GBps']:.0f}",
            f"{r['mgpu_of_roofline']:.2f}",
            f"{r['rel_err']:.1e}",
            r["triton_us"],
            r["xla_us"],
            f"{r['triton_us'] / r['mgpu_us']:.2f}",
            f"{r['xla_us'] / r['mgpu_us']:.2f}",
            "resident" if r["l2_resident"] else "cold",
        ]
        for r in results
    ]
    print("\n" + common.markdown_table(header, table))


if __name__ == "__main__":
    main()
