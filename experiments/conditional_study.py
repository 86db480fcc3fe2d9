"""Path-conditioned trees and the cost-aware budget (issue #23): the DFlash chain, marginal DDTree and
path-conditioned DDTree (the drafter with its trained child head, `models.child_head`) at equal budgets, on
held-out code prompts at T = 0 and T = 1.

Per (method, budget, temperature), from the engine's own generation with per-step records
(`studies.study_generate` with `studies.spine_record`): the mean tau (tokens per decode step of a generation)
with its standard error, the pooled tau, the surrogate and the exact E[tau | tree] per step (as
`budget_sweep`), and the walk's spine statistics: the spine is the path of rank-0 children from the root (the
chain inside the tree); a node is visited when its parent was accepted; the spine hit rate and the off-spine hit
rate are hits / visits on and off the spine, and the off-spine share is the fraction of accepted draft tokens
that lie off the spine (what branching bought over the tree's own chain).

With `timing` (run it on the GPU): tokens/s end to end per column (`engine.run.benchmark`: one prompt at a time,
median of `repeats`, AR as the reference), ms per decode step, and the cost-aware budget (`BudgetPolicy`, fitted
at start-up on `calibration_prompts` other held-out prompts: `engine.budget.fit_budget_policy`) for marginal and
conditional trees against the best fixed budget of each.

  python -m experiments.conditional_study --commit $(git rev-parse --short HEAD)        # the full study (GPU)
  python -m experiments.conditional_study --small --pair DIR                            # seconds on CPU

The pair directory (default checkpoints/embedded, or DDTREE_PAIR_DIR) holds target/, drafter/ and child_head/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table
from ddtree_jax.checkpoint.child_head import load_child_head
from ddtree_jax.engine.budget import fit_budget_policy
from ddtree_jax.engine.run import Pair, benchmark, enable_compilation_cache, load_dtype, pair_dtype
from ddtree_jax.options import DecodeOptions, check_budgets
from experiments.budget_sweep import (
    budget_list,
    check_sweep_budgets,
    device_label,
    float_list,
    output_problem,
    positive_int,
    summarise,
)
from experiments.held_out_prompts import load_prompts
from experiments.studies import (
    TAU_HEAD,
    eos_stop_tokens,
    pair_dirs,
    pair_root,
    progress_bar,
    save_figure,
    setup,
    spine_record,
    study_generate,
    tau_cells,
    write_json,
)

METHODS = ("chain", "marginal", "conditional")
FULL = dict(
    budgets=(16, 32, 64, 128, 256),
    temperatures=(0.0, 1.0),
    num_prompts=16,
    prompt_len=128,
    max_new=128,
    samples=4,
    auto_budgets=(16, 32, 64, 128, 256),
    calibration_prompts=4,
    repeats=3,
)
SMALL = dict(
    budgets=(4, 16),
    temperatures=(0.0, 1.0),
    num_prompts=4,
    prompt_len=24,
    max_new=24,
    samples=8,
    auto_budgets=(4, 16),
    calibration_prompts=2,
    repeats=1,
    timing_temperatures=(1.0,),  # the timing part's machinery at one temperature: its compiles dominate on a CPU
)
SPINE_KEYS = ("spine_visited", "spine_hit", "off_visited", "off_hit")
_STARTED = time.perf_counter()


def log(message: str) -> None:
    """One line on stderr with the seconds since import: a long GPU run shows where it is even if cut short."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def head_pair(pair: Pair, root: str) -> Pair:
    """The pair with root/child_head attached to its drafter (FileNotFoundError naming the directory)."""
    directory = os.path.join(root, "child_head")
    if not os.path.exists(os.path.join(directory, "config.json")):
        raise FileNotFoundError(
            f"no child head at {directory!r}: train one with `python -m ddtree_jax.train child_head --config "
            "configs/train_default.json --out <pair dir>` (docs/training.md)"
        )
    config, params = load_child_head(directory, pair_dtype(pair))
    return dataclasses.replace(pair, drafter=pair.drafter.with_head(config, params))


def spine_stats(res: dict) -> dict:
    """The spine statistics (module docstring) pooled over every active step of a `study_generate` result."""
    active = res["active"]
    total = {k: int(np.asarray(res[k])[active].sum()) for k in SPINE_KEYS}
    hits = total["spine_hit"] + total["off_hit"]

    def ratio(a, b):
        return a / b if b else float("nan")

    return {
        **total,
        "spine_hit_rate": ratio(total["spine_hit"], total["spine_visited"]),
        "off_spine_hit_rate": ratio(total["off_hit"], total["off_visited"]),
        "off_spine_share": ratio(total["off_hit"], hits),
    }


def tau_rows(
    pair, cond_pair, prompt_ids, *, budgets, temperatures, max_new, samples, seed, stop, progress, on_row=None
) -> list:
    """One row per (method, budget, temperature): `budget_sweep.summarise` and `spine_stats`.
    on_row(rows): called after each row with the rows so far."""
    columns = [("chain", None)] + [(m, b) for m in ("marginal", "conditional") for b in budgets]
    rows = []
    bar = progress_bar(len(columns) * len(temperatures), "conditional study", progress)
    try:
        for method, budget in columns:  # temperature is a runtime input: one compilation per column
            run_pair = cond_pair if method == "conditional" else pair
            for temperature in temperatures:
                bar.set_description(f"{method}{'' if budget is None else f' {budget}'} T={temperature:g}")
                reps = 1 if temperature == 0 else samples
                res = study_generate(
                    run_pair,
                    prompt_ids * reps,
                    method="chain" if method == "chain" else "ddtree",
                    budget=1 if budget is None else budget,  # the chain's placeholder; DDTree's is validated
                    max_new_tokens=max_new,
                    temperature=temperature,
                    seed=seed,
                    stop_tokens=stop,
                    batch_size=len(prompt_ids) * max(samples, 1),
                    recorder=spine_record,
                )
                row = summarise(res, method=method, budget=budget, temperature=temperature, keep_steps=False)
                rows.append(row | spine_stats(res))
                if on_row is not None:
                    on_row(rows)
                log(f"tau {method}{'' if budget is None else f' {budget}'} T={temperature:g}: {row['mean_tau']:.3f}")
                bar.update(1)
    finally:
        bar.close()
    return rows


def timing_rows(
    pair,
    cond_pair,
    prompt_ids,
    calibration_ids,
    *,
    budgets,
    auto_budgets,
    temperatures,
    max_new,
    seed,
    stop,
    repeats,
    on_temperature=None,
) -> tuple[list, list]:
    """(rows, policies): tokens/s end to end for AR, the chain, marginal and conditional DDTree per budget and
    the cost-aware budget of each (fitted at start-up per temperature on `calibration_ids`).
    on_temperature(rows, policies): called after each temperature's fixed-budget columns and after each of its
    cost-aware fits with what is measured so far."""
    rows, policies = [], []
    common = dict(max_new_tokens=max_new, seed=seed, stop_tokens=stop, repeats=repeats)
    for temperature in temperatures:
        found = []
        found += [
            r | {"tree": r["method"] if r["method"] != "ddtree" else "marginal"}
            for r in benchmark(pair, prompt_ids, budgets=budgets, temperature=temperature, **common)
        ]
        log(f"timing T={temperature:g}: AR, the chain and marginal DDTree {list(budgets)} measured")
        found += [
            r | {"tree": "conditional"}
            for r in benchmark(
                cond_pair, prompt_ids, budgets=budgets, methods=("ddtree",), temperature=temperature, **common
            )
        ]
        log(f"timing T={temperature:g}: conditional DDTree {list(budgets)} measured")
        if on_temperature is not None:
            on_temperature(rows + _timing_table(found, temperature), policies)
        for tree, run_pair in (("marginal", pair), ("conditional", cond_pair)):
            policy, report = fit_budget_policy(
                run_pair,
                calibration_ids[:1],  # the step times at batch 1: the timed runs' batch
                auto_budgets,
                temperature=temperature,
                seed=seed + 1,
                calibration_tokens=max_new,
                stop_tokens=stop,
                short=max(max_new // 8, 1),
                long=max_new,
                repeats=repeats,
                calibration_prompt_ids=calibration_ids,  # the surrogate's calibration on every calibration prompt
            )
            policies.append(report | {"tree": tree})
            auto = benchmark(
                run_pair,
                prompt_ids,
                budgets=(policy.max_budget,),
                methods=("ddtree",),
                temperature=temperature,
                options=DecodeOptions(budget_policy=policy),
                **common,
            )
            found += [r | {"tree": tree, "budget": "auto", "method": "ddtree"} for r in auto]
            log(f"timing T={temperature:g}: {tree} cost-aware budget fitted and measured")
            if on_temperature is not None:  # what is measured so far, this temperature's rows included
                on_temperature(rows + _timing_table(found, temperature), policies)
        rows += _timing_table(found, temperature)  # what the last fit's on_temperature call already showed
    return rows, policies


def _timing_table(found: list[dict], temperature: float) -> list[dict]:
    """The timing rows of one temperature from `engine.run.benchmark`'s rows (each tagged with its tree)."""
    ar = next(r for r in found if r["method"] == "ar")
    rows = []
    for r in found:
        steps = sum(p["steps"] for p in r["per_prompt"])
        rows.append(
            {
                "temperature": float(temperature),
                "tree": r["tree"],
                "method": r["method"],
                "budget": r["budget"],
                "tokens_per_s": r["tokens_per_s"],
                "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"],
                "mean_tau": r["mean_tau"],
                "ms_per_step": 1e3 * r["run_s"] / max(steps, 1),
                "run_s": r["run_s"],
                "num_tokens": r["num_tokens"],
                "compile_s": r["compile_s"],
            }
        )
    return rows


def above_everywhere(ratios: list[float | None]) -> bool | None:
    """Whether every conditional / marginal tau ratio is above 1: False as soon as one measured ratio is not,
    None where nothing decides it (no ratio measured, e.g. a `--no-tau` run, or some not measured)."""
    if any(v is not None and v <= 1.0 for v in ratios):
        return False
    if not ratios or any(v is None for v in ratios):
        return None
    return True


def targets(rows: list[dict], timing: list[dict]) -> dict:
    """Issue #23's targets: conditional tau >= 1.10x marginal at budget 64, T = 0, and above marginal at every
    budget at both temperatures; the cost-aware budget's tokens/s >= the best fixed budget's (per tree and
    temperature; within the run-to-run noise, stated with the numbers); the head's step-time cost at budget 64."""

    def row(method, budget, temperature):
        return next(
            (r for r in rows if (r["method"], r["budget"], r["temperature"]) == (method, budget, temperature)), None
        )

    out = {
        "conditional_over_marginal": {},
        "paired_difference": {},
        "auto_vs_best_fixed": {},
        "head_step_cost_budget64": {},
    }
    for temperature in sorted({r["temperature"] for r in rows}):
        ratios, paired = {}, {}
        for budget in sorted({r["budget"] for r in rows if r["method"] == "marginal"}):
            m, c = row("marginal", budget, temperature), row("conditional", budget, temperature)
            ratios[budget] = None if not (m and m["mean_tau"]) or c is None else c["mean_tau"] / m["mean_tau"]
            # paired: the same prompts and request keys in both columns, so the per-generation differences carry
            # the comparison's own noise (the per-generation taus vary far more between prompts than between trees)
            if m and c and len(m["per_generation_tau"]) == len(c["per_generation_tau"]):
                c_tau, m_tau = (
                    np.asarray([np.nan if t is None else t for t in r["per_generation_tau"]]) for r in (c, m)
                )
                diff = c_tau - m_tau
                diff = diff[np.isfinite(diff)]  # a generation without a decode step has no tau
                if diff.size >= 2:
                    se = float(diff.std(ddof=1) / np.sqrt(diff.size))
                    z = float(diff.mean() / se) if se > 0 else None
                    paired[budget] = {"mean": float(diff.mean()), "se": se, "z": z}
        out["conditional_over_marginal"][f"T={temperature:g}"] = ratios
        out["paired_difference"][f"T={temperature:g}"] = paired
    r64 = out["conditional_over_marginal"].get("T=0", {}).get(64)
    out["conditional_tau_1.10x_at_64_T0"] = None if r64 is None else r64 >= 1.10
    out["conditional_above_marginal_everywhere"] = above_everywhere(
        [v for per in out["conditional_over_marginal"].values() for v in per.values()]
    )
    for temperature in sorted({r["temperature"] for r in timing}):
        key = f"T={temperature:g}"
        for tree in ("marginal", "conditional"):
            fixed = [
                r
                for r in timing
                if (r["temperature"], r["tree"]) == (temperature, tree) and isinstance(r["budget"], int)
            ]
            auto = next(
                (r for r in timing if (r["temperature"], r["tree"], r["budget"]) == (temperature, tree, "auto")), None
            )
            if fixed and auto:
                best = max(fixed, key=lambda r: r["tokens_per_s"])
                out["auto_vs_best_fixed"][f"{tree} {key}"] = {
                    "auto_tokens_per_s": auto["tokens_per_s"],
                    "best_fixed_budget": best["budget"],
                    "best_fixed_tokens_per_s": best["tokens_per_s"],
                    "ratio": auto["tokens_per_s"] / best["tokens_per_s"],
                }
        m = next(
            (r for r in timing if (r["temperature"], r["tree"], r["budget"]) == (temperature, "marginal", 64)), None
        )
        c = next(
            (r for r in timing if (r["temperature"], r["tree"], r["budget"]) == (temperature, "conditional", 64)), None
        )
        if m and c:
            out["head_step_cost_budget64"][key] = c["ms_per_step"] / m["ms_per_step"] - 1.0
    return out


def study(
    pair_dir: str | None = None,
    *,
    small: bool = False,
    budgets=None,
    temperatures=None,
    num_prompts: int | None = None,
    samples: int | None = None,
    tau: bool = True,
    timing: bool = False,
    auto_budgets=None,
    repeats: int | None = None,
    seed: int = 0,
    prompt_seed: int = 0,
    progress: bool = True,
    commit: str | None = None,
    on_partial=None,
    dtype: str = "float32",
) -> dict:
    """The whole study on the pair at `pair_dir` (default `studies.pair_root()`); unset settings from FULL (or
    SMALL). tau: the acceptance part; timing: the end-to-end tokens/s and the cost-aware budget (GPU).
    on_partial(result): called with the result so far after each tau row and each timing stage (the CLI writes
    it, so a run cut short keeps what it measured). dtype: the pair's weights, "float32" (the studies' default),
    "bfloat16" or "auto" (`dispatch.weights_dtype`: the checkpoint's on GPU, bf16 for the embedded pair, as
    `bench_e2e` times it; float32 elsewhere)."""
    base = dict(SMALL if small else FULL)
    if auto_budgets is not None:
        base["auto_budgets"] = tuple(auto_budgets)
    if repeats is not None:
        base["repeats"] = int(repeats)
    budgets = check_sweep_budgets(base["budgets"] if budgets is None else budgets)
    check_sweep_budgets(base["auto_budgets"])
    temperatures = tuple(base["temperatures"] if temperatures is None else temperatures)
    num_prompts = base["num_prompts"] if num_prompts is None else num_prompts
    samples = base["samples"] if samples is None else samples
    for name, value in (("num_prompts", num_prompts), ("samples", samples), ("repeats", base["repeats"])):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if not (tau or timing):
        raise ValueError("nothing to run: tau and timing are both off")
    root = pair_dir or pair_root()
    target_dir, drafter_dir = pair_dirs(root)
    began = time.perf_counter()
    enable_compilation_cache()
    pair, prompts, summary = setup(
        target_dir,
        drafter_dir,
        num_prompts=num_prompts,
        prompt_len=base["prompt_len"],
        max_new=base["max_new"],
        prompt_seed=prompt_seed,
        dtype=load_dtype(dtype),
    )
    cond_pair = head_pair(pair, root)
    stop = eos_stop_tokens(pair)
    ids = [p["ids"] for p in prompts]
    log(f"pair loaded: {len(ids)} prompts")

    def result(rows, timing_out, policies) -> dict:
        return {
            "study": "conditional_study",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": device_label(),
            "commit": commit,
            "pair": summary | {"child_head": os.path.join(root, "child_head")},
            "settings": {
                **base,
                "budgets": list(budgets),
                "temperatures": list(temperatures),
                "num_prompts": num_prompts,
                "samples": samples,
                "seed": seed,
                "prompt_seed": prompt_seed,
                "tau": tau,
                "timing": timing,
                "small": small,
                "dtype": dtype,
                "weights_dtype": str(jnp.dtype(pair_dtype(pair))),  # what "auto" resolved to here
            },
            "rows": rows,
            "timing": timing_out,
            "policies": policies,
            "targets": targets(rows, timing_out),
            "wall_s": round(time.perf_counter() - began, 2),
        }

    rows = []
    if tau:
        rows = tau_rows(
            pair,
            cond_pair,
            ids,
            budgets=budgets,
            temperatures=temperatures,
            max_new=base["max_new"],
            samples=samples,
            seed=seed,
            stop=stop,
            progress=progress,
            on_row=None if on_partial is None else (lambda so_far: on_partial(result(so_far, [], []))),
        )
    timing_out, policies = [], []
    if timing:
        calibration = load_prompts(
            root,
            pair.tokenizer,
            n=num_prompts + base["calibration_prompts"],
            length=base["prompt_len"],
            seed=prompt_seed,
            min_continuation=base["max_new"],
        )
        calibration_ids = [p["ids"] for p in calibration if p["ids"] not in ids][: base["calibration_prompts"]]
        timing_out, policies = timing_rows(
            pair,
            cond_pair,
            ids,
            calibration_ids,
            budgets=budgets,
            auto_budgets=base["auto_budgets"],
            temperatures=tuple(t for t in temperatures if t in base.get("timing_temperatures", temperatures))
            or temperatures,
            max_new=base["max_new"],
            seed=seed,
            stop=stop,
            repeats=base["repeats"],
            on_temperature=None if on_partial is None else (lambda t, p: on_partial(result(rows, t, p))),
        )
    return result(rows, timing_out, policies)


# What may differ between merged parts (each part's own values are kept in settings.parts): the columns split
# across runs, which part ran, and how it was timed / in which weights (the tau part on a CPU in float32, the
# timing part on a GPU in bf16). Every other setting must match; the pair's paths may differ between machines.
# settings each part keeps for itself (settings.parts): what a tau part and a timing part legitimately differ in
def increasing_budget_list(text: str) -> tuple[int, ...]:
    """argparse type: the cost-aware budget's set (`budget_list`, and strictly increasing, as `options.check_budgets`
    requires: refused here, not after the tau part)."""
    budgets = budget_list(text)
    try:
        return check_budgets(budgets)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


PART_SETTINGS = ("budgets", "temperatures", "tau", "timing", "auto_budgets", "repeats", "dtype", "weights_dtype")
PAIR_PATHS = ("target", "drafter", "child_head")


def check_mergeable(results: list[dict], names: list[str] | None = None) -> None:
    """ValueError naming the files (`names`, default part 0, 1, ...) unless every part is a conditional_study
    result of the same pair and settings (all but PART_SETTINGS) and no (method, budget, temperature) row or
    timing column comes twice."""
    names = names or [f"part {i}" for i in range(len(results))]
    for res, name in zip(results, names):
        if not isinstance(res, dict) or res.get("study") != "conditional_study":
            found = res.get("study", "no study key") if isinstance(res, dict) else type(res).__name__
            raise ValueError(f"{name}: not a conditional_study result ({found})")
        missing = [k for k in ("settings", "rows", "timing", "policies") if k not in res]
        if missing:
            raise ValueError(f"{name}: a conditional_study result without {', '.join(missing)}")
    first, first_name = results[0], names[0]
    for res, name in zip(results[1:], names[1:]):
        for label, a, b, skip in (
            ("settings", first["settings"], res["settings"], PART_SETTINGS + ("parts",)),
            ("pair", first.get("pair") or {}, res.get("pair") or {}, PAIR_PATHS),
        ):
            for key in sorted((set(a) | set(b)) - set(skip)):
                if a.get(key) != b.get(key):
                    raise ValueError(
                        f"{first_name} and {name} differ in {label}.{key} ({a.get(key)!r} vs {b.get(key)!r}): "
                        "only runs of the same pair and settings merge"
                    )
    for key, fields in (
        ("rows", ("method", "budget", "temperature")),
        ("timing", ("tree", "method", "budget", "temperature")),
    ):
        seen = {}
        for res, name in zip(results, names):
            for r in res[key]:
                k = tuple(r.get(f) for f in fields)
                if k in seen:
                    raise ValueError(
                        f"{key} {dict(zip(fields, k))} is in both {seen[k]} and {name}"
                        if seen[k] != name
                        else f"{key} {dict(zip(fields, k))} is twice in {name}"
                    )
                seen[k] = name


def merge_results(results: list[dict], names: list[str] | None = None) -> dict:
    """One result from runs of the same pair over different temperatures, budgets or parts (e.g. the tau part
    and the timing part in separate GPU processes): rows, timing and policies concatenated, targets recomputed;
    settings.parts keeps each run's own budgets, temperatures and parts, with its device, commit and date (and
    the top-level device / commit / date list every run's where they differ)."""
    if not results:
        raise ValueError("nothing to merge")
    check_mergeable(results, names)
    out = dict(results[0])
    for key in ("rows", "timing", "policies"):
        out[key] = [r for res in results for r in res[key]]
    settings = [res["settings"] for res in results]
    out["settings"] = dict(
        out["settings"],
        temperatures=sorted({t for s in settings for t in s["temperatures"]}),
        budgets=sorted({b for s in settings for b in s["budgets"]}),
        tau=any(s.get("tau", True) for s in settings),
        timing=any(s["timing"] for s in settings),
        parts=[
            {
                **{k: s[k] for k in PART_SETTINGS if k in s},
                **{k: res.get(k) for k in ("device", "commit", "date")},
            }
            for s, res in zip(settings, results)
        ],
    )
    for key in ("device", "commit", "date"):
        values = list(dict.fromkeys(res.get(key) for res in results))
        out[key] = values[0] if len(values) == 1 else values
    out["wall_s"] = round(sum(res["wall_s"] for res in results), 2)
    out["targets"] = targets(out["rows"], out["timing"])
    return out


def format_table(result: dict) -> str:
    """Markdown: the tau table (with the spine statistics), then the timing table when there is one."""
    head = TAU_HEAD + ["spine hit", "off-spine hit", "off-spine share", "steps"]
    order = {m: i for i, m in enumerate(METHODS)}
    rows = sorted(result["rows"], key=lambda r: (r["temperature"], r["budget"] or 0, order[r["method"]]))
    table = [
        tau_cells(r)
        + [
            f"{r['spine_hit_rate']:.3f}",
            f"{r['off_spine_hit_rate']:.3f}",
            f"{r['off_spine_share']:.3f}",
            str(r["decode_steps"]),
        ]
        for r in rows
    ]
    lines = [markdown_table(head, table)]
    if result["timing"]:
        head = ["T", "tree", "budget", "tokens/s", "vs AR", "tau", "ms/step"]
        table = [
            [
                f"{r['temperature']:g}",
                r["tree"] if r["method"] == "ddtree" else r["method"],
                "" if r["budget"] is None else str(r["budget"]),
                f"{r['tokens_per_s']:.1f}",
                f"{r['speedup_vs_ar']:.2f}x",
                f"{r['mean_tau']:.3f}",
                f"{r['ms_per_step']:.3f}",
            ]
            for r in result["timing"]
        ]
        lines += ["", markdown_table(head, table)]
    t = result["targets"]
    lines.append("")
    for key, ratios in t["conditional_over_marginal"].items():
        shown = ", ".join(f"{b}: {v:.3f}" for b, v in ratios.items() if v is not None)
        lines.append(f"conditional / marginal tau, {key}: {shown}")
    for key, per in t.get("paired_difference", {}).items():
        shown = ", ".join(f"{b}: {v['mean']:+.3f} +- {v['se']:.3f}" for b, v in per.items())
        lines.append(f"conditional - marginal tau per generation (paired), {key}: {shown}")
    lines.append(f"conditional tau >= 1.10x marginal at budget 64, T = 0: {t['conditional_tau_1.10x_at_64_T0']}")
    lines.append(
        f"conditional above marginal at every budget and temperature: {t['conditional_above_marginal_everywhere']}"
    )
    for key, v in t["auto_vs_best_fixed"].items():
        lines.append(
            f"cost-aware budget, {key}: {v['auto_tokens_per_s']:.1f} tokens/s vs best fixed (budget "
            f"{v['best_fixed_budget']}) {v['best_fixed_tokens_per_s']:.1f}: {v['ratio']:.3f}x"
        )
    for key, v in t["head_step_cost_budget64"].items():
        lines.append(f"the head's step-time cost at budget 64, {key}: {100 * v:+.1f}%")
    return "\n".join(lines)


def plot_study(result: dict, path: str | None = None):
    """tau vs budget (chain dashed, marginal and conditional solid; a panel per temperature) and, with timing,
    tokens/s vs budget with the cost-aware budget as a horizontal line per tree. Saves to `path`; returns it."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, timing = result["rows"], result["timing"]
    temps = sorted({r["temperature"] for r in rows} | {r["temperature"] for r in timing})
    panels = 2 if timing else 1
    fig, axes = plt.subplots(panels, len(temps), figsize=(6 * len(temps), 4.3 * panels), squeeze=False)
    styles = {"marginal": ("C0", "o"), "conditional": ("C3", "s")}
    for j, temperature in enumerate(temps):
        ax = axes[0, j]
        for method, (colour, marker) in styles.items():
            sel = sorted(
                (r for r in rows if (r["method"], r["temperature"]) == (method, temperature)), key=lambda r: r["budget"]
            )
            ax.errorbar(
                [r["budget"] for r in sel],
                [r["mean_tau"] for r in sel],
                yerr=[r["se_tau"] for r in sel],
                color=colour,
                marker=marker,
                capsize=3,
                label=f"{method} DDTree",
            )
        chain = next((r for r in rows if (r["method"], r["temperature"]) == ("chain", temperature)), None)
        if chain:
            ax.axhline(chain["mean_tau"], color="k", linestyle="--", label="DFlash chain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (draft nodes)")
        ax.set_ylabel("tau (tokens per decode step)")
        ax.set_title(f"acceptance length, T = {temperature:g}")
        ax.legend(fontsize=8)
        if timing:
            ax = axes[1, j]
            for tree, (colour, marker) in styles.items():
                sel = sorted(
                    (
                        r
                        for r in timing
                        if (r["tree"], r["temperature"]) == (tree, temperature) and isinstance(r["budget"], int)
                    ),
                    key=lambda r: r["budget"],
                )
                ax.plot(
                    [r["budget"] for r in sel],
                    [r["tokens_per_s"] for r in sel],
                    color=colour,
                    marker=marker,
                    label=f"{tree} DDTree",
                )
                auto = next(
                    (r for r in timing if (r["tree"], r["temperature"], r["budget"]) == (tree, temperature, "auto")),
                    None,
                )
                if auto:
                    ax.axhline(auto["tokens_per_s"], color=colour, linestyle=":", label=f"{tree}, cost-aware budget")
            for method, style in (("ar", "-."), ("chain", "--")):
                r = next((r for r in timing if (r["method"], r["temperature"]) == (method, temperature)), None)
                if r:
                    ax.axhline(r["tokens_per_s"], color="k", linestyle=style, label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (draft nodes)")
            ax.set_ylabel("tokens/s (batch 1, end to end)")
            ax.set_title(f"throughput, T = {temperature:g}")
            ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pair",
        default=None,
        help="pair directory with target/, drafter/, child_head/ (default: $DDTREE_PAIR_DIR or checkpoints/embedded)",
    )
    parser.add_argument(
        "--budgets",
        type=budget_list,
        default=None,
        help="comma-separated, each in [1, 1024] (default 16,32,64,128,256)",
    )
    parser.add_argument("--temperatures", type=float_list, default=None, help="comma-separated (default 0,1)")
    parser.add_argument("--prompts", type=positive_int, default=None, help="held-out prompts (default 16)")
    parser.add_argument(
        "--samples", type=positive_int, default=None, help="generations per prompt at T > 0 (default 4)"
    )
    parser.add_argument("--timing", action="store_true", help="also tokens/s and the cost-aware budget (GPU)")
    parser.add_argument("--no-tau", action="store_true", help="skip the acceptance part (with --timing)")
    parser.add_argument(
        "--auto-budgets",
        type=increasing_budget_list,
        default=None,
        help="the cost-aware budget's set, increasing (default 16,32,64,128,256)",
    )
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed repeats per column (default 3)")
    parser.add_argument("--small", action="store_true", help="the seconds-on-CPU settings (tiny pairs, tests)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "auto"),
        help="the pair's weights (default float32; auto: the checkpoint's on GPU, bf16 for the embedded pair, as bench_e2e)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--commit", default=None, help="the code commit to record")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "conditional_study.json"))
    parser.add_argument("--plot", default=None, help="PNG (default: the JSON path with .png)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="conditional_study JSONs of the same pair and settings to merge into --out (no run: only --out and "
        "--plot go with it)",
    )
    args = parser.parse_args(argv)
    plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    for flag, path in (("--out", args.out), ("--plot", plot)):
        problem = output_problem(path)
        if problem:
            parser.error(f"{flag} {problem}")  # before the run, not after it
    if args.merge:
        import json

        run_only = [
            "--" + name.replace("_", "-")
            for name, value in vars(args).items()
            if name not in ("out", "plot", "merge") and value != parser.get_default(name)
        ]
        if run_only:
            parser.error(f"{', '.join(run_only)}: run settings, not used by --merge (it only combines the JSONs)")
        repeated = sorted({p for p in args.merge if args.merge.count(p) > 1})
        if repeated or len({os.path.realpath(p) for p in args.merge}) < len(args.merge):
            parser.error(f"--merge: a file given twice ({', '.join(repeated) or 'the same file by two paths'})")
        results = []
        for path in args.merge:
            try:
                with open(path) as f:
                    results.append(json.load(f))
            except (OSError, ValueError) as e:
                parser.error(f"--merge {path}: {e}")
        try:
            result = merge_results(results, args.merge)
        except ValueError as e:
            parser.error(f"--merge: {e}")
        print(format_table(result))
        write_json(result, args.out)
        plot_study(result, plot)
        print(f"wrote {args.out} and {plot}")
        return 0
    try:
        result = study(
            args.pair,
            small=args.small,
            budgets=args.budgets,  # parsed and checked by argparse (budget_list, float_list)
            temperatures=args.temperatures,
            num_prompts=args.prompts,
            samples=args.samples,
            tau=not args.no_tau,
            timing=args.timing,
            auto_budgets=args.auto_budgets,
            repeats=args.repeats,
            seed=args.seed,
            prompt_seed=args.prompt_seed,
            progress=not args.no_progress,
            commit=args.commit,
            on_partial=lambda partial: write_json(partial, args.out),
            dtype=args.dtype,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    write_json(result, args.out)
    plot_study(result, plot)
    print(f"wrote {args.out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
