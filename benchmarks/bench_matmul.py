"""Weight-streaming matmul benchmark: kernels/decode_matmul.py vs plain XLA vs the copy bandwidth.

Per matmul (shapes of Qwen3-8B and Kimi K2.6, weights [N, K] = (out, in)), at M = 1, 8, 17, 65, 257
activation rows: time of the Pallas kernel and of the XLA reference (`x @ dense(w).T`, what the models
run without kernels), each inside one jit running REPS products on different activations, and the
effective bandwidth = weight bytes / time against the copy bandwidth measured in the same run (1 GiB
buffer, read + write). INT4 weights: 0.5 byte per weight + bf16 scales per 32; FP8: 1 byte + block
scales. The grouped MoE case: 8 * T assignments over 384 K2.6 INT4 experts (routing drawn uniformly),
bytes = the distinct experts touched.

Whole forwards come from `benchmarks/bench_engine.py --matmul-impl pallas`
(AR step and verify forwards of the Qwen3-8B-shaped target against plain XLA).

Targets: each matmul >= 80% of the copy bandwidth for M <= 65.

`--grouped-sweep 1,4,9,17` instead times the grouped INT4 kernel's tilings (`SWEEP_TILES`: column
width, K step, split-K, warps, stages) on the K2.6 gate and down expert shapes at those token counts,
printing the default against the best per case (GB/s, and TFLOP/s: `--grouped-sweep 2048 --grouped-tiles
prefill` sweeps `PREFILL_SWEEP_TILES` at a prefill chunk's 16,384 assignments). `--grouped-impl mosaic` also
times the Mosaic GPU INT4 kernel (`ddtree_kernels.grouped_int4_mgpu`, `MOSAIC_SWEEP` tilings) on the same
inputs, side by side, with its error against the Triton kernel's output (`--grouped-impl mosaic-decode`: at decode
sizes, `MOSAIC_DECODE_SWEEP`; `--grouped-impl stream`: the streamed kernel, `grouped_int4_stream_mgpu`, over
`STREAM_SWEEP`). `--grouped-gather-ab 9,17,65` times the input projection with its rows gathered first against
read through a row index. `--grouped-shape shard
--grouped-tiles shard` sweeps one TP8 shard's expert shapes (1/8 of the intermediate) over `SHARD_SWEEP_TILES`
(`--grouped-tiles dequant`: each INT4 dequantisation).

Usage: python -m benchmarks.bench_matmul --commit $(git rev-parse --short HEAD) [--quick] [--shapes tiny]
       python -m benchmarks.bench_matmul --commit C --grouped-sweep 1,4,9,17
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_description, markdown_table, median_seconds, write_result
from ddtree_kernels.decode_matmul import (
    DEQUANT_MODES,
    NARROW_GROUPED_TILES,
    PREFILL_GROUPED_TILES,
    SHORT_K_GROUPED_TILES,
    GroupedTiles,
    default_grouped_tiles,
    fit_grouped_tiles,
    grouped_matmul,
    grouped_plan,
    matmul,
)
from ddtree_kernels.grouped_int4_mgpu import grouped_int4_matmul
from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul
from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight, dense

REPS = 10  # products a timed program runs (on REPS activation sets)
TIMING_RUNS = 7  # timed runs of that program (the median is reported); the tests set both to 1
SHAPES = {
    # name: (N, K, format)
    "qwen3-8b": [
        ("q_proj", 4096, 4096, "bf16"),
        ("kv_proj", 1024, 4096, "bf16"),
        ("gate/up", 12288, 4096, "bf16"),
        ("down", 4096, 12288, "bf16"),
        ("lm_head", 151936, 4096, "bf16"),
    ],
    "k2.6": [
        ("q_b_proj", 64 * 192, 1536, "bf16"),
        ("o_proj", 7168, 64 * 128, "bf16"),
        ("dense gate", 18432, 7168, "bf16"),
        ("expert gate (int4)", 2048, 7168, "int4"),
        ("expert down (int4)", 7168, 2048, "int4"),
        ("dsv3 o_proj (fp8)", 7168, 16384, "fp8"),
    ],
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

    return median_seconds(run, xs, weight, runs=TIMING_RUNS) / REPS


# the tilings `--grouped-sweep` times: column width x K step x K splits (None: grouped_plan's rule), then
# warps / stages around the default
SWEEP_TILES = [
    GroupedTiles(block_n=bn, block_k=bk, splits=sp)
    for bn in (32, 64, 128)
    for bk in (256, 512)
    for sp in (None, 1, 2, 4, 8)
] + [
    GroupedTiles(num_warps=8),
    GroupedTiles(num_stages=2),
    GroupedTiles(num_stages=4),
    GroupedTiles(block_n=32, block_k=512, num_stages=4),
    GroupedTiles(block_n=128, num_warps=8),
]


# `--grouped-tiles shard`, for one TP8 shard's experts (`--grouped-shape shard`: gate / up [256, 7168], down
# [7168, 256]; 8-520 assignments): narrower columns and more K splits (the gate's 28 K steps), wider columns for
# the down projection's one K step, more warps and stages
SHARD_SWEEP_TILES = (
    [
        GroupedTiles(block_n=bn, block_k=bk, splits=sp)
        for bn in (16, 32, 64, 128, 256)
        for bk in (256, 512)
        for sp in (1, 2, 4, 7, 14)
    ]
    + [
        GroupedTiles(block_n=bn, num_warps=w, num_stages=st, splits=sp)
        for bn in (32, 64, 128)
        for w, st in ((8, 3), (4, 2), (4, 4), (2, 3))
        for sp in (4, 7)
    ]
    + [NARROW_GROUPED_TILES, SHORT_K_GROUPED_TILES]
)  # the shard defaults (their dequantisation) among the rows

# `--grouped-tiles dequant`: each dequantisation (`decode_matmul.DEQUANT_MODES`) at the shard's defaults and two
# neighbours (`--grouped-shape shard`; the K = 256 down projection runs each as its one K step)
DEQUANT_SWEEP_TILES = [
    GroupedTiles(block_n=bn, block_k=bk, splits=sp, num_stages=st, dequant=mode)
    for mode in DEQUANT_MODES
    for bn, bk, sp, st in ((64, 512, 14, 3), (128, 256, 14, 3), (64, 256, 1, 2))
]

# the expert shapes `--grouped-sweep` times: K2.6 whole (one GPU) or one TP8 shard's 1/8 of the intermediate
GROUPED_SHAPES = {
    "full": (("gate", 2048, 7168), ("down", 7168, 2048)),
    "shard": (("gate", 256, 7168), ("down", 7168, 256)),
}


# `--grouped-tiles prefill`, for prefill chunks (2,048 tokens x top-8 over 384 experts: ~43 rows an expert, 64-row
# tiles): the one-dot form (each K step one dot over the 8 nibble planes side by side, not 8 dots of K / 8), more
# warps, other column widths; each as it fits the shared memory at 64 rows (`fit_grouped_tiles`: 512-wide K steps
# take 2 stages, 256-wide up to 4; the sweep records the fitted tiling)
PREFILL_SWEEP_TILES = [
    GroupedTiles(),
    GroupedTiles(one_dot=True),
    GroupedTiles(num_warps=8, one_dot=True),
    GroupedTiles(block_k=512, num_warps=8, num_stages=2, one_dot=True),
    GroupedTiles(block_n=64, num_stages=4, one_dot=True),
    GroupedTiles(block_n=256, num_warps=8, one_dot=True),
    GroupedTiles(block_k=512, num_warps=8, num_stages=2),
    GroupedTiles(block_n=64, block_k=512, num_stages=2, one_dot=True),
]


# `--grouped-impl mosaic`: the Mosaic GPU kernel's tilings (token rows a tile, K step; stages: as many as fit)
MOSAIC_SWEEP = [
    dict(block_m=64, block_k=256),
    dict(block_m=64, block_k=256, deferred_release=True),
    dict(block_m=128, block_k=256),
    dict(block_m=32, block_k=256),
]
# `--grouped-impl mosaic-decode`: the same kernel at decode / tree-verify sizes (1-2 rows an expert): 8- and 16-row
# tiles (wgmma's smallest N), K split so that a TP8 shard's gate / up (K = 7,168: 28 steps of 256) fill the SMs; the
# shard's down projection (K = 256, one step) takes k_splits = 1 only (the others are recorded as refused)
MOSAIC_DECODE_SWEEP = [dict(block_m=bm, block_k=256, k_splits=s) for bm in (8, 16) for s in (1, 4, 7, 14)]
# `--grouped-impl stream`: the streamed kernel (`grouped_int4_stream_mgpu`: persistent CTAs, one TMA ring across their
# work items) at decode / tree sizes: its plan (chunks None: `stream_plan`), 8- / 16-row tiles, ring depths, K chunks
STREAM_SWEEP = (
    [dict(block_m=bm) for bm in (16, 8)]
    + [dict(block_m=16, stages=st) for st in (3, 5)]
    + [dict(block_m=16, chunks=c) for c in (1, 4, 7)]
)


def _rates(seconds: float, flops: float, nbytes: float, copy_bw: float) -> dict:
    """A grouped call's time as us, TFLOP/s (prefill sizes are compute-bound), GB/s and the share of the copy
    bandwidth."""
    return {
        "us": seconds * 1e6,
        "TFLOPs": flops / seconds / 1e12,
        "GBps": nbytes / seconds / 1e9,
        "of_copy": nbytes / seconds / copy_bw,
    }


def tile_fields(row: dict) -> dict:
    """The `GroupedTiles` fields of a sweep row (its splits: None where the plan's rule chose them)."""
    fields = {f.name: row[f.name] for f in dataclasses.fields(GroupedTiles) if f.name in row}
    return fields | {"splits": None if row.get("splits_rule") else row["splits"]}


def _random_experts(key, experts: int, n: int, k: int) -> Int4Weight:
    """Random INT4 expert weights [E, N, K] (random codes, constant bf16 group scales 0.01)."""
    return Int4Weight(
        jax.random.randint(key, (experts, n, k // 8), -(2**31), 2**31 - 1, jnp.int32),
        jnp.full((experts, n, k // 32), 0.01, jnp.bfloat16),
    )


def _uniform_routing(tokens: int, experts: int, k: int, key):
    """T tokens x top-8 drawn uniformly over the experts (seeded by T): (assignments, group sizes int32 [E],
    distinct experts, REPS activation sets bf16 [REPS, A, K])."""
    assign = tokens * 8
    chosen = np.random.default_rng(tokens).integers(0, experts, assign)
    sizes = jnp.asarray(np.bincount(chosen, minlength=experts), jnp.int32)
    xs = jax.random.normal(key, (REPS, assign, k), jnp.bfloat16)
    return assign, sizes, len(set(chosen.tolist())), xs


def grouped_sweep(
    tokens_list,
    copy_bw: float,
    key,
    commit: str,
    tiles_list=SWEEP_TILES,
    experts: int = 384,
    projections=(("gate", 2048, 7168), ("down", 7168, 2048)),
    mosaic_list=(),
    mosaic_fn=grouped_int4_matmul,
) -> list[dict]:
    """Times each tiling of the grouped INT4 kernel on K2.6 expert shapes at T tokens x top-8 (routing drawn
    uniformly, the same per T for every tiling); bytes = the distinct experts' packed weights + scales.
    mosaic_list: tilings of a Mosaic GPU kernel (mosaic_fn: `grouped_int4_matmul`, or `streamed_int4_matmul`)
    timed on the same inputs (rows with impl "mosaic" / "stream", and max_err: max |y - y_triton| / max |y_triton|
    against the Triton kernel's default tiling)."""
    impl = "stream" if mosaic_fn is streamed_int4_matmul else "mosaic"
    rows = []
    for proj, n, k in projections:
        weight = _random_experts(key, experts, n, k)
        for tokens in tokens_list:
            assign, sizes, distinct, xs = _uniform_routing(tokens, experts, k, key)
            nbytes = distinct * n * k * (0.5 + 2 / 32)
            seen = set()
            for requested in tiles_list:
                block_m = grouped_plan(assign, experts, n, k, requested)[0]
                # what runs: the K step and stages cut to the shared memory, as grouped_matmul does
                tiles = fit_grouped_tiles(requested, "int4", jnp.bfloat16, jnp.int32, jnp.bfloat16, block_m)
                # what runs, splits included (K = 256 leaves one split whatever was asked)
                tiles = dataclasses.replace(tiles, splits=grouped_plan(assign, experts, n, k, tiles)[2])
                if tiles in seen:
                    print(f"grouped {proj} T={tokens} {requested}: runs as an earlier tiling ({tiles}), skipped")
                    continue
                seen.add(tiles)
                splits = grouped_plan(assign, experts, n, k, tiles)[2]
                try:
                    seconds = _timed(lambda x, w, tiles=tiles: grouped_matmul(x, w, sizes, tiles=tiles), xs, weight)
                except Exception as err:  # noqa: BLE001 - a tiling that fails to compile or run is a result
                    rows.append({"projection": proj, "T": tokens, **dataclasses.asdict(tiles), "error": str(err)[:300]})
                    print(f"grouped {proj} T={tokens} {tiles}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                row = {
                    "projection": proj,
                    "N": n,
                    "K": k,
                    "T": tokens,
                    "assignments": assign,
                    "distinct_experts": distinct,
                    "block_n": tiles.block_n,
                    "block_k": tiles.block_k,
                    "splits": splits,
                    "splits_rule": requested.splits is None,
                    "effective": dataclasses.asdict(tiles),
                    "num_warps": tiles.num_warps,
                    "num_stages": tiles.num_stages,
                    "one_dot": tiles.one_dot,
                    "dequant": tiles.dequant,
                    "requested": dataclasses.asdict(requested),
                    "block_m": block_m,
                    **_rates(seconds, 2 * assign * n * k, nbytes, copy_bw),
                }
                rows.append(row)
                write_result(f"grouped_sweep_{commit}", {"rows": rows, "copy_bandwidth_Bps": copy_bw}, commit)
            if mosaic_list:
                y_triton = np.asarray(grouped_matmul(xs[0], weight, sizes), np.float32)
            for config in mosaic_list:
                label = {"impl": impl, "projection": proj, "T": tokens, **config}
                try:
                    call = lambda x, w, c=config: mosaic_fn(x, w, sizes, **c)  # noqa: E731
                    # one jitted program, waited for (in interpret mode an op-by-op call can hang the interpreter:
                    # tests/kernels/mosaic_interpret.py)
                    y = np.asarray(jax.block_until_ready(jax.jit(call)(xs[0], weight)), np.float32)
                    seconds = _timed(call, xs, weight)
                except Exception as err:  # noqa: BLE001 - a tiling that fails to compile or run is a result
                    rows.append({**label, "error": str(err)[:300]})
                    print(f"{impl} {proj} T={tokens} {config}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    continue
                row = {
                    **label,
                    "N": n,
                    "K": k,
                    "assignments": assign,
                    "distinct_experts": distinct,
                    **_rates(seconds, 2 * assign * n * k, nbytes, copy_bw),
                    "max_err": float(np.abs(y - y_triton).max() / np.abs(y_triton).max()),
                }
                rows.append(row)
                write_result(f"grouped_sweep_{commit}", {"rows": rows, "copy_bandwidth_Bps": copy_bw}, commit)
                print(
                    f"{impl} {proj} T={tokens:3d} {config}: "
                    f"{row['us']:8.1f} us ({row['TFLOPs']:.0f} TFLOP/s; max err vs Triton {row['max_err']:.1e})",
                    flush=True,
                )
            case = [r for r in rows if r["projection"] == proj and r["T"] == tokens and "us" in r and "impl" not in r]
            if not case:
                continue
            best = min(case, key=lambda r: r["us"])
            # the default at this size: the decode tiling, or PREFILL_GROUPED_TILES at > 32 assignments an expert
            default_tiles = default_grouped_tiles(weight, tokens * 8)
            default_block_m = grouped_plan(tokens * 8, experts, n, k, default_tiles)[0]
            default_tiles = fit_grouped_tiles(
                default_tiles, "int4", jnp.bfloat16, jnp.int32, jnp.bfloat16, default_block_m
            )
            default_tiles = dataclasses.replace(
                default_tiles, splits=grouped_plan(tokens * 8, experts, n, k, default_tiles)[2]
            )
            default = next((r for r in case if r["effective"] == dataclasses.asdict(default_tiles)), None)
            default_text = (
                "default not swept"
                if default is None
                else f"default {default['us']:8.1f} us ({100 * default['of_copy']:4.0f}% of copy, "
                f"{default['TFLOPs']:.0f} TFLOP/s)"
            )
            print(
                f"grouped {proj} T={tokens:3d} ({distinct} experts, {nbytes / 1e6:6.1f} MB): {default_text}; "
                f"best {best['us']:8.1f} us "
                f"({100 * best['of_copy']:4.0f}%, {best['TFLOPs']:.0f} TFLOP/s) at "
                f"block_n {best['block_n']} block_k {best['block_k']} splits {best['splits']} warps {best['num_warps']} "
                f"stages {best['num_stages']} one_dot {best['one_dot']} dequant {best['dequant']}",
                flush=True,
            )
    return rows


def gather_ab(tokens_list, copy_bw: float, key, commit: str, projections, experts: int = 384) -> list[dict]:
    """The grouped INT4 kernel's two ways to its rows in expert order, side by side at the default tiling, on the
    input projections of `projections` (gate / up: their rows are the layer's tokens): "xla" gathers the T x top-8
    rows (`x[row_index]`) before the kernel, as the models did; "kernel" hands it the T token rows and the row
    index (`grouped_matmul(row_index=)`). Each timed call starts from REPS fresh token sets [T, K]; routing as
    `_uniform_routing` (the same per T), assignments sorted stably by expert."""
    rows = []
    for proj, n, k in projections[:1]:  # the input projection (gate; up has its shape)
        weight = _random_experts(key, experts, n, k)
        for tokens in tokens_list:
            assign = tokens * 8
            chosen = np.random.default_rng(tokens).integers(0, experts, assign)
            sizes = jnp.asarray(np.bincount(chosen, minlength=experts), jnp.int32)
            row_index = jnp.asarray(np.argsort(chosen, kind="stable") // 8, jnp.int32)
            nbytes = len(set(chosen.tolist())) * n * k * (0.5 + 2 / 32)
            token_sets = jax.random.normal(jax.random.fold_in(key, tokens), (REPS, tokens, k), jnp.bfloat16)
            forms = {
                "xla": lambda x, w: grouped_matmul(x[row_index], w, sizes),
                "kernel": lambda x, w: grouped_matmul(x, w, sizes, row_index=row_index),
            }
            outputs = {name: np.asarray(form(token_sets[0], weight), np.float32) for name, form in forms.items()}
            np.testing.assert_array_equal(outputs["kernel"], outputs["xla"])  # the same kernel on the same rows
            seconds = {name: [] for name in forms}
            for _ in range(2):  # alternated, twice: the median of each form's runs
                for name, form in forms.items():
                    seconds[name].append(_timed(form, token_sets, weight))
            for name in forms:
                row = {
                    "projection": proj,
                    "N": n,
                    "K": k,
                    "T": tokens,
                    "assignments": assign,
                    "gather": name,
                    "runs_us": [t * 1e6 for t in seconds[name]],
                    **_rates(float(np.median(seconds[name])), 2 * assign * n * k, nbytes, copy_bw),
                }
                rows.append(row)
            kernel_us, xla_us = (rows[-1]["us"], rows[-2]["us"])
            print(
                f"gather A/B {proj} T={tokens:3d} ({assign} assignments, {nbytes / 1e6:6.1f} MB): xla (gather first) "
                f"{xla_us:8.1f} us, kernel (row index) {kernel_us:8.1f} us: {xla_us / kernel_us:.2f}x",
                flush=True,
            )
            write_result(f"grouped_gather_ab_{commit}", {"rows": rows, "copy_bandwidth_Bps": copy_bw}, commit)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shapes", default="qwen3-8b,k2.6")
    parser.add_argument("--rows", default="1,8,17,65,257")
    parser.add_argument("--quick", action="store_true", help="M = 1 and 17 only")
    parser.add_argument(
        "--grouped-sweep",
        default="",
        help="only sweep the grouped INT4 kernel's tilings at these "
        "token counts (e.g. 1,4,9,17; K2.6 gate and down projections)",
    )
    parser.add_argument(
        "--grouped-tiles",
        default="decode",
        choices=("decode", "shard", "dequant", "prefill", "prefill-default"),
        help="the tilings --grouped-sweep times: SWEEP_TILES (decode), SHARD_SWEEP_TILES (shard), "
        "DEQUANT_SWEEP_TILES (dequant: each INT4 dequantisation), "
        "PREFILL_SWEEP_TILES (e.g. --grouped-sweep 2048) or PREFILL_GROUPED_TILES alone (prefill-default)",
    )
    parser.add_argument(
        "--grouped-shape",
        default="full",
        choices=tuple(GROUPED_SHAPES),
        help="the expert shapes --grouped-sweep times: K2.6 whole (full) or one TP8 shard's (shard)",
    )
    parser.add_argument(
        "--grouped-impl",
        default="triton",
        choices=("triton", "mosaic", "mosaic-decode", "stream"),
        help="mosaic: --grouped-sweep also times the Mosaic GPU INT4 kernel (MOSAIC_SWEEP) on the same inputs; "
        "mosaic-decode: at decode sizes (MOSAIC_DECODE_SWEEP: 8- / 16-row tiles, K splits); stream: the streamed "
        "kernel (STREAM_SWEEP: grouped_int4_stream_mgpu)",
    )
    parser.add_argument(
        "--grouped-gather-ab",
        default="",
        help="only time, at these token counts (e.g. 9,17,65), the grouped kernel's input projection with its rows "
        "gathered first against read through a row index (`gather_ab`; --grouped-shape picks the shapes)",
    )
    args = parser.parse_args()
    if args.grouped_gather_ab:
        copy_bw = copy_bandwidth(REPS) if jax.default_backend() == "gpu" else float("nan")
        print(f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
        tokens = [int(t) for t in args.grouped_gather_ab.split(",")]
        gather_ab(tokens, copy_bw, jax.random.key(1), args.commit, GROUPED_SHAPES[args.grouped_shape])
        return
    if args.grouped_sweep:
        copy_bw = copy_bandwidth(REPS) if jax.default_backend() == "gpu" else float("nan")
        print(
            f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s",
            flush=True,
        )
        grouped_sweep(
            [int(t) for t in args.grouped_sweep.split(",")],
            copy_bw,
            jax.random.key(1),
            args.commit,
            tiles_list={
                "decode": SWEEP_TILES,
                "prefill": PREFILL_SWEEP_TILES,
                "prefill-default": [PREFILL_GROUPED_TILES],
                "shard": SHARD_SWEEP_TILES,
                "dequant": DEQUANT_SWEEP_TILES,
            }[args.grouped_tiles],
            projections=GROUPED_SHAPES[args.grouped_shape],
            mosaic_list={
                "triton": (),
                "mosaic": MOSAIC_SWEEP,
                "mosaic-decode": MOSAIC_DECODE_SWEEP,
                "stream": STREAM_SWEEP,
            }[args.grouped_impl],
            mosaic_fn=streamed_int4_matmul if args.grouped_impl == "stream" else grouped_int4_matmul,
        )
        return
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
                row = {
                    "set": shape_set,
                    "name": name,
                    "N": n,
                    "K": k,
                    "format": fmt,
                    "M": m,
                    "weight_MB": nbytes / 1e6,
                    "pallas_us": kernel_s * 1e6,
                    "xla_us": xla_s * 1e6,
                    "pallas_GBps": nbytes / kernel_s / 1e9,
                    "xla_GBps": nbytes / xla_s / 1e9,
                    "pallas_of_copy": nbytes / kernel_s / copy_bw,
                }
                results.append(row)
                print(
                    f"{shape_set:8s} {name:20s} M={m:4d}: pallas {row['pallas_us']:9.1f} us ({row['pallas_GBps']:7.0f} GB/s, "
                    f"{100 * row['pallas_of_copy']:5.1f}% of copy)  xla {row['xla_us']:9.1f} us ({row['xla_GBps']:7.0f} GB/s)",
                    flush=True,
                )
                write_result("matmul", {"rows": results, "copy_bandwidth_Bps": copy_bw}, args.commit)
    if "k2.6" in args.shapes:  # the MoE hot path: T tokens x top-8 of 384 INT4 experts
        experts = 384
        weight = _random_experts(key, experts, 2048, 7168)
        for tokens in (1, 17, 65):
            assign, sizes, distinct, xs = _uniform_routing(tokens, experts, 7168, key)
            kernel_s = _timed(lambda x, w: grouped_matmul(x, w, sizes), xs, weight)
            nbytes = distinct * 2048 * 7168 * (0.5 + 2 / 32)
            row = {
                "set": "k2.6",
                "name": f"grouped experts gate, T={tokens}",
                "M": assign,
                "distinct_experts": distinct,
                "weight_MB": nbytes / 1e6,
                "pallas_us": kernel_s * 1e6,
                "pallas_GBps": nbytes / kernel_s / 1e9,
                "pallas_of_copy": nbytes / kernel_s / copy_bw,
            }
            results.append(row)
            print(
                f"grouped INT4 experts T={tokens:3d} ({distinct} distinct): {row['pallas_us']:9.1f} us "
                f"({row['pallas_GBps']:7.0f} GB/s, {100 * row['pallas_of_copy']:5.1f}% of copy)",
                flush=True,
            )
            write_result("matmul", {"rows": results, "copy_bandwidth_Bps": copy_bw}, args.commit)
    header = ["set", "matmul", "M", "weight MB", "pallas us", "pallas GB/s", "% of copy", "xla us", "xla GB/s"]
    table = [
        [
            r["set"],
            r["name"],
            r["M"],
            f"{r['weight_MB']:.1f}",
            r["pallas_us"],
            f"{r['pallas_GBps']:.0f}",
            f"{100 * r['pallas_of_copy']:.0f}",
            r.get("xla_us", ""),
            f"{r['xla_GBps']:.0f}" if "xla_GBps" in r else "",
        ]
        for r in results
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
