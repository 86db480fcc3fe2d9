"""The Kimi K2.6 TP8 shard's decode step, whole, on one GPU: what one GPU of the 8-GPU run computes and reads.

`analysis.tp_shard.tp_shard_config` turns the K2.6 target (all 61 layers, random INT4 routed experts) and
the Kimi-K2.5-DFlash-shaped drafter into one device's share under the TP rule table: 8 query heads, the
replicated q_a / kv_a projections and latent cache, 1/8 of the dense, shared and routed FFN columns, 1/8
of the vocabulary, the whole router (checked parameter by parameter against what the rule table gives each
device). The shard is initialised on the device (`benchmarks.k26_model.random_int4_target`: no dense
expert copy, one layer's codes at a time) and its fused decode step timed (`benchmarks.bench_engine.
bench_case`, step only: `loop_step_ms`, a step inside an on-device loop as `generate` runs it, and `step_ms`, one
step called from the host, whose dispatch of the shard's ~1,000 parameter arrays adds milliseconds) for AR, the
chain and DDTree budgets, per (batch, context).

Collectives are not run (one GPU): each row carries the modelled collective time of the real 8-GPU step
(`analysis.roofline.step_cost(..., layout="tp8")`: two all-reduces per layer, the embedding's and the
logits' gathers, the drafter's; latency + ring bytes at the assumed NVLink bandwidth), the shard's own
roofline (the same model's memory and compute time of one device) and the predicted TP step
(`predicted_tp_step_ms`) = measured shard step in the loop + modelled collectives. JSON: `$OUT/k26_tp<n>_shard.json`. The shard's numerics are one device's partial sums (no all-reduce),
so its tokens are meaningless; its work is the real one's.

Usage (one H200): python -m experiments.tp_shard_step --commit C [--layers 61] [--contexts 4096,32768]
       [--batches 1,8] [--budgets 8,16,32,64]
       (CPU check): python -m experiments.tp_shard_step --tiny --model-size 2 (the tiny K2's 128 expert
       columns split 8 ways would be half an INT4 group: --tiny with --model-size 8 is refused up front)

Every argument is checked before the shard is built, so an argument error cannot stop a run midway. The JSON is
rewritten after each row under a fixed name, `k26_tp<n>_shard[_tiny][_<tag>].json`: a new run with the same
--model-size, --tiny and --tag replaces the previous run's file (pass --tag to keep both).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_engine import bench_case
from benchmarks.common import device_description, int_list_argument, markdown_table, temperature_argument, write_result
from benchmarks.k26_model import (
    DRAFTS,
    DRAFTS_HELP,
    ROUTER_BIASES,
    TINY_SIZES,
    drafter_class,
    int4_split_problem,
    k26_config,
    random_int4_target,
)
from benchmarks.op_profile import format_profile, format_stages
from ddtree_jax import dispatch
from ddtree_jax.analysis.roofline import step_cost
from ddtree_jax.analysis.tp_shard import tp_shard_config
from ddtree_jax.engine.run import Pair
from ddtree_jax.models import deepseek_v3, dflash
from ddtree_jax.options import METHODS, DecodeOptions
from experiments.sharded_run import drafter_config


def shard_pair(
    layers: int,
    drafter_layers: int,
    model_size: int,
    *,
    tiny: bool,
    dtype,
    seed: int = 0,
    router_bias: str = "zero",
    drafts: str = "spread",
):
    """(full target config, full drafter config, the shard Pair) with the shard's weights made on the device;
    router_bias: `random_int4_target`'s (zero: a load-balanced spread of experts over a step's rows); drafts:
    "spread" (`SpreadDraftsDrafter`: each depth its own random distribution, as a trained drafter's positions
    have) or "model" (the random drafter's own tokens, one token repeated along the chain: every row without a
    `drafts` field, before `1031e46`). Rows of `1031e46`-`32e5c1a` say "distinct": a one-hot boost a depth, which made
    DDTree's trees a spine with repeated siblings; at `a90156e` "distinct" was briefly the name of "spread")."""
    drafter_type = drafter_class(drafts)  # checked before any weight is made
    full = k26_config(layers, tiny)
    full_drafter = drafter_config(full, drafter_layers, tiny)
    target = tp_shard_config(full, model_size)
    drafter = tp_shard_config(full_drafter, model_size, target_hidden=full.hidden_size)
    key = jax.random.key(seed)
    params = jax.jit(lambda k: random_int4_target(target, k, dtype, router_bias))(key)
    drafter_params = jax.jit(lambda k: dflash.init_params(drafter, target.hidden_size, k, dtype))(
        jax.random.fold_in(key, 1)
    )
    pair = Pair(
        target,
        params,
        drafter_type(drafter, drafter_params, deepseek_v3.embedding(params), deepseek_v3.head(target, params)),
    )
    return full, full_drafter, pair


def _check_args(parser, args) -> tuple[list[str], list[int], list[int], list[int], list[str]]:
    """Every argument checked before any work (methods, lists, counts, the shard's divisibility); returns the
    parsed (methods, budgets, contexts, batches, attention implementations)."""
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad or len(set(methods)) != len(methods):
        parser.error(f"--methods {args.methods!r}: expected distinct entries of {', '.join(METHODS)}")
    budgets = int_list_argument(parser, "budgets", args.budgets)
    contexts = int_list_argument(parser, "contexts", args.contexts)
    batches = int_list_argument(parser, "batches", args.batches)
    for name in ("model_size", "layers", "drafter_layers", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.profile_top < 0:
        parser.error(f"--profile-top {args.profile_top}: must be >= 0")
    if args.mla_reduce_rows is not None and args.mla_reduce_rows < 0:
        parser.error(f"--mla-reduce-rows {args.mla_reduce_rows}: must be >= 0")
    attn_impls = args.attn_impls.split(",")
    if len(set(attn_impls)) != len(attn_impls):
        parser.error(f"--attn-impls {args.attn_impls!r}: each implementation may appear only once")
    for attn_impl in attn_impls:
        try:
            DecodeOptions(matmul_impl="xla", layer_loop=args.layer_loop, moe_impl=args.moe_impl, attn_impl=attn_impl)
        except ValueError as e:
            parser.error(str(e))
    if args.tag is not None and (not args.tag or not all(c.isalnum() or c in "-_." for c in args.tag)):
        parser.error(f"--tag {args.tag!r}: expected letters, digits, '-', '_' or '.'")
    # the shard's shapes (no weights): the split must divide the model and leave whole INT4 groups per expert row
    try:
        full = k26_config(args.layers, args.tiny)
        target = tp_shard_config(full, args.model_size)
        tp_shard_config(
            drafter_config(full, args.drafter_layers, args.tiny), args.model_size, target_hidden=full.hidden_size
        )
    except ValueError as e:
        parser.error(f"--model-size {args.model_size}: {e}" + (TINY_SIZES if args.tiny else ""))
    problem = int4_split_problem(target)
    if problem:
        parser.error(f"--model-size {args.model_size}: {problem}" + (TINY_SIZES if args.tiny else ""))
    return methods, budgets, contexts, batches, attn_impls


def _row_choices(parser, flag: str, value: str | None, allowed: tuple[str, ...], auto_is: str) -> list:
    """A comma-separated list of one dispatch setting's values, one row each ([None]: the setting as it is): each
    must be of `allowed`, none twice once "auto" reads as `auto_is` (what the dispatch resolves it to)."""
    if value is None:
        return [None]
    choices = value.split(",")
    bad = [c for c in choices if c not in allowed]
    if bad:
        parser.error(f"{flag} {value!r}: {bad} not of {list(allowed)}")
    resolved = [auto_is if c == "auto" else c for c in choices]
    repeated = sorted({c for c in resolved if resolved.count(c) > 1})
    if repeated:
        parser.error(f"{flag} {value!r}: {repeated} more than once (auto is {auto_is})")
    return choices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument(
        "--tag", default=None, help="suffix of the JSON's name (k26_tp<n>_shard[_tiny]_<tag>.json): keeps earlier runs"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny K2 (CPU check of the script); its experts' INT4 groups split at most 4 ways: pass "
        "--model-size 2 or 4",
    )
    parser.add_argument("--model-size", type=int, default=8, help="the TP degree whose one shard is run")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--drafter-layers", type=int, default=6)
    parser.add_argument("--methods", default="ar,chain,ddtree")
    parser.add_argument("--budgets", default="8,16,32,64")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--temperature", type=temperature_argument, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--profile-top", type=int, default=0, help="also profile each step: its N largest ops (device us, launches)"
    )
    parser.add_argument("--hlo-dir", default=None, help="write each step's compiled HLO text here")
    parser.add_argument("--layer-loop", default="auto", help="DecodeOptions.layer_loop")
    parser.add_argument("--moe-impl", default="auto", help="DecodeOptions.moe_impl")
    parser.add_argument(
        "--moe-sort",
        default=None,
        choices=dispatch.MOE_SORTS,
        help="how the routed experts' assignments are sorted by expert (dispatch.MOE_SORTS; default: dispatch.MOE_SORT)",
    )
    parser.add_argument(
        "--router-topk",
        default=None,
        help="how the router picks each token's experts, comma-separated, one row each (dispatch.ROUTER_TOPKS: lax: "
        "lax.top_k, rank: by comparisons; e.g. lax,rank: both on the same weights in one run; default: "
        "dispatch.ROUTER_TOPK)",
    )
    parser.add_argument(
        "--grouped-gather",
        default=None,
        help="where the grouped expert kernel's gate / up rows are put in expert order, comma-separated, one row "
        "each (dispatch.GROUPED_GATHERS: xla gathers them first, xla_apart the same behind an optimization "
        "barrier, kernel reads the tokens through a row index; default: dispatch.GROUPED_GATHER)",
    )
    parser.add_argument(
        "--grouped-int4-decode",
        default=None,
        choices=dispatch.GROUPED_INT4_DECODES,
        help="the grouped INT4 expert kernel below prefill sizes (dispatch.GROUPED_INT4_DECODES: triton, or stream: "
        "the streamed Mosaic GPU kernel; default: dispatch.GROUPED_INT4_DECODE)",
    )
    parser.add_argument(
        "--mla-schedule",
        default=None,
        choices=dispatch.MLA_SCHEDULES,
        help="the Mosaic MLA kernel's schedule (dispatch.MLA_SCHEDULES; default: dispatch.MLA_SCHEDULE)",
    )
    parser.add_argument(
        "--in-place",
        default=None,
        choices=("on", "off"),
        help="pass dispatch.IN_PLACE_PROJECTIONS to the layers stacked, read in place by the skinny kernel "
        "(dispatch.AUTO_IN_PLACE; default: its value)",
    )
    parser.add_argument(
        "--in-place-projections",
        default=None,
        help="name:min_rows,... replacing dispatch.IN_PLACE_PROJECTIONS (e.g. q_a_proj:1,o_proj:9)",
    )
    parser.add_argument(
        "--mla-reduce-rows",
        type=int,
        default=None,
        help="dispatch.MLA_REDUCE_MAX_ROWS: absorbed MLA's W_UK / W_UV products as reductions up to these rows",
    )
    parser.add_argument(
        "--router-bias",
        default="zero",
        choices=ROUTER_BIASES,
        help="the routers' correction bias (random_int4_target): zero spreads a step's rows over the experts as a "
        "trained model does; random (before 2026-12-04) sent every row to nearly the same ~40 experts",
    )
    parser.add_argument(
        "--drafts",
        default="spread",
        choices=DRAFTS,
        help=DRAFTS_HELP,
    )
    parser.add_argument(
        "--mla-merge-up",
        default=None,
        help="whether absorbed MLA applies W_UV in the Mosaic kernel's split merge, comma-separated, one row each "
        "(on, off; e.g. on,off: both on the same weights in one run; default: dispatch.MLA_MERGE_UP)",
    )
    parser.add_argument(
        "--mla-absorb",
        default=None,
        help="whether absorbed MLA takes q_nope . W_UK in `head_projections.absorb`, comma-separated, one row each "
        "(on, off; default: dispatch.MLA_ABSORB)",
    )
    parser.add_argument(
        "--attn-impls", default="auto", help="DecodeOptions.attn_impl values, one row each (e.g. auto,xla)"
    )
    args = parser.parse_args(argv)
    methods, budgets, contexts, batches, attn_impls = _check_args(parser, args)
    # read by the models at trace time (`moe.routed_pallas`, `moe.route`): set per row below; None: as it is
    grouped_gathers = _row_choices(parser, "--grouped-gather", args.grouped_gather, dispatch.GROUPED_GATHERS, "xla")
    if args.moe_sort is not None:  # read by the models at trace time (`moe.sort_by_expert`)
        dispatch.MOE_SORT = args.moe_sort
    router_topks = _row_choices(parser, "--router-topk", args.router_topk, dispatch.ROUTER_TOPKS, "lax")
    merge_ups = _row_choices(parser, "--mla-merge-up", args.mla_merge_up, ("on", "off"), "off")
    absorbs = _row_choices(parser, "--mla-absorb", args.mla_absorb, ("on", "off"), "off")
    if args.grouped_int4_decode is not None:  # read by the models at trace time (`dispatch.grouped_int4_kernel`)
        dispatch.GROUPED_INT4_DECODE = args.grouped_int4_decode
    if args.mla_schedule is not None:  # read by the models at trace time (`attention.sharded_mla_attention`)
        dispatch.MLA_SCHEDULE = args.mla_schedule
    if args.in_place is not None:  # read by the models at trace time (`deepseek_v3._run`)
        dispatch.AUTO_IN_PLACE = args.in_place == "on"
    if args.mla_reduce_rows is not None:  # read by the models at trace time (`deepseek_v3._mla_attend`)
        dispatch.MLA_REDUCE_MAX_ROWS = args.mla_reduce_rows
    if args.in_place_projections is not None:
        pairs = [item.split(":") for item in args.in_place_projections.split(",") if item]
        if any(len(pair) != 2 or not pair[1].isdigit() for pair in pairs):
            raise SystemExit(f"--in-place-projections takes name:min_rows,..., got {args.in_place_projections!r}")
        shapes = deepseek_v3.param_shapes(k26_config(1, args.tiny))
        known = set(shapes["dense_layers"]) | set(shapes["moe_layers"])
        unknown = sorted({name for name, _ in pairs} - known)
        if unknown:
            raise SystemExit(f"--in-place-projections: unknown parameters {unknown}; choose from {sorted(known)}")
        dispatch.IN_PLACE_PROJECTIONS = {name: int(rows) for name, rows in pairs}
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    start = time.perf_counter()
    full, full_drafter, pair = shard_pair(
        args.layers,
        args.drafter_layers,
        args.model_size,
        tiny=args.tiny,
        dtype=dtype,
        router_bias=args.router_bias,
        drafts=args.drafts,
    )
    jax.block_until_ready(pair.target_params)
    init_s = time.perf_counter() - start
    shard = pair.target_config
    print(
        f"device: {device_description()}; commit {args.commit}; shard of TP{args.model_size}: {shard.num_layers} "
        f"layers, {shard.num_heads} heads, FFN {shard.intermediate_size} / experts {shard.moe_intermediate_size} "
        f"columns, vocab {shard.vocab_size}; drafter {pair.drafter.config.num_layers} layers, block "
        f"{pair.drafter.config.block_size}; initialised in {init_s:.0f} s",
        flush=True,
    )
    columns = []
    for method in methods:
        columns += [(method, b) for b in budgets] if method == "ddtree" else [(method, 0)]
    rows = []
    layout = f"tp{args.model_size}"
    for batch in batches:
        for context in contexts:
            settings = itertools.product(columns, attn_impls, grouped_gathers, router_topks, merge_ups, absorbs)
            for (method, budget), attn_impl, grouped_gather, router_topk, merge_up, absorb in settings:
                if grouped_gather is not None:
                    dispatch.GROUPED_GATHER = grouped_gather
                if router_topk is not None:
                    dispatch.ROUTER_TOPK = router_topk
                if merge_up is not None:  # read by the models at trace time (`deepseek_v3._head_kernels`)
                    dispatch.MLA_MERGE_UP = merge_up == "on"
                if absorb is not None:
                    dispatch.MLA_ABSORB = absorb == "on"
                row = bench_case(
                    pair,
                    batch,
                    method,
                    budget,
                    context=context,
                    temperature=args.temperature,
                    top_p=1.0,
                    repeats=args.repeats,
                    step_only=True,
                    options=DecodeOptions(
                        matmul_impl="xla", layer_loop=args.layer_loop, moe_impl=args.moe_impl, attn_impl=attn_impl
                    ),
                    profile_top=args.profile_top,
                    hlo_path=(
                        os.path.join(
                            args.hlo_dir,
                            f"step_B{batch}_ctx{context}_{method}{budget or ''}_{attn_impl}"
                            + (f"_{grouped_gather}" if grouped_gather else "")
                            + (f"_topk_{router_topk}" if router_topk else "")
                            + (f"_merge_up_{merge_up}" if merge_up else "")
                            + (f"_absorb_{absorb}" if absorb else "")
                            + ".hlo.txt",
                        )
                        if args.hlo_dir
                        else None
                    ),
                )
                cost = step_cost(
                    full,
                    drafter=full_drafter if method != "ar" else None,
                    method=method,
                    budget=budget if method == "ddtree" else None,
                    layout=layout,
                    batch=batch,
                    context=context,
                )
                row.update(
                    layers=shard.num_layers,
                    mla_schedule=dispatch.MLA_SCHEDULE,
                    moe_sort=dispatch.MOE_SORT,
                    router_topk=dispatch.ROUTER_TOPK,
                    mla_merge_up=dispatch.MLA_MERGE_UP,
                    mla_absorb=dispatch.MLA_ABSORB,
                    grouped_gather=dispatch.grouped_gather(),
                    grouped_int4_decode=dispatch.GROUPED_INT4_DECODE,
                    in_place=dispatch.AUTO_IN_PLACE,
                    in_place_projections=dict(dispatch.IN_PLACE_PROJECTIONS),
                    mla_reduce_max_rows=dispatch.MLA_REDUCE_MAX_ROWS,
                    router_bias=args.router_bias,
                    drafts=args.drafts,
                    temperature=args.temperature,
                    repeats=args.repeats,
                    init_s=init_s,
                    collectives_ms=cost.collectives_s * 1e3,
                    shard_roofline_ms=max(cost.memory_s, cost.compute_s) * 1e3,
                    predicted_tp_step_ms=row["loop_step_ms"] + cost.collectives_s * 1e3,
                )
                row["x_shard_roofline"] = row["loop_step_ms"] / row["shard_roofline_ms"]
                rows.append(row)
                if args.profile_top:
                    print(format_profile(row["op_kinds"], row["op_profile"], args.profile_top), flush=True)
                    print(format_stages(row["stages"]), flush=True)
                print(
                    f"B={batch} ctx={context} {method:6s} {budget or '':>3} attn {attn_impl:4s} "
                    f"gather {row['grouped_gather']} top-k {row['router_topk']} merge-up {row['mla_merge_up']} absorb {row['mla_absorb']} "
                    f"drafts {row['drafts']}: "
                    f"shard step {row['loop_step_ms']:8.2f} ms "
                    f"in the loop ({row['step_ms']:.2f} called from the host) "
                    f"({row['x_shard_roofline']:.2f}x its roofline {row['shard_roofline_ms']:.2f} ms); + modelled "
                    f"collectives {row['collectives_ms']:.2f} ms = {row['predicted_tp_step_ms']:.2f} ms "
                    f"(compile {row['step_compile_s']:.0f} s)",
                    flush=True,
                )
                write_result(
                    f"k26_tp{args.model_size}_shard"
                    + ("_tiny" if args.tiny else "")
                    + (f"_{args.tag}" if args.tag else ""),
                    {
                        "rows": rows,
                        "model_size": args.model_size,
                        "tiny": args.tiny,
                        "tag": args.tag,
                        "drafter_layers": args.drafter_layers,
                    },
                    args.commit,
                )
    header = [
        "B",
        "context",
        "method",
        "budget",
        "attention",
        "grouped gather",
        "router top-k",
        "W_UV in merge",
        "W_UK kernel",
        "drafts",
        "shard step ms (loop)",
        "called from host ms",
        "shard roofline ms",
        "x roofline",
        "collectives ms",
    ]
    table = [
        [
            r["B"],
            r["context"],
            r["method"],
            r["budget"] or "",
            r["attn_impl"],
            r["grouped_gather"],
            r["router_topk"],
            "on" if r.get("mla_merge_up") else "off",
            "on" if r.get("mla_absorb") else "off",
            r["drafts"],
            f"{r['loop_step_ms']:.3f}",
            f"{r['step_ms']:.3f}",
            f"{r['shard_roofline_ms']:.3f}",
            f"{r['x_shard_roofline']:.2f}",
            r["collectives_ms"],
        ]
        for r in rows
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
