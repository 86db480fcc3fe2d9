"""Sharded decode steps of a K2.6-width target: AR and DDTree step times, per-layer time, TP vs EP.

Builds a random-initialised DeepSeek-V3 / Kimi K2.6-width model (hidden 7168, MLA 64 heads, 384 routed
experts with INT4 pack-quantized weights, FFN 2048; `--layers` decoder layers, the first dense) and a
Kimi-DFlash-shaped drafter (`--drafter-layers`), each parameter initialised directly into its shard
(jit with out_shardings: no host copy of the weights), on a (data, model) mesh of the local devices
under the TP or EP rule table (`ddtree_jax.sharding.rules`). For each layout and method (AR; DDTree at
each budget) it times the fused decode step, the drafter forward and the target's verify forward
(`benchmarks.bench_engine.bench_case`). Running two depths (`--layers 2,4`) gives the per-layer time as
the slope, from which a 61-layer step is extrapolated; `python -m ddtree_jax.analysis.roofline` gives the
model to compare with.

The parameters are Auto-sharded: XLA partitions the dense computation between the pinned shardings.
Under EP the routed experts run in the "ep" shard_map region (models/moe.py: each device's 48 experts on
the tokens it already holds, a psum over "model"); `--attn-impl pallas` runs the tree-attention kernel
per shard (batch over "data", heads over "model", `sharding.regions`).

Usage (2 GPUs): python -m experiments.sharded_run --model 2 --layers 2,4 --budgets 8,16,32,64 --commit C
       (4 CPU devices, tiny): XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.sharded_run --tiny
The tiny model's routed experts have 128 columns, 4 INT4 groups of 32: under the TP layout the model axis must
divide 4 (on 8 devices pass --model 4 or --model 2; 8-way TP is refused up front), EP splits its 16 experts
(and 8 heads: 3- or 6-way EP is refused up front too, naming the array that does not divide).
--model defaults to all local devices / --data; it must be at least 1 when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_engine import bench_case
from benchmarks.common import device_description, int_list_argument, temperature_argument, write_result
from benchmarks.k26_model import DRAFTS, DRAFTS_HELP, drafter_class, k26_config, random_int4_target
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig
from ddtree_jax.engine.run import Pair
from ddtree_jax.models import deepseek_v3, dflash
from ddtree_jax.options import DecodeOptions
from ddtree_jax.presets import preset
from ddtree_jax.sharding import make_mesh, param_shardings
from ddtree_kernels.quant import INT4_GROUP


def drafter_config(config: DeepSeekV3Config, layers: int, tiny: bool = False) -> DFlashConfig:
    """The Kimi-K2.5-DFlash-shaped drafter with `layers` layers on `config`'s taps (tiny: the
    `kimi-k2-mesh-tiny-dflash` preset). The full one keeps the rope fields these runs have always used:
    YaRN without the preset's mscale / mscale_all_dim of 1.0 (random weights: the step costs the same)."""
    if tiny:
        return dataclasses.replace(
            preset("kimi-k2-mesh-tiny-dflash"), num_layers=layers, target_layers=config.tapped_layers
        )
    return dataclasses.replace(
        preset("kimi-k2.5-dflash"),
        num_layers=layers,
        target_layers=config.tapped_layers,
        rope_mscale=0.0,
        rope_mscale_all_dim=0.0,
    )


def pair_shardings(config, dconfig, mesh, layout: str, dtype, key) -> tuple:
    """(target, drafter) parameter shardings under `layout`, from the initialisers' shapes (jax.eval_shape:
    nothing is built). ValueError naming the first array whose sharded dimension does not divide the mesh axis
    (`sharding.rules.param_shardings`): e.g. the heads' columns or the experts over a 3- or 6-way "model" axis."""
    shapes = jax.eval_shape(lambda k: random_int4_target(config, k, dtype), key)
    dshapes = jax.eval_shape(lambda k: dflash.init_params(dconfig, config.hidden_size, k, dtype), key)
    shardings = []
    for name, tree, axes in (
        ("target", shapes, deepseek_v3.param_axes(config)),
        ("drafter", dshapes, dflash.param_axes(dconfig, config.hidden_size)),
    ):
        try:
            shardings.append(param_shardings(tree, axes, mesh, layout))
        except ValueError as e:
            raise ValueError(f"the {name}'s {e}") from e
    return tuple(shardings)


def sharded_pair(config, dconfig, mesh, layout: str, dtype, seed: int = 0, drafts: str = "spread") -> Pair:
    """The random K2-shaped pair on `mesh` under `layout`'s rule table; drafts: "spread" (`SpreadDraftsDrafter`:
    each depth its own random distribution, as a trained drafter's positions have) or "model" (the random drafter's
    own drafts, one token repeated along the chain: every run before 1031e46)."""
    drafter_type = drafter_class(drafts)  # checked before any weight is made
    key = jax.random.key(seed)
    dkey = jax.random.fold_in(key, 1)
    target_shardings, drafter_shardings = pair_shardings(config, dconfig, mesh, layout, dtype, key)
    target_params = jax.jit(lambda k: random_int4_target(config, k, dtype), out_shardings=target_shardings)(key)
    drafter_params = jax.jit(
        lambda k: dflash.init_params(dconfig, config.hidden_size, k, dtype), out_shardings=drafter_shardings
    )(dkey)
    drafter = drafter_type(
        dconfig, drafter_params, deepseek_v3.embedding(target_params), deepseek_v3.head(config, target_params)
    )
    return Pair(config, target_params, drafter)


# the routed experts' dispatch per layout: TP takes "auto" (`dispatch.moe_impl`: on GPU the in-place decode kernels
# or the grouped kernel in a TP region, each device reading its column slice of the chosen experts; on CPU gather /
# dense under the XLA partitioner); EP runs the "ep" shard_map region (models/moe.py)
MOE_IMPL = {"tp": "auto", "ep": "ep"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--tiny", action="store_true", help="a tiny K2-shaped model (CPU check of the script)")
    parser.add_argument("--model", type=int, default=None, help="model-axis size (default: all local devices)")
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--layouts", default="tp,ep")
    parser.add_argument("--layers", default="2,4", help="target depths; the per-layer time is the slope")
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--budgets", default="8,16,32,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--temperature", type=temperature_argument, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attn-impl", default="xla", choices=["xla", "pallas"])
    parser.add_argument(
        "--drafts",
        default="spread",
        choices=DRAFTS,
        help=DRAFTS_HELP,
    )
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="time the fused step alone (one compilation per case instead of four); the per-layer "
        "time is then the slope of the step time",
    )
    args = parser.parse_args(argv)
    # every argument is checked here, before any model is built or compiled
    for name in ("model", "data", "drafter_layers", "context", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    layouts = args.layouts.split(",")
    if any(layout not in MOE_IMPL for layout in layouts) or len(set(layouts)) != len(layouts):
        parser.error(f"--layouts {args.layouts!r}: expected distinct entries of {', '.join(MOE_IMPL)}")
    depths = int_list_argument(parser, "layers", args.layers)
    budgets = int_list_argument(parser, "budgets", args.budgets)
    model = args.model if args.model is not None else jax.device_count() // args.data
    if model < 1 or model * args.data > jax.device_count():
        parser.error(
            f"a data={args.data} x model={model} mesh needs {args.data * model} devices, {jax.device_count()} "
            "available (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    groups = k26_config(1, args.tiny).moe_intermediate_size // INT4_GROUP
    if "tp" in layouts and groups % model:
        parser.error(
            f"--model {model}: under the tp layout the routed experts' {groups} INT4 groups of {INT4_GROUP} "
            f"columns do not split {model} ways; use a model axis dividing {groups}"
            + (" (e.g. --model 4) or --layouts ep" if args.tiny else "")
        )
    mesh = make_mesh(model=model, data=args.data)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    for layout in layouts:  # every sharded dimension (heads, experts, vocabulary, FFN columns) must divide --model
        config = k26_config(min(depths), args.tiny)  # the layer axis is never split: one depth stands for all
        drafter = drafter_config(config, args.drafter_layers, args.tiny)
        try:
            pair_shardings(config, drafter, mesh, layout, dtype, jax.random.key(0))
        except ValueError as e:
            parser.error(f"--model {model} under the {layout} layout: {e}")
    print(f"device: {device_description()}; mesh data={args.data} x model={model}; commit {args.commit}", flush=True)
    rows = []
    for layout in layouts:
        for layers in depths:
            config = k26_config(layers, args.tiny)
            pair = None  # drop the previous model first: two deep ones do not fit side by side
            start = time.perf_counter()
            pair = sharded_pair(
                config,
                drafter_config(config, args.drafter_layers, args.tiny),
                mesh,
                layout,
                dtype,
                drafts=args.drafts,
            )
            jax.block_until_ready(pair.target_params)
            init_s = time.perf_counter() - start
            with jax.set_mesh(mesh):
                for method, budget in [("ar", 0)] + [("ddtree", b) for b in budgets]:
                    row = bench_case(
                        pair,
                        1,
                        method,
                        budget,
                        context=args.context,
                        temperature=args.temperature,
                        top_p=1.0,
                        repeats=args.repeats,
                        step_only=args.step_only,
                        options=DecodeOptions(attn_impl=args.attn_impl, matmul_impl="xla", moe_impl=MOE_IMPL[layout]),
                    )
                    row.update(
                        layout=layout,
                        layers=layers,
                        init_s=init_s,
                        mesh=[args.data, model],
                        drafts=args.drafts,
                        temperature=args.temperature,
                        repeats=args.repeats,
                    )
                    rows.append(row)
                    parts = (
                        ""
                        if args.step_only
                        else (f"  tree fwd {row['tree_forward_ms']:8.2f} ms  draft {row['draft_ms']:7.2f} ms")
                    )
                    print(
                        f"{layout} layers={layers} {method:6s} budget={budget:3d}: step {row['step_ms']:8.2f} ms{parts}"
                        f"  (compile {row['step_compile_s']:.0f} s)",
                        flush=True,
                    )
                    write_result("sharded_run" + ("_tiny" if args.tiny else ""), {"rows": rows}, args.commit)
    if len(depths) >= 2:  # per-layer slope and a 61-layer extrapolation per (layout, method, budget)
        timed = "step_ms" if args.step_only else "tree_forward_ms"
        print(f"\nper-layer time (slope of {timed} between depths) and the 61-layer extrapolation:")
        lo, hi = min(depths), max(depths)
        for layout in layouts:
            for method, budget in [("ar", 0)] + [("ddtree", b) for b in budgets]:
                pick = {
                    r["layers"]: r
                    for r in rows
                    if r["layout"] == layout and r["method"] == method and (r["budget"] or 0) == budget
                }
                per_layer = (pick[hi][timed] - pick[lo][timed]) / (hi - lo)
                rest = pick[lo]["step_ms"] - lo * per_layer
                print(
                    f"  {layout} {method:6s} budget={budget:3d}: {per_layer:7.3f} ms / layer; 61 layers -> "
                    f"{rest + 61 * per_layer:8.2f} ms per step"
                )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
