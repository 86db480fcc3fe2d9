"""Budget sweep: acceptance length tau vs DDTree budget, against the DFlash chain, and the drafter's surrogate.

On held-out code prompts (`experiments/held_out_prompts.py`), for each temperature (default T = 0 and 1)
it generates with the DFlash chain (the drafter's top-1 path, `block_size` slots) and with DDTree at each
budget (default 4, 8, 16, 32, 64, 128, 256), every column on the same prompts and request keys, and
records every decode step (`experiments/studies.study_generate`):

  measured   accepted draft tokens + 1 (what the step emitted before truncation)
  surrogate  1 + sum over the tree's non-root nodes of the drafter's path probability exp(logw): what the
             best-first tree maximises, computed from the drafter's logits and the tree actually built
  expected   1 + sum over non-root nodes of the target's processed path probability: the exact E[tau | tree]
             of exact tree verification; measured - expected averages to 0 if verification is exact
             (`exact_z`, its z-score; exactly 0 at T = 0, where both are the greedy path's length + 1)

Per (method, budget, temperature): mean tau over generations (the engine's tau: tokens per decode step of
one generation) with its standard error, the pooled tau (all tokens / all steps), the step means of the
three quantities, the surrogate's correlation with the measured length, and a calibration table (measured
mean per surrogate bin). `targets` checks the pair's goals: tau >= 4 at budget 64, T = 0, and DDTree above
the chain at every budget >= 8. The plot: tau vs budget (DDTree and chain per temperature, the surrogate's
mean dotted), surrogate vs measured per step, and the exact expectation vs measured.

  python -m experiments.budget_sweep                                   # checkpoints/embedded, the full sweep
  python -m experiments.budget_sweep --small --target T --drafter D    # the seconds-on-CPU version
  python -m experiments.budget_sweep --budgets 16,64 --temperatures 0 --prompts 8 --out outputs/sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import numpy as np

from benchmarks.common import markdown_table
from ddtree_jax.options import MAX_BUDGET
from experiments.studies import (
    TAU_HEAD,
    eos_stop_tokens,
    mean_and_se,
    output_problem,
    pooled_tau,
    progress_bar,
    save_figure,
    setup,
    step_records,
    study_generate,
    tau_cells,
    write_json,
)

BUDGETS = (4, 8, 16, 32, 64, 128, 256)
TEMPERATURES = (0.0, 1.0)
# The real sweep (GPU): prompts of 128 tokens + 128 generated fit the default recipe's 512-token training span.
FULL = dict(budgets=BUDGETS, temperatures=TEMPERATURES, num_prompts=32, prompt_len=128, max_new=128, samples=2)
# The seconds-on-CPU version (tests, DDTREE_NB_SMALL=1 notebooks; the tiny recipe trains on 64-token sequences).
# 4 prompts x 32 samples = 128 rows per call, 24 new tokens: the ordering ablation's SMALL shapes, so its exact
# budget-16 program is this sweep's.
SMALL = dict(budgets=(4, 16), temperatures=TEMPERATURES, num_prompts=4, prompt_len=24, max_new=24, samples=32)
CALIBRATION_EDGES = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, np.inf)
STEP_DIGITS = 4


def columns(budgets, include_chain: bool = True) -> list[tuple[str, int | None]]:
    """The chain (if asked), then DDTree at each budget."""
    return ([("chain", None)] if include_chain else []) + [("ddtree", int(b)) for b in budgets]


def summarise(res: dict, *, method: str, budget: int | None, temperature: float, keep_steps: bool = True) -> dict:
    """One sweep row from a `study_generate` result (module docstring)."""
    rec = step_records(res)
    tau_mean, tau_se = mean_and_se(res["tau"])
    measured, surrogate, expected = rec["measured"], rec["surrogate"], rec["expected"]
    if len(measured) == 0:  # every row stopped at its first token: no decode step to report
        measured = surrogate = expected = np.full(1, np.nan)
    diff = measured - expected
    diff_se = diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    if not len(rec["measured"]):
        exact_z = float("nan")
    elif len(diff) > 1 and diff_se > 0:
        exact_z = float(diff.mean() / diff_se)
    else:  # deterministic (greedy) steps: measured == expected up to float rounding
        exact_z = 0.0 if np.allclose(diff, 0.0, atol=1e-3) else float("inf")
    corr = (
        float(np.corrcoef(surrogate, measured)[0, 1])
        if len(measured) > 2 and measured.std() > 0 and surrogate.std() > 0
        else float("nan")
    )
    edges = np.asarray(CALIBRATION_EDGES)
    which = np.clip(np.searchsorted(edges, surrogate, side="right") - 1, 0, len(edges) - 2)
    calibration = (
        [
            {
                "surrogate_lo": float(edges[i]),
                "surrogate_hi": float(edges[i + 1]),
                "steps": int((which == i).sum()),
                "surrogate_mean": float(surrogate[which == i].mean()),
                "measured_mean": float(measured[which == i].mean()),
                "expected_mean": float(expected[which == i].mean()),
            }
            for i in range(len(edges) - 1)
            if (which == i).any()
        ]
        if len(rec["measured"])
        else []
    )
    row = {
        "method": method,
        "budget": budget,
        "temperature": float(temperature),
        "generations": int(np.isfinite(res["tau"]).sum()),
        "decode_steps": int(res["steps"].sum()),
        "tokens": int(res["num_generated"].sum()),
        "mean_tau": tau_mean,
        "se_tau": tau_se,
        "pooled_tau": pooled_tau(res),
        "step_measured_mean": float(measured.mean()),
        "step_surrogate_mean": float(surrogate.mean()),
        "step_expected_mean": float(expected.mean()),
        "surrogate_over_measured": float(surrogate.mean() / measured.mean()),
        "surrogate_measured_corr": corr,
        "exact_z": exact_z,
        "calibration": calibration,
        "per_generation_tau": [None if not np.isfinite(t) else round(float(t), STEP_DIGITS) for t in res["tau"]],
    }
    if keep_steps:
        row["steps"] = {k: np.round(rec[k], STEP_DIGITS).tolist() for k in ("measured", "surrogate", "expected")}
    return row


def run_sweep(
    pair,
    prompt_ids: list[list[int]],
    *,
    budgets=BUDGETS,
    temperatures=TEMPERATURES,
    max_new: int = 128,
    samples: int = 1,
    seed: int = 0,
    include_chain: bool = True,
    order: str = "draft",
    stop_tokens=None,
    batch_size: int | None = None,
    keep_steps: bool = True,
    progress: bool = True,
    on_row=None,
) -> dict:
    """The sweep's rows (module docstring) and its `targets` check.

    samples: generations per prompt at T > 0 (request ids 0 .. P * samples - 1, prompt i at rows i, i + P, ...);
    T = 0 is deterministic, so one per prompt. stop_tokens: default the tokenizer's eos. batch_size: rows per
    compiled call (default P * samples, for every temperature, so each column compiles once)
    Every column sees the same prompts and request keys (seed). on_row: called with the rows so far after each
    (`sweep` writes them to its output, so a run cut short keeps what it measured)."""
    stop = eos_stop_tokens(pair) if stop_tokens is None else list(stop_tokens)
    cols = columns(budgets, include_chain)
    if batch_size is None:  # one shape for every temperature: one compilation
        batch_size = len(prompt_ids) * max(samples, 1)
    elif batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    rows = []
    bar = progress_bar(len(cols) * len(temperatures), "budget sweep", progress)
    began = time.perf_counter()
    try:
        for method, budget in cols:  # temperature is a runtime input: one compilation per column
            for temperature in temperatures:
                bar.set_description(f"{method}{'' if budget is None else f' {budget}'} T={temperature:g}")
                reps = 1 if temperature == 0 else samples
                res = study_generate(
                    pair,
                    prompt_ids * reps,
                    method=method,
                    budget=1 if budget is None else budget,  # the chain's placeholder; DDTree's is validated
                    max_new_tokens=max_new,
                    temperature=temperature,
                    seed=seed,
                    stop_tokens=stop,
                    order=order,
                    batch_size=batch_size,
                )
                rows.append(
                    summarise(res, method=method, budget=budget, temperature=temperature, keep_steps=keep_steps)
                )
                if on_row is not None:
                    on_row(rows)
                bar.update(1)
    finally:
        bar.close()
    return {
        "rows": rows,
        "targets": targets(rows),
        "wall_s": round(time.perf_counter() - began, 2),
        "settings": {
            "budgets": [int(b) for b in budgets],
            "temperatures": [float(t) for t in temperatures],
            "max_new": max_new,
            "samples": samples,
            "seed": seed,
            "order": order,
            "stop_tokens": stop,
            "num_prompts": len(prompt_ids),
            "block_size": pair.drafter.max_block_size,
        },
    }


def find_row(rows, method: str, temperature: float, budget: int | None = None) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["method"] == method
            and r["temperature"] == temperature
            and (method != "ddtree" or r["budget"] == budget)
        ),
        None,
    )


def targets(rows: list[dict]) -> dict:
    """Issue 9's goals: tau >= 4 at budget 64, T = 0 (held-out code), and DDTree's tau above the chain's at every
    budget >= 8 (per temperature; None where a column is missing), judged on the mean of per-generation taus
    (the engine's tau) and, under the "pooled" key, on all tokens / all decode steps (rows that carry it)."""

    def judge(kind: str) -> dict:
        key = f"{kind}_tau"
        at64 = find_row(rows, "ddtree", 0.0, 64)
        have64 = at64 is not None and key in at64
        out = {
            "tau_budget64_T0": at64[key] if have64 else None,
            "tau_budget64_T0_at_least_4": (at64[key] >= 4.0) if have64 else None,
            "ddtree_above_chain": {},
        }
        for temperature in sorted({r["temperature"] for r in rows}):
            chain = find_row(rows, "chain", temperature)
            if chain is None or key not in chain:
                continue
            above = {
                r["budget"]: r[key] > chain[key]
                for r in rows
                if r["method"] == "ddtree" and r["temperature"] == temperature and r["budget"] >= 8 and key in r
            }
            out["ddtree_above_chain"][f"T={temperature:g}"] = {
                "per_budget": above,
                "all": all(above.values()) if above else None,
            }
        return out

    result = judge("mean")
    if any("pooled_tau" in r for r in rows):
        result["pooled"] = judge("pooled")
    return result


def format_table(result: dict) -> str:
    """Markdown: one line per (method, budget, temperature)."""
    head = TAU_HEAD + ["exact E[tau]", "measured", "corr(sur, meas)", "exact z", "steps"]
    rows = sorted(result["rows"], key=lambda r: (r["temperature"], r["method"] != "chain", r["budget"] or 0))
    table = [
        tau_cells(r)
        + [
            f"{r['step_expected_mean']:.3f}",
            f"{r['step_measured_mean']:.3f}",
            f"{r['surrogate_measured_corr']:.2f}",
            f"{r['exact_z']:+.2f}",
            str(r["decode_steps"]),
        ]
        for r in rows
    ]
    lines = [markdown_table(head, table), ""]
    for kind, t in (("mean", result["targets"]), ("pooled", result["targets"].get("pooled"))):
        if t is None:
            continue
        if t["tau_budget64_T0"] is not None:
            lines.append(
                f"target tau >= 4 at budget 64, T = 0 ({kind} tau): {t['tau_budget64_T0']:.3f} "
                f"({'met' if t['tau_budget64_T0_at_least_4'] else 'not met'})"
            )
        for label, v in t["ddtree_above_chain"].items():
            lines.append(
                f"DDTree above the chain at every budget >= 8, {label} ({kind} tau): {v['all']} {v['per_budget']}"
            )
    return "\n".join(lines)


def plot_sweep(result: dict, path: str | None = None, max_points: int = 4000, seed: int = 0):
    """Three panels: tau vs budget (DDTree solid, chain dashed, surrogate dotted; a colour per temperature);
    surrogate vs measured per decode step (jittered; binned means); exact expectation vs measured (binned).
    Saves to `path` when given; returns the figure."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    temps = sorted({r["temperature"] for r in rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    rng = np.random.default_rng(seed)
    ax = axes[0]
    for k, temperature in enumerate(temps):
        c = colours[k % len(colours)]
        tree = sorted(
            (r for r in rows if r["method"] == "ddtree" and r["temperature"] == temperature), key=lambda r: r["budget"]
        )
        if tree:
            b = [r["budget"] for r in tree]
            ax.errorbar(
                b,
                [r["mean_tau"] for r in tree],
                yerr=[r["se_tau"] for r in tree],
                color=c,
                marker="o",
                capsize=3,
                label=f"DDTree, T={temperature:g}",
            )
            ax.plot(
                b,
                [r["step_surrogate_mean"] for r in tree],
                color=c,
                linestyle=":",
                marker=".",
                label=f"surrogate, T={temperature:g}",
            )
        chain = find_row(rows, "chain", temperature)
        if chain:
            ax.axhline(chain["mean_tau"], color=c, linestyle="--", label=f"DFlash chain, T={temperature:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree budget (draft nodes)")
    ax.set_ylabel("tau (tokens per decode step)")
    ax.set_title("acceptance length vs budget")
    ax.legend(fontsize=7)
    for panel, key, title in (
        (1, "surrogate", "drafter's surrogate vs measured"),
        (2, "expected", "exact E[tau | tree] vs measured"),
    ):
        ax = axes[panel]
        top = 1.0
        for k, temperature in enumerate(temps):
            c = colours[k % len(colours)]
            xs, ys = [], []
            for r in rows:
                if r["method"] == "ddtree" and r["temperature"] == temperature and "steps" in r:
                    xs += r["steps"][key]
                    ys += r["steps"]["measured"]
            if not xs:
                continue
            x, y = np.asarray(xs), np.asarray(ys)
            top = max(top, x.max(), y.max())
            pick = rng.permutation(len(x))[:max_points]
            if panel == 1:
                ax.scatter(x[pick], y[pick] + rng.uniform(-0.2, 0.2, len(pick)), s=4, alpha=0.25, color=c)
            edges = np.unique(np.quantile(x, np.linspace(0, 1, 11)))
            if len(edges) == 1:  # one value (e.g. greedy steps of one tree shape): one point
                ax.plot(
                    [x.mean()], [y.mean()], color=c, marker="s", label=f"T={temperature:g}: mean (DDTree, all budgets)"
                )
            else:
                which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
                bx = [x[which == i].mean() for i in range(len(edges) - 1) if (which == i).any()]
                by = [y[which == i].mean() for i in range(len(edges) - 1) if (which == i).any()]
                ax.plot(bx, by, color=c, marker="s", label=f"T={temperature:g}: binned mean (DDTree, all budgets)")
        ax.plot([1, top], [1, top], color="k", lw=0.8, linestyle="--", label="y = x")
        ax.set_xlabel(key if key == "surrogate" else "exact expectation given the tree")
        ax.set_ylabel("measured accepted + 1 (per step)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def sweep(
    target_dir: str | None = None,
    drafter_dir: str | None = None,
    *,
    budgets=None,
    temperatures=None,
    num_prompts: int | None = None,
    prompt_len: int | None = None,
    max_new: int | None = None,
    samples: int | None = None,
    small: bool = False,
    seed: int = 0,
    prompt_seed: int = 0,
    include_chain: bool = True,
    batch_size: int | None = None,
    keep_steps: bool = True,
    progress: bool = True,
    commit: str | None = None,
    partial_out: str | None = None,
) -> dict:
    """The whole study from checkpoint directories: prompts, `run_sweep`, and what a result file records.
    Unset settings come from FULL (or SMALL with small=True). partial_out: a JSON path rewritten after every row
    with the rows so far ("complete": false), so a run cut short keeps them; the caller writes the whole result
    there at the end."""
    base = SMALL if small else FULL
    budgets = tuple(base["budgets"] if budgets is None else budgets)
    temperatures = tuple(base["temperatures"] if temperatures is None else temperatures)
    num_prompts = base["num_prompts"] if num_prompts is None else num_prompts
    prompt_len = base["prompt_len"] if prompt_len is None else prompt_len
    max_new = base["max_new"] if max_new is None else max_new
    samples = base["samples"] if samples is None else samples
    check_sweep_budgets(budgets)
    for name, value in (("num_prompts", num_prompts), ("prompt_len", prompt_len), ("max_new", max_new)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1; got {samples}")
    pair, prompts, summary = setup(
        target_dir,
        drafter_dir,
        num_prompts=num_prompts,
        prompt_len=prompt_len,
        max_new=max_new,
        prompt_seed=prompt_seed,
    )
    result = run_sweep(
        pair,
        [p["ids"] for p in prompts],
        budgets=budgets,
        temperatures=temperatures,
        max_new=max_new,
        samples=samples,
        seed=seed,
        include_chain=include_chain,
        batch_size=batch_size,
        keep_steps=keep_steps,
        progress=progress,
        on_row=None
        if partial_out is None
        else lambda rows: write_json(
            {"study": "budget_sweep", "complete": False, "commit": commit, "pair": summary, "rows": rows}, partial_out
        ),
    )
    result.update(
        complete=True,
        study="budget_sweep",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=device_label(),
        commit=commit,
        pair=summary,
        prompts=[{k: p[k] for k in ("path", "char", "ids")} for p in prompts],
        settings={**result["settings"], "prompt_len": prompt_len, "prompt_seed": prompt_seed},
    )
    return result


def check_sweep_budgets(budgets) -> tuple[int, ...]:
    """The budgets as ints, each in [1, MAX_BUDGET] and none twice (a repeated budget would give duplicate rows);
    ValueError naming the value otherwise."""
    out = []
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= MAX_BUDGET:
            raise ValueError(f"budget {b!r}: a budget is an int in [1, {MAX_BUDGET}]")
        if int(b) in out:
            raise ValueError(f"budget {b} given twice")
        out.append(int(b))
    if not out:
        raise ValueError("no budgets given")
    return tuple(out)


def budget_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated budgets (`check_sweep_budgets`)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers expected") from None
    try:
        return check_sweep_budgets(values)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def float_list(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated floats (temperatures), none twice (a repeat would give duplicate rows)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers expected") from None
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(f'{v:g}' for v in repeated)} given twice")
    bad = [v for v in values if not math.isfinite(v) or v < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: a temperature is finite and >= 0 (0: greedy), got {bad[0]:g}")
    return values


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a count: 0 is not "unset")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} given; must be >= 1")
    return value


def device_label() -> str:
    """'platform:device kind (jax version)' of the first device, for a study's JSON."""
    import jax

    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} (jax {jax.__version__})"


def main(argv=None) -> int:
    from experiments.studies import pair_dirs

    target, drafter = pair_dirs()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--target",
        default=target,
        help="target HF directory (default: $DDTREE_PAIR_DIR/target or checkpoints/embedded/target)",
    )
    parser.add_argument("--drafter", default=drafter, help="drafter HF directory")
    parser.add_argument(
        "--budgets",
        type=budget_list,
        default=None,
        help=f"comma-separated, each in [1, {MAX_BUDGET}] (default {','.join(map(str, BUDGETS))})",
    )
    parser.add_argument("--temperatures", type=float_list, default=None, help="comma-separated (default 0,1)")
    parser.add_argument(
        "--prompts", type=positive_int, default=None, help=f"held-out prompts (default {FULL['num_prompts']})"
    )
    parser.add_argument(
        "--prompt-len", type=positive_int, default=None, help=f"tokens per prompt (default {FULL['prompt_len']})"
    )
    parser.add_argument(
        "--max-new", type=positive_int, default=None, help=f"tokens generated per prompt (default {FULL['max_new']})"
    )
    parser.add_argument(
        "--samples",
        type=positive_int,
        default=None,
        help=f"generations per prompt at T > 0 (default {FULL['samples']})",
    )
    parser.add_argument("--seed", type=int, default=0, help="request-key seed")
    parser.add_argument("--prompt-seed", type=int, default=0, help="which held-out prompts")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="rows per compiled call (default: all)")
    parser.add_argument("--small", action="store_true", help="the seconds-on-CPU settings (tiny pairs, tests)")
    parser.add_argument("--no-chain", action="store_true")
    parser.add_argument("--no-steps", action="store_true", help="leave the per-step records out of the JSON")
    parser.add_argument("--commit", default=None, help="the code commit to record")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "budget_sweep.json"))
    parser.add_argument("--plot", default=None, help="PNG (default: the JSON path with .png)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    for flag, path in (("--out", args.out), ("--plot", plot)):
        problem = output_problem(path)
        if problem:
            parser.error(f"{flag} {problem}")  # before the sweep, not after it
    try:
        result = sweep(
            args.target,
            args.drafter,
            budgets=args.budgets,
            temperatures=args.temperatures,
            num_prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_new=args.max_new,
            samples=args.samples,
            small=args.small,
            seed=args.seed,
            prompt_seed=args.prompt_seed,
            include_chain=not args.no_chain,
            batch_size=args.batch_size,
            keep_steps=not args.no_steps,
            progress=not args.no_progress,
            commit=args.commit,
            partial_out=args.out,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    write_json(result, args.out)
    plot_sweep(result, plot)
    print(f"wrote {args.out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
