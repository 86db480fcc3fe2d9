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

`--loop` profiles the whole generation instead (`engine.generate`, its on-device while_loop, as the
end-to-end benchmark runs it) and reads the trace as a timeline (`op_profile.timeline_gaps`): per decode
step the span, the device's busy and idle time and the launches, and the idle gaps grouped by the ops on
either side. A step called from the host pays ~1.4 ms of dispatch, so the single-step mode reports device
time only; inside the loop the idle time is real and belongs to the step (the predicate read back each
iteration, work outside any CUDA graph). Each op is also attributed to its decode-step stage (the
`ddtree_<stage>` named scopes of `engine.step`, read from the optimized HLO's op_name metadata); with
command buffers on, a CUDA graph is one op, so run with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` for the
per-stage table (a per-kernel launch then adds its own gaps: read device time, not span).

    PYTHONPATH=.:kernels python -m benchmarks.step_ops --methods ar chain ddtree --budgets 16 64 \\
        --temperature 0 --out $OUT --commit $(git rev-parse --short HEAD)
    PYTHONPATH=.:kernels python -m benchmarks.step_ops --loop --max-new 128 ...
    PYTHONPATH=.:kernels python -m benchmarks.step_ops --shape qwen3-8b --methods ar ddtree ...  # random weights
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_e2e import PROMPTS, load_prompt_ids
from benchmarks.common import write_result
from benchmarks.op_profile import (
    device_timeline,
    format_op_table,
    format_stages,
    op_stages,
    op_times,
    stage_table,
    timeline_gaps,
)
from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.profile import warm_step
from ddtree_jax.engine.run import (
    DTYPE_CHOICES,
    generate_static,
    load_dtype,
    load_pair,
    pair_dtype,
    request_args,
    resolve_block_size,
)
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


def profile_loop(
    pair, prompt_ids, *, method: str, budget: int, runs: int, options: DecodeOptions, hlo_path=None, **request
):
    """The whole generation's timeline per decode step: {"steps", "span_us", "busy_us", "idle_us",
    "launches", "gaps", "ops"} (per-step means over `runs` generations; span, busy, idle and launches net of
    the same program at max_new = 1, the prefill; gaps and ops include it; module docstring)."""
    block = resolve_block_size(pair, method, None)
    args = request_args(pair, [prompt_ids], **request)
    static = generate_static(
        pair, method=method, budget=budget, block_size=block, max_new_tokens=request["max_new_tokens"], options=options
    )
    compiled = generate.lower(*args, **static).compile()
    hlo_text = compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(hlo_text)
    run_args = args[1:]
    result = compiled(*run_args)
    steps = int(np.asarray(result.steps)[0])
    events = device_timeline(compiled, *run_args, runs=runs)
    # one generation's events are contiguous; the gaps between the runs (host calls) are left out
    summary = timeline_gaps(events, min_gap_ns=1000, max_gap_ns=5_000_000)
    # the same program at max_new = 1 (prefill and first token, no decode step), subtracted
    prefill_args = run_args[:-1] + (jnp.ones_like(run_args[-1]),)
    prefill = timeline_gaps(device_timeline(compiled, *prefill_args, runs=runs), max_gap_ns=5_000_000)
    for key in ("span_ns", "busy_ns", "idle_ns", "events"):
        summary[key] -= prefill[key]
    per = 1e-3 / (runs * max(steps, 1))
    stage_map = op_stages(hlo_text)
    totals, counts = {}, {}
    for e in events:
        totals[e["op"]] = totals.get(e["op"], 0) + e["duration_ns"]
        counts[e["op"]] = counts.get(e["op"], 0) + 1
    ops = sorted(
        (
            {"op": op, "us_per_run": t * per, "events_per_run": counts[op] / (runs * max(steps, 1))}
            for op, t in totals.items()
        ),
        key=lambda r: -r["us_per_run"],
    )
    return {
        "steps": steps,
        "span_us": summary["span_ns"] * per,
        "busy_us": summary["busy_ns"] * per,
        "idle_us": summary["idle_ns"] * per,
        "launches": summary["events"] / (runs * max(steps, 1)),
        "gaps": [
            {**g, "us_per_step": g["total_ns"] * per, "per_step": g["count"] / (runs * max(steps, 1))}
            for g in summary["gaps"][:30]
        ],
        "ops": [{**row, "stage": stage_map.get(row["op"], "other")} for row in ops],
        "stages": stage_table(ops, stage_map),
    }


def format_gaps(gaps: list[dict], top: int) -> str:
    lines = ["  idle gaps >= 1 us, by the ops on either side (us per step, count per step):"]
    for g in gaps[:top]:
        lines.append(f"  {g['us_per_step']:9.1f} us  x{g['per_step']:<5.1f} {g['before'][:45]} -> {g['after'][:45]}")
    return "\n".join(lines)


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
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="weights and KV caches (default auto: on GPU bf16)"
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="a random-weight pair of this `bench_engine` shape (e.g. qwen3-8b, bf16) and a random prompt of "
        "--prompt-len tokens, instead of --target / --drafter / --prompts",
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="with --shape: the random prompt's length")
    parser.add_argument("--loop", action="store_true", help="profile the whole generation (its while_loop)")
    parser.add_argument("--hlo-dir", default=None, help="with --loop: write each program's optimized HLO here")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args(argv)

    if args.shape:
        from benchmarks.bench_engine import SHAPES, random_pair

        if args.shape not in SHAPES:
            raise SystemExit(f"error: --shape {args.shape!r} is not one of {sorted(SHAPES)}")
        pair = random_pair(args.shape, jnp.float32 if args.shape == "tiny" else jnp.bfloat16)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, pair.target_config.vocab_size - 1, args.prompt_len).tolist()
    else:
        pair = load_pair(args.target, args.drafter, load_dtype(args.dtype))
        prompt = load_prompt_ids(args.prompts)[0]
    request = dict(max_new_tokens=args.max_new, temperature=args.temperature, top_p=args.top_p)
    results = []
    for method in args.methods:
        for budget in args.budgets if method == "ddtree" else [0]:
            label = f"{method}" + (f" {budget}" if method == "ddtree" else "")
            if args.loop:
                hlo_path = None
                if args.hlo_dir:
                    os.makedirs(args.hlo_dir, exist_ok=True)
                    hlo_path = os.path.join(args.hlo_dir, f"generate_{label.replace(' ', '_')}.hlo.txt")
                res = profile_loop(
                    pair,
                    prompt,
                    method=method,
                    budget=max(budget, 1),
                    runs=args.runs,
                    options=DecodeOptions(),
                    hlo_path=hlo_path,
                    **request,
                )
                print(
                    f"\n{label}: {res['steps']} steps; per step: span {res['span_us']:.1f} us, busy "
                    f"{res['busy_us']:.1f} us, idle {res['idle_us']:.1f} us, {res['launches']:.1f} launches"
                )
                print(format_stages(res["stages"]))
                print(format_gaps(res["gaps"], args.top))
                print(format_op_table(res["ops"], top=args.top))
                results.append({"method": method, "budget": budget or None, **res})
                continue
            res = profile_step(
                pair, prompt, method=method, budget=max(budget, 1), runs=args.runs, options=DecodeOptions(), **request
            )
            print(
                f"\n{label}: {res['launches']:.0f} launches/step, device {res['device_us']:.1f} us, "
                f"wall {res['wall_us']:.1f} us, gaps {res['wall_us'] - res['device_us']:.1f} us"
            )
            print(format_op_table(res["ops"], top=args.top))
            results.append({"method": method, "budget": budget or None, **res, "ops": res["ops"][:40]})
    if args.out or os.environ.get("OUT"):  # --out, else $OUT (as every benchmark); neither: the table only
        path = write_result(
            f"step_{'loop' if args.loop else 'ops'}_T{args.temperature:g}_{args.commit}",
            {"settings": {**vars(args), "weights_dtype": jnp.dtype(pair_dtype(pair)).name}, "results": results},
            args.commit,
            args.out,
        )
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
