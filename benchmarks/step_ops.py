"""Kernels launched per decode step and the device time of each: where a fused step's time goes.

For each method (AR, the DFlash chain, DDTree at each budget) this compiles the fused decode step as
`generate` runs it (`engine.profile.warm_step`: prefill, then warm-up steps so the drafter has context to
append), profiles `runs` steps with `benchmarks.op_profile.op_times`, and reports per step:

  launches     device events (kernels, copies, memsets) per step: the launch count the step pays
  device us    their summed device time
  wall us      the step's wall-clock median (the same compiled step, `block_until_ready` each)
  gaps us      wall - device: launch latency and idle time between kernels
  top ops      the largest ops with their share, grouped by stage where the op name says it

The state advances every repetition (each run feeds the previous step's output), so no loop-invariant
work is hoisted and every step is a real one.

    PYTHONPATH=.:kernels python -m benchmarks.step_ops --methods ar chain ddtree --budgets 16 64 \\
        --temperature 0 --out $OUT --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.bench_e2e import PROMPTS, load_prompt_ids
from benchmarks.common import write_result
from benchmarks.op_profile import format_op_table, op_times
from ddtree_jax.engine.profile import warm_step
from ddtree_jax.engine.run import load_pair
from ddtree_jax.options import DecodeOptions


def profile_step(pair, prompt_ids, *, method: str, budget: int, runs: int, options: DecodeOptions, **request):
    """{"launches", "device_us", "wall_us", "ops"} of one fused decode step (module docstring)."""
    step, args, _ = warm_step(pair, prompt_ids, method=method, budget=budget, options=options, **request)
    params, drafter, state, sampling, keys, stop, max_new = args

    current = [state]

    def advancing():  # each call runs the next real step from the last one's state
        current[0] = step(params, drafter, current[0], sampling, keys, stop, max_new)
        return current[0]

    rows = op_times(advancing, runs=runs)
    walls = []
    for _ in range(max(runs, 5)):
        start = time.perf_counter()
        jax.block_until_ready(advancing())
        walls.append(time.perf_counter() - start)
    launches = sum(r["events_per_run"] for r in rows)
    device_us = sum(r["us_per_run"] for r in rows)
    return {
        "launches": launches,
        "device_us": device_us,
        "wall_us": float(np.median(walls)) * 1e6,
        "ops": rows,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="checkpoints/embedded/target")
    parser.add_argument("--drafter", default="checkpoints/embedded/drafter")
    parser.add_argument("--prompts", default=PROMPTS)
    parser.add_argument("--methods", nargs="+", default=["ar", "chain", "ddtree"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[64])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args(argv)

    pair = load_pair(args.target, args.drafter)
    prompt = load_prompt_ids(args.prompts)[0]
    request = dict(max_new_tokens=args.max_new, temperature=args.temperature, top_p=args.top_p)
    results = []
    for method in args.methods:
        for budget in args.budgets if method == "ddtree" else [0]:
            res = profile_step(
                pair, prompt, method=method, budget=max(budget, 1), runs=args.runs, options=DecodeOptions(), **request
            )
            label = f"{method}" + (f" {budget}" if method == "ddtree" else "")
            print(
                f"\n{label}: {res['launches']:.0f} launches/step, device {res['device_us']:.1f} us, "
                f"wall {res['wall_us']:.1f} us, gaps {res['wall_us'] - res['device_us']:.1f} us"
            )
            print(format_op_table(res["ops"], top=args.top))
            results.append({"method": method, "budget": budget or None, **res, "ops": res["ops"][:40]})
    if args.out:
        path = write_result(
            f"step_ops_T{args.temperature:g}_{args.commit}",
            {"settings": vars(args), "results": results},
            args.commit,
            args.out,
        )
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
