"""Speed projection: this pair's measured tau per budget x a Qwen3-8B-shaped step time -> predicted tokens/s.

The embedded pair is too small for its own step times to mean anything; its acceptance behaviour is what
transfers. This combines the budget sweep's tau (`experiments/budget_sweep.py` JSON: the pooled tau, all
tokens / all decode steps, per method (--tau mean: the mean of per-generation taus instead),
budget and temperature) with the decode-step time of a Qwen3-8B target + Qwen3-8B-DFlash-b16 drafter
(block 16, like the embedded drafter) at the same method and budget, from, in order:

1. `--bench FILE`, or else the newest (by the date recorded inside, ties by file name)
   `benchmarks/results/engine_qwen3-8b*.json` / `benchmarks/results_archive/engine_qwen3-8b*.json` (`benchmarks/bench_engine.py`: rows with B, method,
   budget, step_ms, measured on the H200 at its --temperature; the fastest row per (B, method, budget) over
   implementations; the same step time serves every temperature of the sweep);
2. else the roofline model `ddtree_jax.analysis.roofline` (`step_cost` of the `qwen3-8b` preset pair on one
   H200: bytes and FLOPs, no overhead unless --overhead-us; an optimistic bound).

Budgets the benchmark did not measure are interpolated linearly in the verified slot count N = budget + 1
between measured budgets (marked "interpolated"); outside the measured range they take the roofline's
ratio to the nearest measured budget when the roofline exists ("roofline-scaled"), else they are left
out. Per temperature and column: tau, step ms, tokens/s per row = tau / step, aggregate tokens/s
(x B), speedup over AR (AR: tau = 1, its own step) and over the DFlash chain (its tau and step), and the
best budget (highest tokens/s).

  python -m experiments.speed_projection [--sweep outputs/budget_sweep.json] [--bench F.json | --roofline] [--batch 1]

Without --sweep: the newest committed experiments/results/budget_sweep*.json (by the date recorded inside).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys

from experiments.studies import REPO, write_json

BENCH_GLOBS = ("benchmarks/results/engine_qwen3-8b*.json", "benchmarks/results_archive/engine_qwen3-8b*.json")


class NoStepTimes(RuntimeError):
    """Neither a bench_engine JSON nor the roofline model is available."""


SWEEP_GLOB = "experiments/results/budget_sweep*.json"  # the committed budget sweeps


def _recorded(path: str) -> tuple[str, str]:
    """(the recorded date, the commit) of a result JSON (benchmarks/common.py write_result,
    experiments.studies write_json: top-level "date" (ISO 8601, UTC) and "commit"); ("", "") when unreadable or
    absent, so such files sort oldest. The file's modification time is never used: a fresh clone makes it arbitrary."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return "", ""
    if not isinstance(data, dict):
        return "", ""
    date = data.get("date")
    if isinstance(date, str):
        try:
            date = datetime.datetime.fromisoformat(date)
            if date.tzinfo is None:
                date = date.replace(tzinfo=datetime.UTC)
            date = date.astimezone(datetime.UTC).isoformat()
        except ValueError:
            date = ""
    else:
        date = ""
    return date, str(data.get("commit") or "")


def newest_recorded(paths, usable=None) -> str | None:
    """The path whose recorded date is the newest; ties (the same date, or none recorded) go to the file name
    that sorts last, so the choice does not depend on the file system. usable(path) -> bool, when given, skips
    the paths it rejects (e.g. a benchmark without the AR row the projection needs)."""
    paths = [p for p in paths if usable is None or usable(p)]
    if not paths:
        return None
    return max(paths, key=lambda p: (_recorded(p)[0], os.path.basename(p), p))


def has_step_times(path: str, batch: int = 1) -> bool:
    """Whether a bench_engine JSON has what the projection needs at `batch`: a timed AR row (the baseline) and
    at least one timed DDTree row (a profile of one method alone has not)."""
    try:
        with open(path) as f:
            data = json.load(f)
        rows = data.get("rows", []) if isinstance(data, dict) else []
        methods = {
            r.get("method")
            for r in rows
            if isinstance(r, dict) and int(r.get("B", 0)) == batch and r.get("step_ms") is not None
        }
    except (OSError, ValueError, TypeError):
        return False
    return {"ar", "ddtree"} <= methods


def find_bench_json(root: str | None = None, batch: int = 1) -> str | None:
    """The newest Qwen3-8B engine benchmark result with AR and DDTree step times at `batch` (`has_step_times`),
    by the date recorded in it (`newest_recorded`), or None."""
    root = REPO if root is None else root
    return newest_recorded(
        (p for g in BENCH_GLOBS for p in glob.glob(os.path.join(root, g))), usable=lambda p: has_step_times(p, batch)
    )


def find_sweep_json(root: str | None = None) -> str | None:
    """The newest committed budget sweep (experiments/results/budget_sweep*.json) by its recorded date, or None."""
    root = REPO if root is None else root
    return newest_recorded(glob.glob(os.path.join(root, SWEEP_GLOB)))


def step_times_from_bench(path: str, batch: int = 1) -> dict:
    """{(method, budget or None): step seconds} of one batch size from a bench_engine JSON (the fastest row per
    (method, budget) over attention / matmul implementations), with the source's description."""
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data.get("rows", []) if int(r.get("B", 0)) == batch and r.get("step_ms") is not None]
    if not rows:
        have = sorted({r.get("B") for r in data.get("rows", [])})
        raise NoStepTimes(f"{path} has no rows at batch {batch} (batches: {have})")
    times: dict = {}
    for r in rows:
        key = (r["method"], int(r["budget"]) if r["method"] == "ddtree" else None)
        times[key] = min(times.get(key, float("inf")), float(r["step_ms"]) / 1e3)
    return {
        "times": times,
        "source": "bench_engine",
        "path": os.path.relpath(path, REPO) if path.startswith(REPO) else path,
        "device": data.get("device"),
        "commit": data.get("commit"),
        "date": data.get("date"),
        "batch": batch,
        "context": rows[0].get("context"),
    }


def roofline_available() -> bool:
    try:
        from ddtree_jax.analysis import roofline  # noqa: F401
        from ddtree_jax.presets import preset_pair  # noqa: F401
    except ImportError:
        return False
    return True


def roofline_step(
    method: str, budget: int | None, *, batch: int = 1, context: int = 2048, overhead_s: float = 0.0
) -> float:
    """Roofline seconds of one decode step of the Qwen3-8B pair on one H200 (`ddtree_jax.analysis.roofline.step_cost`)."""
    try:
        from ddtree_jax.analysis import roofline
        from ddtree_jax.presets import preset_pair
    except ImportError as e:
        raise NoStepTimes(f"no step times: no benchmarks/bench_engine.py result and no roofline model ({e})") from e
    target, drafter = preset_pair("qwen3-8b")
    return roofline.step_cost(
        target,
        drafter=drafter,
        method=method,
        budget=budget if method == "ddtree" else None,
        layout="single",
        batch=batch,
        context=context,
        overhead_s=overhead_s,
    ).step_s


def step_times_from_roofline(budgets, *, batch: int = 1, context: int = 2048, overhead_s: float = 0.0) -> dict:
    times = {
        ("ar", None): roofline_step("ar", None, batch=batch, context=context, overhead_s=overhead_s),
        ("chain", None): roofline_step("chain", None, batch=batch, context=context, overhead_s=overhead_s),
    }
    for b in budgets:
        times[("ddtree", int(b))] = roofline_step("ddtree", int(b), batch=batch, context=context, overhead_s=overhead_s)
    return {
        "times": times,
        "source": "roofline",
        "model": "qwen3-8b + qwen3-8b-dflash-b16, one H200 (ddtree_jax.analysis.roofline)",
        "batch": batch,
        "context": context,
        "overhead_s": overhead_s,
    }


def ddtree_step(times: dict, budget: int, *, roofline_fn=None) -> tuple[float | None, str]:
    """(seconds, how) of a DDTree step at `budget` from measured budgets: measured, interpolated linearly in
    N = budget + 1, roofline-scaled outside the measured range (when `roofline_fn(budget)` is given), or
    (None, "not measured")."""
    measured = sorted(b for (m, b) in times if m == "ddtree")
    if budget in measured:
        return times[("ddtree", budget)], "measured"
    if not measured:
        return None, "not measured"
    lower = [b for b in measured if b < budget]
    upper = [b for b in measured if b > budget]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
        w = ((budget + 1) - (lo + 1)) / ((hi + 1) - (lo + 1))
        return (1 - w) * times[("ddtree", lo)] + w * times[("ddtree", hi)], "interpolated"
    if roofline_fn is None:
        return None, "not measured"
    near = lower[-1] if lower else upper[0]
    return times[("ddtree", near)] * roofline_fn(budget) / roofline_fn(near), "roofline-scaled"


TAU_KINDS = ("pooled", "mean")


def project(sweep: dict, step_source: dict, *, roofline_fn=None, tau_kind: str = "pooled") -> dict:
    """Rows per (temperature, column) and the best budget per temperature (module docstring).

    tau_kind: "pooled" (all tokens / all decode steps of the column: what a workload's throughput is,
    total tokens over total step time) or "mean" (the mean over generations of each one's tau, which a
    few long, repetitive generations with very high tau can dominate)."""
    if tau_kind not in TAU_KINDS:
        raise ValueError(f"tau_kind must be one of {TAU_KINDS}, got {tau_kind!r}")
    key = f"{tau_kind}_tau"
    times, batch = step_source["times"], step_source.get("batch", 1)
    if ("ar", None) not in times:
        where = f" {step_source['path']}" if step_source.get("path") else ""
        raise NoStepTimes(f"the step times ({step_source['source']}{where}) have no AR row at batch {batch}")
    ar_s = times[("ar", None)]
    rows, best = [], {}
    for temperature in sorted({r["temperature"] for r in sweep["rows"]}):
        at_t = [r for r in sweep["rows"] if r["temperature"] == temperature]
        chain = next((r for r in at_t if r["method"] == "chain"), None)
        chain_tps = None
        if chain is not None and ("chain", None) in times:
            chain_tps = chain[key] / times[("chain", None)]
        rows.append(
            {
                "temperature": temperature,
                "method": "ar",
                "budget": None,
                "tau": 1.0,
                "step_ms": ar_s * 1e3,
                "step_source": "measured" if step_source["source"] == "bench_engine" else "roofline",
                "tokens_per_s": 1.0 / ar_s,
                "aggregate_tokens_per_s": batch / ar_s,
                "speedup_vs_ar": 1.0,
                "speedup_vs_chain": None if chain_tps is None else (1.0 / ar_s) / chain_tps,
            }
        )
        for r in sorted(at_t, key=lambda r: (r["method"] != "chain", r["budget"] or 0)):
            if r["method"] == "chain":
                step, how = times.get(("chain", None)), "measured" if ("chain", None) in times else "not measured"
            else:
                step, how = ddtree_step(times, r["budget"], roofline_fn=roofline_fn)
            if step_source["source"] == "roofline" and step is not None:
                how = "roofline"
            tps = None if step is None else r[key] / step
            rows.append(
                {
                    "temperature": temperature,
                    "method": r["method"],
                    "budget": r["budget"],
                    "tau": r[key],
                    "step_ms": None if step is None else step * 1e3,
                    "step_source": how,
                    "tokens_per_s": tps,
                    "aggregate_tokens_per_s": None if tps is None else tps * batch,
                    "speedup_vs_ar": None if tps is None else tps * ar_s,
                    "speedup_vs_chain": None if tps is None or chain_tps is None else tps / chain_tps,
                }
            )
        tree = [r for r in rows if r["temperature"] == temperature and r["method"] == "ddtree" and r["tokens_per_s"]]
        if tree:
            top = max(tree, key=lambda r: r["tokens_per_s"])
            best[f"T={temperature:g}"] = {
                "budget": top["budget"],
                "tokens_per_s": top["tokens_per_s"],
                "speedup_vs_ar": top["speedup_vs_ar"],
                "speedup_vs_chain": top["speedup_vs_chain"],
            }
    return {"rows": rows, "best_budget": best, "tau_kind": tau_kind}


def format_table(result: dict) -> str:
    src = result["step_times"]
    head = [
        "T",
        "method",
        "budget",
        f"tau ({result.get('tau_kind', 'mean')})",
        "step ms",
        "step from",
        "tok/s per row",
        "speedup vs AR",
        "speedup vs chain",
    ]
    lines = [
        f"step times: {src['source']} ({src.get('path') or src.get('model')}), batch {src.get('batch')}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in result["rows"]:
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['temperature']:g}",
                    r["method"],
                    "" if r["budget"] is None else str(r["budget"]),
                    fmt(r["tau"], ".3f"),
                    fmt(r["step_ms"], ".2f"),
                    r["step_source"],
                    fmt(r["tokens_per_s"], ".1f"),
                    fmt(r["speedup_vs_ar"], ".2f"),
                    fmt(r["speedup_vs_chain"], ".2f"),
                ]
            )
            + " |"
        )
    lines += [""] if result["best_budget"] else []
    for label, b in result["best_budget"].items():
        lines.append(
            f"best budget at {label}: {b['budget']} ({b['tokens_per_s']:.1f} tok/s per row, "
            f"{b['speedup_vs_ar']:.2f}x AR, "
            f"{'-' if b['speedup_vs_chain'] is None else format(b['speedup_vs_chain'], '.2f')}x the chain)"
        )
    return "\n".join(lines)


def speed_projection(
    sweep: dict | str,
    *,
    bench: str | None = None,
    use_roofline: bool = False,
    batch: int = 1,
    context: int = 2048,
    overhead_us: float = 0.0,
    tau_kind: str = "pooled",
) -> dict:
    """The projection from a sweep result (dict or JSON path); step times as the module docstring says;
    tau_kind as `project`. Raises NoStepTimes with a clear message when there is no source."""
    if isinstance(sweep, str):
        with open(sweep) as f:
            sweep = json.load(f)
    budgets = sorted({r["budget"] for r in sweep["rows"] if r["method"] == "ddtree"})
    have_roofline = roofline_available()
    overhead_s = overhead_us * 1e-6
    bench = None if use_roofline else (bench or find_bench_json(batch=batch))
    if bench:
        source = step_times_from_bench(bench, batch)
        if overhead_us:
            source["times"] = {k: v + overhead_s for k, v in source["times"].items()}
    elif have_roofline:
        source = step_times_from_roofline(budgets, batch=batch, context=context, overhead_s=overhead_s)
    else:
        raise NoStepTimes(
            "no step times: no benchmarks/bench_engine.py result (run `python -m benchmarks.bench_engine` "
            "on the GPU, or pass --bench FILE) and no roofline model (ddtree_jax/analysis/roofline.py)"
        )
    roofline_fn = None
    if source["source"] == "bench_engine" and have_roofline:
        ctx = source.get("context") or context
        roofline_fn = lambda b: roofline_step("ddtree", b, batch=batch, context=ctx)  # noqa: E731
    block = (sweep.get("settings") or {}).get("block_size")
    result = project(sweep, source, roofline_fn=roofline_fn, tau_kind=tau_kind)
    result.update(
        study="speed_projection",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        step_times={k: v for k, v in source.items() if k != "times"}
        | {"times_ms": {f"{m}{'' if b is None else f' {b}'}": t * 1e3 for (m, b), t in source["times"].items()}},
        sweep={
            "pair": sweep.get("pair"),
            "commit": sweep.get("commit"),
            "date": sweep.get("date"),
            "block_size": block,
        },
        notes=[]
        if block in (None, 16)
        else [f"the pair's block size is {block}; the step times are for a block-16 drafter"],
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sweep",
        default=None,
        help=f"a budget_sweep.py result (default: the newest committed {SWEEP_GLOB} by its recorded date)",
    )
    parser.add_argument("--bench", default=None, help="a benchmarks/bench_engine.py JSON (default: the newest found)")
    parser.add_argument("--roofline", action="store_true", help="use the roofline model even if a benchmark exists")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048, help="roofline context length")
    parser.add_argument("--overhead-us", type=float, default=0.0, help="added to every step (tree, sampling, launches)")
    parser.add_argument(
        "--tau",
        default="pooled",
        choices=TAU_KINDS,
        help="pooled: all tokens / all steps of a column (throughput; default); mean: mean per-generation tau",
    )
    parser.add_argument("--commit", default="unknown", help="the commit being measured (recorded in the JSON)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "speed_projection.json"))
    args = parser.parse_args(argv)
    if args.roofline and args.bench is not None:
        parser.error("--roofline and --bench exclude each other (--roofline ignores every benchmark)")
    if args.bench is not None and not os.path.isfile(args.bench):
        parser.error(f"--bench {args.bench!r}: no such file")
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: must be at least 1")
    if args.context < 1:
        parser.error(f"--context {args.context}: must be at least 1")
    if args.sweep is None:
        args.sweep = find_sweep_json()
        if args.sweep is None:
            print(
                f"error: no --sweep given and no committed sweep ({SWEEP_GLOB}) under {REPO}: "
                "run experiments/budget_sweep.py and pass --sweep FILE",
                file=sys.stderr,
            )
            return 2
        print(f"sweep: {os.path.relpath(args.sweep, REPO)} (the newest committed)")
    if not os.path.exists(args.sweep):
        print(f"error: no sweep result at {args.sweep}: run experiments/budget_sweep.py first", file=sys.stderr)
        return 2
    try:
        result = speed_projection(
            args.sweep,
            bench=args.bench,
            use_roofline=args.roofline,
            batch=args.batch,
            context=args.context,
            overhead_us=args.overhead_us,
            tau_kind=args.tau,
        )
    except NoStepTimes as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["commit"] = args.commit
    print(format_table(result))
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
