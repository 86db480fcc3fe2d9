"""How many distinct routed experts a multi-row step reads on the K2.6 benchmark model, per router bias.

The shard benchmarks (`experiments/tp_shard_step.py`, `benchmarks/bench_model_parts.py`) run random weights; a
step's cost for the chain and the trees depends on how many distinct experts its rows route to. This builds the
TP shard (`analysis.tp_shard.tp_shard_config`, default TP8) of a few K2.6 layers with
`benchmarks.k26_model.random_int4_target` under each router bias, runs a forward over a random sequence and counts,
per MoE layer, the distinct experts of its last `--rows` rows (`k26_model.routing_spread`), beside the count that
uniform draws of the same assignments would give (expected value). Runs on CPU (~1 min a bias at 4 layers).

Usage: python -m experiments.routing_spread [--layers 4] [--rows 17] [--tokens 48] [--model-size 8]
       [--tiny --model-size 2|4] (the tiny K2's experts split at most 4 ways)
JSON: $OUT/routing_spread.json (else experiments/results/).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.k26_model import (
    ROUTER_BIASES,
    TINY_SIZES,
    int4_split_problem,
    k26_config,
    random_int4_target,
    routing_spread,
)
from ddtree_jax.analysis.tp_shard import tp_shard_config


def uniform_distinct(experts: int, assignments: int) -> float:
    """Expected distinct values among `assignments` uniform draws from `experts` (with replacement)."""
    return experts * (1 - (1 - 1 / experts) ** assignments)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=17, help="the step's rows (17: DDTree 16's tree)")
    parser.add_argument("--tokens", type=int, default=48, help="the sequence the forward runs (rows at its end)")
    parser.add_argument("--model-size", type=int, default=8, help="the TP degree whose one shard is built")
    parser.add_argument("--tiny", action="store_true", help="the tiny K2 (a CPU check of the script)")
    parser.add_argument("--out", default=os.environ.get("OUT", "experiments/results"))
    args = parser.parse_args(argv)
    for name in ("layers", "tokens", "model_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not 1 <= args.rows <= args.tokens:
        parser.error(f"--rows {args.rows}: must be in 1 .. --tokens ({args.tokens}), the step's rows at its end")
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: the first layer is dense; at least 2 give a MoE layer")
    try:
        config = tp_shard_config(k26_config(args.layers, args.tiny), args.model_size)
    except ValueError as e:
        parser.error(f"--model-size {args.model_size}: {e}" + (TINY_SIZES if args.tiny else ""))
    problem = int4_split_problem(config)
    if problem:
        parser.error(f"--model-size {args.model_size}: {problem}" + (TINY_SIZES if args.tiny else ""))
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    rows = []
    for bias in ROUTER_BIASES:
        params = jax.jit(lambda k, bias=bias: random_int4_target(config, k, dtype, bias))(jax.random.key(0))
        for layer, (distinct, assignments) in enumerate(routing_spread(config, params, args.tokens, args.rows)):
            rows.append(
                {
                    "router_bias": bias,
                    "moe_layer": layer,
                    "distinct_experts": distinct,
                    "assignments": assignments,
                    "uniform_expected": uniform_distinct(config.n_routed_experts, assignments),
                }
            )
            print(
                f"router bias {bias:6s} MoE layer {layer}: {distinct} distinct experts of {assignments} assignments "
                f"(uniform draws: {rows[-1]['uniform_expected']:.1f})",
                flush=True,
            )
        del params
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "routing_spread.json")
    with open(path, "w") as f:
        json.dump({"layers": args.layers, "rows": args.rows, "tokens": args.tokens, "results": rows}, f, indent=1)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
