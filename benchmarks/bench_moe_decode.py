"""Routed-expert MoE decode with few assignments: the in-place INT4 kernels (kernels/ddtree_kernels/moe_decode.py)
vs the models' "gather" path (`ddtree_jax.models.moe.routed_gather`) and the grouped kernel (`routed_pallas`),
against the weight-read roofline.

Cases: Kimi K2.6 routed experts, E = 384, H = 7168, INT4 codes with bf16 group scales, at the TP8 shard's
width (I = 256 columns of gate / up per expert) and full width (I = 2048); T = 1 and 4 tokens, top-8
(A = 8 and 32 assignments). Experts are random codes made on the device.

Counted per call: the chosen experts' weight bytes (codes + scales; every assignment a distinct expert, so
A experts are read): gate_up A x 2 x I x (H / 2 + H / 32 x 2), down A x H x (I / 2 + I / 32 x 2);
roofline = bytes / the XLA copy bandwidth (read + write) measured in this run (`common.copy_bandwidth`).
Timing (`op_profile.device_seconds`, as benchmarks/bench_mla_mgpu.py): one jitted program runs the variant on each of
>= 4 input sets (x, the [T, 8] expert choice, routing weights, and an act for the down kernel alone); the
sets take disjoint experts from one random permutation, so no call finds the previous call's experts in
the 50 MB L2 (together >= 2 x L2). Time per call = the program's span on the device / sets (no host
dispatch; the rows archived before `7ba6e57` are wall times / sets).
Variants: "kernels" (moe_decode: gate_up + down), "gate_up", "down" (the kernels alone), "gather",
"pallas" (the models' paths, same weights), "mosaic" (`moe.routed_gathered_mosaic`: the Mosaic GPU decode form,
`grouped_int4_mgpu.gathered_int4_matmul`, for gate, up and down). Correctness: max |out - ref| / max |ref| on set 0 against the
float32 twin (`moe_decode_reference`; the "gather" / "pallas" paths round gate / up to bf16, ~1e-2).
A variant that fails to compile or run records its error and the run goes on. --sweep also times other
tilings of each kernel alone (us and rel. error per tiling).

Usage (GPU): PYTHONPATH=.:kernels python -m benchmarks.bench_moe_decode --commit $(git rev-parse --short HEAD) [--quick] [--sweep]
CPU smoke (interpret mode, tiny shapes): ... --small --quick. Writes moe_decode_<commit>.json to --out / $OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    copy_bandwidth,
    device_description,
    markdown_table,
    max_relative_error,
    write_result,
)
from benchmarks.op_profile import device_seconds
from ddtree_jax.models.moe import routed_gather, routed_gathered_mosaic, routed_pallas
from ddtree_kernels.moe_decode import (
    DOWN_TILES,
    GATE_UP_TILES,
    DecodeTiles,
    flat_assignments,
    gate_up_plan,
    moe_decode,
    moe_decode_down,
    moe_decode_down_reference,
    moe_decode_gate_up,
    moe_decode_gate_up_reference,
    moe_decode_reference,
)
from ddtree_kernels.quant import INT4_GROUP, Int4Weight

L2_BYTES = 50 << 20
MIN_SETS = 4
MAX_SETS = 16
TOP_K = 8
ASSUMED_COPY_BANDWIDTH = 4.3e12  # --small (CPU): the H200's, not measured
FULL = dict(experts=384, hidden=7168, widths=(256, 2048))
SMALL = dict(experts=64, hidden=256, widths=(64, 128))  # CPU smoke shapes
SWEEP_GATE_UP = (
    DecodeTiles(32, 512, None),
    DecodeTiles(32, 512, 1),
    DecodeTiles(16, 512, 1),
    DecodeTiles(16, 1024, None),
    DecodeTiles(64, 512, None),
    DecodeTiles(32, 256, None),
    DecodeTiles(32, 1024, None, num_warps=8),
    DecodeTiles(64, 256, None, num_warps=8, num_stages=4),
)
SWEEP_DOWN = (
    DecodeTiles(16, 256, 1, num_stages=4),
    DecodeTiles(16, 512, 1, num_stages=4),
    DecodeTiles(32, 256, 1, num_stages=4),
    DecodeTiles(32, 512, 1, num_stages=4),
    DecodeTiles(64, 512, 1, num_stages=3),
    DecodeTiles(32, 512, 1, num_warps=8, num_stages=3),
)


def tiles_name(t: DecodeTiles) -> str:
    return f"bn{t.block_n}_bk{t.block_k}_s{t.splits or 'auto'}_w{t.num_warps}_st{t.num_stages}"


def random_experts(experts: int, hidden: int, width: int, key) -> dict:
    """The routed-expert params routed_gather / routed_pallas read: random INT4 codes, bf16 scales in
    [0.005, 0.015] (random, so that a scale read from the wrong group shows)."""

    def make(k, n, inner):
        k1, k2 = jax.random.split(k)
        packed = jax.random.randint(k1, (experts, n, inner // 8), -(2**31), 2**31 - 1, jnp.int32)
        scale = jax.random.uniform(k2, (experts, n, inner // INT4_GROUP), jnp.float32, 0.005, 0.015)
        return Int4Weight(packed, scale.astype(jnp.bfloat16))

    keys = jax.random.split(key, 3)
    make = jax.jit(make, static_argnums=(1, 2))
    return {
        "expert_gate": make(keys[0], width, hidden),
        "expert_up": make(keys[1], width, hidden),
        "expert_down": make(keys[2], hidden, width),
    }


def weight_bytes(count: int, hidden: int, width: int, scale_bytes: int = 2) -> tuple[float, float]:
    """(gate_up, down) bytes of `count` distinct experts' codes + scales."""
    gate_up = count * 2 * width * (hidden // 2 + hidden // INT4_GROUP * scale_bytes)
    down = count * hidden * (width // 2 + width // INT4_GROUP * scale_bytes)
    return float(gate_up), float(down)


def input_sets(experts: int, hidden: int, width: int, tokens: int, key, call_bytes: float) -> list[tuple]:
    """>= MIN_SETS (x [T, H] bf16, experts [T, 8] int32, weights [T, 8] f32, act [A, I] bf16) sets with
    disjoint experts (one permutation), together >= 2 x L2 where the experts allow."""
    count = tokens * TOP_K
    sets = min(MAX_SETS, experts // count, max(MIN_SETS, math.ceil(2 * L2_BYTES / call_bytes)))
    perm = np.random.default_rng(tokens * 1000 + width).permutation(experts)
    out = []
    for i in range(sets):
        k = jax.random.split(jax.random.fold_in(key, i), 3)
        chosen = jnp.asarray(perm[i * count : (i + 1) * count].reshape(tokens, TOP_K), jnp.int32)
        weights = jax.random.uniform(k[1], (tokens, TOP_K), jnp.float32, 0.1, 0.5)
        out.append(
            (
                jax.random.normal(k[0], (tokens, hidden), jnp.bfloat16),
                chosen,
                weights,
                jax.random.normal(k[2], (count, width), jnp.bfloat16),
            )
        )
    return out


def _experts(p):
    return p["expert_gate"], p["expert_up"], p["expert_down"]


def variant(name: str, gate_up_tiles: DecodeTiles | None = None, down_tiles: DecodeTiles | None = None):
    """fn(params, x, chosen [T, k], weights [T, k], act) -> output of the variant."""

    def kernels(p, x, chosen, weights, act):
        return moe_decode(x, *_experts(p), *flat_assignments(chosen, weights), gate_up_tiles=gate_up_tiles)

    def gate_up(p, x, chosen, weights, act):
        experts, tokens, _ = flat_assignments(chosen, weights)
        return moe_decode_gate_up(x, p["expert_gate"], p["expert_up"], experts, tokens, tiles=gate_up_tiles)

    def down(p, x, chosen, weights, act):
        experts, tokens, w = flat_assignments(chosen, weights)
        return moe_decode_down(act, p["expert_down"], experts, tokens, w, x.shape[0], tiles=down_tiles)

    def gather(p, x, chosen, weights, act):
        return routed_gather(p, x, chosen, weights)

    def pallas(p, x, chosen, weights, act):
        return routed_pallas(p, x, chosen, weights)

    def mosaic(p, x, chosen, weights, act):
        return routed_gathered_mosaic(list(_experts(p)), None, x, chosen, weights)

    variants = {"kernels": kernels, "gate_up": gate_up, "down": down, "gather": gather, "pallas": pallas}
    return {**variants, "mosaic": mosaic}[name]


def reference(name: str, p, x, chosen, weights, act):
    experts, tokens, w = flat_assignments(chosen, weights)
    gate, up, down = _experts(p)
    if name == "gate_up":
        return moe_decode_gate_up_reference(x, gate, up, experts, tokens)
    if name == "down":
        return moe_decode_down_reference(act, down, experts, tokens, w, x.shape[0])
    return moe_decode_reference(x, gate, up, down, experts, tokens, w)


def run_case(params, shapes: dict, width: int, tokens: int, copy_bw: float, key, runs: int, sweep: bool) -> dict:
    experts, hidden = shapes["experts"], shapes["hidden"]
    count = tokens * TOP_K
    gate_up_b, down_b = weight_bytes(count, hidden, width)
    total_b = gate_up_b + down_b
    block_k, splits, _ = gate_up_plan(count, width, hidden, GATE_UP_TILES)
    row = {
        "I": width,
        "T": tokens,
        "A": count,
        "E": experts,
        "H": hidden,
        "MB": total_b / 1e6,
        "gate_up_MB": gate_up_b / 1e6,
        "down_MB": down_b / 1e6,
        "codes_MB": count * 3 * width * hidden / 2 / 1e6,
        "roofline_us": total_b / copy_bw * 1e6,
        "gate_up_grid": [math.ceil(width / GATE_UP_TILES.block_n), splits, count],
        "gate_up_block_k": block_k,
        "down_grid": [math.ceil(hidden / DOWN_TILES.block_n)],
    }
    sets = input_sets(experts, hidden, width, tokens, key, total_b)
    row["sets"] = len(sets)
    nbytes = {"kernels": total_b, "gate_up": gate_up_b, "down": down_b, "gather": total_b, "pallas": total_b}
    nbytes["mosaic"] = total_b
    refs = {}
    for name in ("kernels", "gate_up", "down"):  # the twins on set 0 (a failure only loses the error column)
        try:
            refs[name] = jax.block_until_ready(jax.jit(functools.partial(reference, name))(params, *sets[0]))
        except Exception as err:  # noqa: BLE001
            row[f"{name}_reference_error"] = f"{type(err).__name__}: {str(err)[:400]}"
    for name in ("kernels", "gate_up", "down", "gather", "pallas", "mosaic"):
        fn = variant(name)
        try:
            ref_name = name if name in ("gate_up", "down") else "kernels"
            out = jax.jit(fn)(params, *sets[0])
            row[f"{name}_rel_err"] = max_relative_error(out, refs[ref_name]) if ref_name in refs else float("nan")
            seconds = device_seconds(fn, sets, shared=(params,), runs=runs)
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_GBps"] = nbytes[name] / seconds / 1e9
            row[f"{name}_of_roofline"] = seconds / (nbytes[name] / copy_bw)
        except Exception as err:  # noqa: BLE001 - a variant that fails is a result; the rest go on
            row[f"{name}_us"] = float("nan")
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:400]}"
            traceback.print_exc()
    for name in ("kernels", "pallas", "mosaic"):
        row[f"{name}_vs_gather"] = row[f"{name}_us"] / row["gather_us"]
    refs.pop("kernels", None)
    if sweep:
        for label, tile_list, name, key_name in (
            ("gate_up", SWEEP_GATE_UP, "gate_up", "gate_up_tiles"),
            ("down", SWEEP_DOWN, "down", "down_tiles"),
        ):
            results = row.setdefault(f"sweep_{label}_us", {})
            for tiles in tile_list:
                fn = variant(name, **{key_name: tiles})
                try:
                    err = (
                        max_relative_error(jax.jit(fn)(params, *sets[0]), refs[name]) if name in refs else float("nan")
                    )
                    seconds = device_seconds(fn, sets, shared=(params,), runs=runs)
                    results[tiles_name(tiles)] = {"us": seconds * 1e6, "rel_err": err}
                except Exception as err:  # noqa: BLE001
                    results[tiles_name(tiles)] = f"{type(err).__name__}: {str(err)[:200]}"
    del sets
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", help="directory for the JSON (default $OUT, else benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="the TP8 shard (I = 256) only")
    parser.add_argument("--sweep", action="store_true", help="also time other tilings of each kernel")
    parser.add_argument("--widths", default="", help="override the expert widths I (default 256,2048)")
    parser.add_argument("--tokens", default="1,4", help="tokens per step (top-8 each; A = 8 T <= 32)")
    parser.add_argument("--runs", type=int, default=3, help="traced programs per timing (median)")
    parser.add_argument("--small", action="store_true", help="CPU smoke: tiny shapes, interpret mode")
    args = parser.parse_args()
    shapes = SMALL if args.small else FULL
    widths = [int(w) for w in args.widths.split(",")] if args.widths else list(shapes["widths"])
    if args.quick:
        widths = widths[:1]
    token_counts = [int(t) for t in args.tokens.split(",")]
    copy_bw = ASSUMED_COPY_BANDWIDTH if args.small else copy_bandwidth()
    print(
        f"device: {device_description()}; commit {args.commit}; copy bandwidth {copy_bw / 1e12:.2f} TB/s"
        + (" (assumed)" if args.small else " (measured)"),
        flush=True,
    )
    config = {
        "gate_up_tiles": dataclasses.asdict(GATE_UP_TILES),
        "down_tiles": dataclasses.asdict(DOWN_TILES),
        "copy_bandwidth_Bps": copy_bw,
        "copy_bandwidth_measured": not args.small,
    }
    results = []
    key = jax.random.key(0)
    for width in widths:
        params = random_experts(shapes["experts"], shapes["hidden"], width, jax.random.fold_in(key, width))
        for tokens in token_counts:
            row = run_case(
                params, shapes, width, tokens, copy_bw, jax.random.fold_in(key, width + tokens), args.runs, args.sweep
            )
            results.append(row)
            errors = "; ".join(f"{k}: {v}" for k, v in row.items() if k.endswith("_error"))
            print(
                f"I={width:5d} T={tokens} A={row['A']:2d}: {row['MB']:7.1f} MB, roof {row['roofline_us']:7.1f} us | "
                + "  ".join(
                    f"{n} {row[f'{n}_us']:7.1f} us"
                    for n in ("kernels", "gate_up", "down", "gather", "pallas", "mosaic")
                )
                + f" | kernels {row.get('kernels_of_roofline', float('nan')):.2f}x roof, "
                f"{row['kernels_vs_gather']:.2f}x gather" + (f"  [{errors}]" if errors else ""),
                flush=True,
            )
            for label in ("gate_up", "down"):
                if f"sweep_{label}_us" in row:
                    print(f"    sweep {label}: {row[f'sweep_{label}_us']}", flush=True)
            write_result(f"moe_decode_{args.commit}", {"rows": results, **config}, args.commit, args.out)
        del params
    header = ["I", "T", "A", "MB", "roof us", "kernels us", "GB/s", "x roof", "x gather", "rel err"]
    header += ["gate_up us", "x roof", "down us", "x roof", "gather us", "pallas us", "pallas x gather"]

    def f(row, name, fmt=".2f"):
        value = row.get(name, float("nan"))
        return f"{value:{fmt}}" if isinstance(value, float) else str(value)

    table = [
        [
            r["I"],
            r["T"],
            r["A"],
            r["MB"],
            r["roofline_us"],
            r["kernels_us"],
            f(r, "kernels_GBps", ".0f"),
            f(r, "kernels_of_roofline"),
            f(r, "kernels_vs_gather"),
            f(r, "kernels_rel_err", ".1e"),
            r["gate_up_us"],
            f(r, "gate_up_of_roofline"),
            r["down_us"],
            f(r, "down_of_roofline"),
            r["gather_us"],
            r["pallas_us"],
            f(r, "pallas_vs_gather"),
        ]
        for r in results
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
