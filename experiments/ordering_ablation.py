"""Sibling-order ablation on the trained pair: order x thresholds x temperature -> tau and the output law.

The source article (shared/seed) holds that siblings must be tried in descending draft probability, both
for correctness and for acceptance. Under exact target-only tree verification neither should hold: a
child is accepted with its target probability wherever it sits among its siblings, so the law of the
text and of the acceptance length are order-invariant (`notebooks/sampling_correctness.ipynb` proves it
and checks it on a Markov chain). Here the hypothesis meets the real pair. For every sibling order
(draft, reverse, random), threshold setting (exact: threshold_acc = threshold_single = 1; lossy:
threshold_acc 0.5, threshold_single 0.3, the documented lossy mode of `verify_step`) and temperature
(0.7, 1.0), on held-out prompts:

* tau: `tau_samples` generations of `tau_max_new` tokens per prompt (stopping at eos): mean tau with
  its standard error, and the mean exact-mode expectation E[tau | tree] of the steps taken.
* output law: `law_samples` independent generations of the first `law_tokens` (default 2) tokens per
  prompt (the first comes from prefill, the second from the first tree verification, so that is where
  an order effect would show). Two chi-square tests, each at a false-positive rate of ALPHA = 1e-3:
  - homogeneity across the three orders (per thresholds x temperature): a (order x category)
    contingency table, categories = (prompt, t1, t2), coarsened where the expected count is below 5
    to (prompt, t1, any), then (prompt, any), then one rest cell (the same coarsening for every order,
    computed from the pooled counts, so it is a fixed function of the output under the null);
  - goodness of fit of each configuration to the target's exact law of (t1, t2) given the prompt,
    computed from the target's processed next-token probabilities (forward passes on the prompt and on
    the prompt + each likely t1), cells coarsened by their exact expected counts; dof = sum over prompts
    of (cells - 1).
  Exact thresholds must show no order effect and fit the target's law: each test marks p < ALPHA (a
  1-in-1000 event per test if verification is exact), and the exact-threshold tests are also judged as one
  family at a family-wise rate of ALPHA (Bonferroni: each at ALPHA / their number), since a grid runs
  several of them (`exact_family`). Lossy thresholds change the law, and may by order.
* controls (the same tests must be able to fail): the exact draft-order samples at T = 0.7 against those at
  T = 1.0 (homogeneity) and against the T = 1.0 exact law (fit): a wrong-temperature comparison that must
  reject; and exact vs lossy (draft order, T = 1.0), which rejects when the lossy mode's bias is visible.

Every configuration has its own request ids (independent coins; seeds fixed, so reruns give the same
verdicts).

  python -m experiments.ordering_ablation                                  # checkpoints/embedded
  python -m experiments.ordering_ablation --small --target T --drafter D   # the seconds-on-CPU version
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import math
import os
import sys
import time

import jax
import numpy as np

from experiments.studies import (
    eos_stop_tokens,
    mean_and_se,
    output_problem,
    pooled_tau,
    progress_bar,
    setup,
    step_records,
    study_generate,
    write_json,
)

ORDERS = ("draft", "reverse", "random")
THRESHOLDS = {"exact": (1.0, 1.0), "lossy": (0.5, 0.3)}  # name -> (threshold_acc, threshold_single)
TEMPERATURES = (0.7, 1.0)
ALPHA = 1e-3  # false-positive rate of every chi-square test (as tests/stats_helpers.py)
MIN_EXPECTED = 5.0
FULL = dict(
    budget=64,
    num_prompts=16,
    prompt_len=128,
    tau_max_new=64,
    tau_samples=4,
    law_samples=2048,
    law_tokens=2,
    batch_size=1024,
)
# The seconds-on-CPU version (tests, DDTREE_NB_SMALL=1 notebooks): the budget sweep's SMALL shapes (128 rows per call,
# 24 new tokens, budget 16), so the exact program is shared with it.
SMALL = dict(
    budget=16,
    num_prompts=4,
    prompt_len=24,
    tau_max_new=24,
    tau_samples=32,
    law_samples=512,
    law_tokens=2,
    batch_size=128,
)
ID_STRIDE = 10_000_000  # request ids: configuration c uses [c * ID_STRIDE, (c + 1) * ID_STRIDE)
LAW_OFFSET = ID_STRIDE // 2


# --- statistics ------------------------------------------------------------------------------------------------------


def first_tokens(res: dict, num_prompts: int, law_tokens: int) -> collections.Counter:
    """Counts of (prompt, t_1, ..., t_k) over the rows of a law run (row r is prompt r % num_prompts)."""
    tokens = res["tokens"][:, :law_tokens]
    return collections.Counter((r % num_prompts,) + tuple(int(t) for t in row) for r, row in enumerate(tokens))


WILD = -2  # "any token" in a coarsened category (token ids are >= -1)


def projections(key: tuple) -> list[tuple]:
    """The categories an output (prompt, t1, ..., tk) can fall into, finest first: itself; (prompt, any, ..., tk)
    (the last token's law given the prompt, pooled over the earlier tokens); (prompt,); () (the rest)."""
    out = [key]
    if len(key) > 2:
        out.append(key[:1] + (WILD,) * (len(key) - 2) + key[-1:])
    return out + [key[:1], ()] if len(key) > 1 else out + [()]


def coarsen(groups: list[collections.Counter], min_expected: float = MIN_EXPECTED) -> dict:
    """Maps every observed output key to a category: the finest of `projections(key)` whose pooled count times the
    smallest group's share is >= min_expected (i.e. the expected count in every group under the null), cells
    being filled finest level first; the rest cell () takes what is left. One map for every group (it depends on
    the pooled counts only), so under the null it is a fixed function of each output."""
    sizes = [sum(g.values()) for g in groups]
    frac = min(sizes) / sum(sizes)
    pooled = collections.Counter()
    for g in groups:
        pooled.update(g)
    level = {k: 0 for k in pooled}
    depth = max((len(projections(k)) for k in pooled), default=1)
    for current in range(depth - 1):
        totals = collections.Counter()
        for k, v in pooled.items():
            totals[projections(k)[level[k]]] += v
        for k in pooled:
            if level[k] == current and totals[projections(k)[current]] * frac < min_expected:
                level[k] = current + 1
    return {k: projections(k)[level[k]] for k in pooled}


def homogeneity_test(groups: list[collections.Counter], min_expected: float = MIN_EXPECTED) -> dict:
    """Chi-square test that the groups' counts come from one distribution (scipy's chi2_contingency, no
    continuity correction) over the `coarsen`ed categories. p = 1 with fewer than two categories."""
    from scipy import stats

    mapping = coarsen(groups, min_expected)
    cats = sorted(set(mapping.values()), key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(cats)}
    table = np.zeros((len(groups), len(cats)))
    for gi, g in enumerate(groups):
        for k, v in g.items():
            table[gi, index[mapping[k]]] += v
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return {"stat": 0.0, "dof": 0, "p": 1.0, "categories": int(table.shape[1]), "exact_cells": 0}
    stat, p, dof, _ = stats.chi2_contingency(table, correction=False)
    exact_cells = sum(1 for c in cats if len(c) > 1 and WILD not in c)  # categories that are one full output
    return {
        "stat": float(stat),
        "dof": int(dof),
        "p": float(p),
        "categories": int(table.shape[1]),
        "exact_cells": exact_cells,
    }


@functools.partial(jax.jit, static_argnames=("config",))
def _next_token_probs(config, params, ids, sampling):
    """The target's processed probabilities of the token after each row of ids [B, T] (a plain forward)."""
    from ddtree_jax.models import target_module
    from ddtree_jax.sampling import processed_probs

    return processed_probs(target_module(config).forward_logits(config, params, ids)[:, -1], sampling)


def exact_law_cells(
    pair,
    prompt_ids: list[list[int]],
    *,
    temperature: float,
    samples_per_prompt: int,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_expected: float = MIN_EXPECTED,
    chunk: int = 256,
) -> list[dict]:
    """The target's exact law of the first two sampled tokens on categories, per prompt: {(t1, t2): q1(t1) q2(t2|t1)}
    where the expected count (of `samples_per_prompt` draws) is >= min_expected; {(WILD, t2): the mass of t2 over
    the other t1} where that is >= min_expected; {(): the rest}. q are the target's processed probabilities
    (`processed_probs`: temperature and filters), from plain forward passes on the prompt and on the prompt + t1
    for every t1 of positive probability (V passes per prompt without filters: cheap for the embedded pair)."""
    import jax.numpy as jnp

    from ddtree_jax.sampling import SamplingParams

    def probs(seqs: list[list[int]]) -> np.ndarray:
        real = len(seqs)
        seqs = seqs + [seqs[-1]] * (-real % chunk if real > 1 else 0)  # one compiled shape per chunk size
        sp = SamplingParams.create(len(seqs), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        out = _next_token_probs(pair.target_config, pair.target_params, jnp.asarray(seqs, jnp.int32), sp)
        return np.asarray(out, np.float64)[:real]

    n = float(samples_per_prompt)
    out = []
    for ids in prompt_ids:
        q1 = probs([list(ids)])[0]
        cells: dict[tuple, float] = {}
        leftover = np.zeros_like(q1)  # per t2: mass of (t1, t2) pairs below min_expected
        support = [int(t) for t in np.flatnonzero(q1 > 0)]
        for i in range(0, len(support), chunk):
            t1s = support[i : i + chunk]
            joint = q1[t1s, None] * probs([list(ids) + [t] for t in t1s])
            keep = n * joint >= min_expected
            for r, c in zip(*np.nonzero(keep)):
                cells[(t1s[r], int(c))] = float(joint[r, c])
            leftover += np.where(keep, 0.0, joint).sum(axis=0)
        for t2 in np.flatnonzero(n * leftover >= min_expected):
            cells[(WILD, int(t2))] = float(leftover[t2])
        cells[()] = max(0.0, 1.0 - sum(cells.values()))
        out.append(cells)
    return out


def fit_test(counts: collections.Counter, law: list[dict], samples_per_prompt: int) -> dict:
    """Chi-square goodness of fit of law-run counts {(prompt, t1, t2): n} to `exact_law_cells`: an observation
    goes to its (t1, t2) cell, else its (any, t2) cell, else the prompt's rest cell (merged into the prompt's
    smallest cell when its expected count is below min_expected); dof = sum over prompts of (cells - 1)."""
    from scipy import stats

    obs_all, exp_all, dof = [], [], 0
    for p, cells in enumerate(law):
        keys = list(cells)
        target_of = {k: k for k in keys}
        if samples_per_prompt * cells[()] < MIN_EXPECTED and len(keys) > 1:
            target_of[()] = min((k for k in keys if k != ()), key=lambda k: cells[k])
        final = sorted(set(target_of.values()), key=lambda c: (len(c), c))
        index = {c: i for i, c in enumerate(final)}
        expected = np.zeros(len(final))
        for k, q in cells.items():
            expected[index[target_of[k]]] += q * samples_per_prompt
        observed = np.zeros(len(final))
        for key, v in counts.items():
            if key[0] != p:
                continue
            t = key[1:]
            cell = t if t in cells else ((WILD,) + t[1:] if (WILD,) + t[1:] in cells else ())
            observed[index[target_of[cell]]] += v
        if observed.sum() != samples_per_prompt:
            raise ValueError(f"prompt {p}: {observed.sum()} observations, expected {samples_per_prompt}")
        obs_all.append(observed)
        exp_all.append(expected)
        dof += len(final) - 1
    obs, exp = np.concatenate(obs_all), np.concatenate(exp_all)
    if dof == 0:
        return {"stat": 0.0, "dof": 0, "p": 1.0, "cells": int(len(obs))}
    if (obs[exp == 0] > 0).any():
        return {"stat": float("inf"), "dof": dof, "p": 0.0, "cells": int(len(obs))}
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return {"stat": stat, "dof": int(dof), "p": float(stats.chi2.sf(stat, dof)), "cells": int(len(obs))}


# --- the ablation ----------------------------------------------------------------------------------------------------


def config_list(orders=ORDERS, thresholds=None, temperatures=TEMPERATURES) -> list[dict]:
    thresholds = THRESHOLDS if thresholds is None else thresholds
    return [
        {
            "thresholds": name,
            "threshold_acc": float(acc),
            "threshold_single": float(single),
            "temperature": float(t),
            "order": order,
        }
        for name, (acc, single) in thresholds.items()
        for t in temperatures
        for order in orders
    ]


def run_ablation(
    pair,
    prompt_ids: list[list[int]],
    *,
    orders=ORDERS,
    thresholds=None,
    temperatures=TEMPERATURES,
    budget: int = 64,
    tau_max_new: int = 64,
    tau_samples: int = 4,
    law_samples: int = 2048,
    law_tokens: int = 2,
    seed: int = 0,
    batch_size: int | None = 1024,
    alpha: float = ALPHA,
    fit: bool = True,
    progress: bool = True,
) -> dict:
    """Runs every configuration (module docstring) and the tests; returns rows, tests, controls and settings.

    Runs with the same thresholds share one compiled program: order and temperature are runtime inputs and the law
    runs reuse the tau runs' shapes (`batch_size` rows per call, `row_max_new` = law_tokens)."""
    num_prompts = len(prompt_ids)
    configs = config_list(orders, thresholds, temperatures)
    stop = eos_stop_tokens(pair)
    rows, counts = [], {}
    bar = progress_bar(len(configs), "ordering ablation", progress)
    began = time.perf_counter()
    try:
        # thresholds outermost: runs with the same thresholds share one compiled program
        for ci, cfg in sorted(enumerate(configs), key=lambda x: x[1]["thresholds"]):
            bar.set_description(f"{cfg['thresholds']} T={cfg['temperature']:g} {cfg['order']}")
            common = dict(
                method="ddtree",
                budget=budget,
                max_new_tokens=tau_max_new,
                temperature=cfg["temperature"],
                seed=seed,
                order=cfg["order"],
                threshold_acc=cfg["threshold_acc"],
                threshold_single=cfg["threshold_single"],
                batch_size=batch_size,
            )
            tau_rows = prompt_ids * tau_samples
            res = study_generate(
                pair, tau_rows, stop_tokens=stop, request_ids=ci * ID_STRIDE + np.arange(len(tau_rows)), **common
            )
            rec = step_records(res)
            tau_mean, tau_se = mean_and_se(res["tau"])
            law_rows = prompt_ids * law_samples
            law = study_generate(
                pair,
                law_rows,
                row_max_new=law_tokens,
                request_ids=ci * ID_STRIDE + LAW_OFFSET + np.arange(len(law_rows)),
                **common,
            )
            key = (cfg["thresholds"], cfg["temperature"], cfg["order"])
            counts[key] = first_tokens(law, num_prompts, law_tokens)
            rows.append(
                {
                    **cfg,
                    "mean_tau": tau_mean,
                    "se_tau": tau_se,
                    "pooled_tau": pooled_tau(res),
                    "step_expected_mean": float(rec["expected"].mean()),
                    "step_measured_mean": float(rec["measured"].mean()),
                    "decode_steps": int(res["steps"].sum()),
                    "law_draws": int(sum(counts[key].values())),
                    "distinct_outputs": len(counts[key]),
                }
            )
            bar.update(1)
    finally:
        bar.close()
    rows.sort(
        key=lambda r: [(c["thresholds"], c["temperature"], c["order"]) for c in configs].index(
            (r["thresholds"], r["temperature"], r["order"])
        )
    )

    tests = []
    for name in thresholds if thresholds is not None else THRESHOLDS:
        for t in temperatures:
            present = [o for o in orders if (name, float(t), o) in counts]
            if len(present) < 2:
                continue
            h = homogeneity_test([counts[(name, float(t), o)] for o in present])
            tau = [r for r in rows if r["thresholds"] == name and r["temperature"] == float(t)]
            tests.append(
                {
                    "test": "order homogeneity",
                    "thresholds": name,
                    "temperature": float(t),
                    "orders": present,
                    **h,
                    "alpha": alpha,
                    "reject": h["p"] < alpha,
                    "tau_spread_z": _max_pairwise_z(tau),
                }
            )
    if fit and law_tokens == 2:
        laws = {}
        for r in rows:
            t = r["temperature"]
            if t not in laws:
                laws[t] = exact_law_cells(pair, prompt_ids, temperature=t, samples_per_prompt=law_samples)
            f = fit_test(counts[(r["thresholds"], t, r["order"])], laws[t], law_samples)
            r.update(fit_stat=f["stat"], fit_dof=f["dof"], fit_p=f["p"], fit_reject=f["p"] < alpha)
        fit_laws = laws
    else:
        fit_laws = {}
    controls = []
    exact_name = next(
        (n for n, th in (thresholds if thresholds is not None else THRESHOLDS).items() if tuple(th) == (1.0, 1.0)), None
    )
    if exact_name is not None and "draft" in orders and len(temperatures) >= 2:
        lo, hi = float(min(temperatures)), float(max(temperatures))
        a, b = counts.get((exact_name, lo, "draft")), counts.get((exact_name, hi, "draft"))
        if a is not None and b is not None:
            h = homogeneity_test([a, b])
            controls.append(
                {
                    "control": f"wrong temperature: exact draft-order samples at T={lo:g} vs T={hi:g}",
                    "test": "homogeneity",
                    "must_reject": True,
                    **h,
                    "reject": h["p"] < alpha,
                }
            )
            if hi in fit_laws:
                f = fit_test(a, fit_laws[hi], law_samples)
                controls.append(
                    {
                        "control": f"wrong temperature: exact draft-order samples at T={lo:g} against the "
                        f"target's law at T={hi:g}",
                        "test": "fit",
                        "must_reject": True,
                        **f,
                        "reject": f["p"] < alpha,
                    }
                )
    for name, th in (thresholds if thresholds is not None else THRESHOLDS).items():
        if exact_name is None or name == exact_name:
            continue
        hi = float(max(temperatures))
        a, b = counts.get((exact_name, hi, "draft")), counts.get((name, hi, "draft"))
        if a is not None and b is not None:
            h = homogeneity_test([a, b])
            controls.append(
                {
                    "control": f"{exact_name} vs {name} thresholds {tuple(th)} (draft order, T={hi:g})",
                    "test": "homogeneity",
                    "must_reject": False,
                    **h,
                    "reject": h["p"] < alpha,
                }
            )
    exact_family = None
    if exact_name is not None:
        ps = [t["p"] for t in tests if t["thresholds"] == exact_name] + [
            r["fit_p"] for r in rows if r["thresholds"] == exact_name and "fit_p" in r
        ]
        if ps:
            exact_family = {
                "thresholds": exact_name,
                "tests": len(ps),
                "alpha_per_test": alpha / len(ps),
                "min_p": float(min(ps)),
                "reject": bool(min(ps) < alpha / len(ps)),
            }
    return {
        "rows": rows,
        "tests": tests,
        "controls": controls,
        "alpha": alpha,
        "exact_family": exact_family,
        "wall_s": round(time.perf_counter() - began, 2),
        "settings": {
            "orders": list(orders),
            "thresholds": {k: list(v) for k, v in (thresholds if thresholds is not None else THRESHOLDS).items()},
            "temperatures": [float(t) for t in temperatures],
            "budget": budget,
            "tau_max_new": tau_max_new,
            "tau_samples": tau_samples,
            "law_samples": law_samples,
            "law_tokens": law_tokens,
            "seed": seed,
            "batch_size": batch_size,
            "num_prompts": num_prompts,
            "min_expected": MIN_EXPECTED,
            "stop_tokens": stop,
        },
    }


def _max_pairwise_z(rows: list[dict]) -> float:
    """The largest |difference of mean tau| / its standard error over pairs of orders (informative only)."""
    z = 0.0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            se = np.hypot(rows[i]["se_tau"], rows[j]["se_tau"])
            if se > 0:
                z = max(z, abs(rows[i]["mean_tau"] - rows[j]["mean_tau"]) / se)
    return float(z)


def format_table(result: dict) -> str:
    """Markdown: the configurations, then the tests and controls with their verdicts at ALPHA."""
    alpha = result["alpha"]
    head = ["thresholds", "T", "order", "mean tau", "+- se", "exact E[tau]", "fit p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        fit = f"{r['fit_p']:.3g}{' *' if r['fit_reject'] else ''}" if "fit_p" in r else "-"
        lines.append(
            f"| {r['thresholds']} ({r['threshold_acc']:g}/{r['threshold_single']:g}) | {r['temperature']:g} | "
            f"{r['order']} | {r['mean_tau']:.3f} | {r['se_tau']:.3f} | {r['step_expected_mean']:.3f} | {fit} |"
        )
    lines += [
        "",
        f"Order homogeneity of the first {result['settings']['law_tokens']} tokens "
        f"(chi-square, ALPHA = {alpha:g} per test; * = rejected):",
        "",
        "| thresholds | T | chi2 | dof | p | verdict | max tau z between orders |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result["tests"]:
        lines.append(
            f"| {t['thresholds']} | {t['temperature']:g} | {t['stat']:.1f} | {t['dof']} | {t['p']:.3g} | "
            f"{'order effect *' if t['reject'] else 'no order effect'} | {t['tau_spread_z']:.2f} |"
        )
    fam = result.get("exact_family")
    if fam:
        lines += [
            "",
            f"All {fam['tests']} {fam['thresholds']}-threshold tests as one family (Bonferroni, family-wise rate "
            f"{alpha:g}: each at {fam['alpha_per_test']:.2g}): smallest p = {fam['min_p']:.3g} -> "
            f"{'REJECTED: verification is not exact' if fam['reject'] else 'not rejected'}",
        ]
    if result["controls"]:
        lines += ["", "Controls:", ""]
        for c in result["controls"]:
            want = "must reject" if c["must_reject"] else "may reject"
            lines.append(
                f"- {c['control']}: {c['test']} p = {c['p']:.3g} -> {'rejected' if c['reject'] else 'not rejected'}"
                f" ({want})"
            )
    return "\n".join(lines)


def study_settings(small: bool, overrides: dict) -> dict:
    """FULL (or SMALL) updated by the `overrides` that are set, checked: the law's first tokens lie within the
    generations (law_tokens <= tau_max_new; else a ValueError before any model runs)."""
    s = {**(SMALL if small else FULL), **{k: v for k, v in overrides.items() if v is not None}}
    if s["law_tokens"] > s["tau_max_new"]:
        raise ValueError(
            f"--law-tokens {s['law_tokens']}: at most --tau-max-new ({s['tau_max_new']}), the generations' length"
        )
    return s


def ablation(
    target_dir: str | None = None,
    drafter_dir: str | None = None,
    *,
    small: bool = False,
    orders=ORDERS,
    thresholds=None,
    temperatures=TEMPERATURES,
    seed: int = 0,
    prompt_seed: int = 0,
    fit: bool = True,
    progress: bool = True,
    commit: str | None = None,
    **overrides,
) -> dict:
    """The whole study from checkpoint directories; settings from FULL (or SMALL) updated by `overrides`
    (budget, num_prompts, prompt_len, tau_max_new, tau_samples, law_samples, law_tokens, batch_size)."""
    s = study_settings(small, overrides)
    pair, prompts, summary = setup(
        target_dir,
        drafter_dir,
        num_prompts=s["num_prompts"],
        prompt_len=s["prompt_len"],
        max_new=s["tau_max_new"],
        prompt_seed=prompt_seed,
    )
    result = run_ablation(
        pair,
        [p["ids"] for p in prompts],
        orders=orders,
        thresholds=thresholds,
        temperatures=temperatures,
        budget=s["budget"],
        tau_max_new=s["tau_max_new"],
        tau_samples=s["tau_samples"],
        law_samples=s["law_samples"],
        law_tokens=s["law_tokens"],
        seed=seed,
        batch_size=s["batch_size"],
        fit=fit,
        progress=progress,
    )
    from experiments.budget_sweep import device_label

    result.update(
        study="ordering_ablation",
        commit=commit,
        device=device_label(),
        pair=summary,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        prompts=[{k: p[k] for k in ("path", "char", "ids")} for p in prompts],
        settings={**result["settings"], "prompt_len": s["prompt_len"], "prompt_seed": prompt_seed},
    )
    return result


def main(argv=None) -> int:
    from experiments.studies import pair_dirs

    target, drafter = pair_dirs()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=target)
    parser.add_argument("--drafter", default=drafter)
    parser.add_argument("--small", action="store_true", help="the seconds-on-CPU settings (tiny pairs, tests)")
    parser.add_argument("--orders", default=",".join(ORDERS))
    parser.add_argument("--temperatures", default=",".join(f"{t:g}" for t in TEMPERATURES))
    parser.add_argument(
        "--lossy", default="0.5,0.3", help="threshold_acc,threshold_single of the lossy setting ('none' for exact only)"
    )
    for name in (
        "budget",
        "prompts",
        "prompt-len",
        "tau-max-new",
        "tau-samples",
        "law-samples",
        "law-tokens",
        "batch-size",
    ):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--no-fit", action="store_true", help="skip the goodness-of-fit tests to the exact law")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "ordering_ablation.json"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    # every argument is checked here, before any model runs (a bad entry late in a list used to fail only after
    # the earlier configurations ran)
    orders = tuple(o.strip() for o in args.orders.split(","))
    bad = [o for o in orders if o not in ORDERS]
    if bad:
        parser.error(f"--orders: unknown order(s) {', '.join(map(repr, bad))}; choose from {', '.join(ORDERS)}")
    if len(set(orders)) != len(orders):
        # a repeated order overwrote the first run's counts, so the homogeneity test compared an order with itself
        parser.error(f"--orders {args.orders!r}: each order may appear only once")
    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        parser.error(f"--temperatures {args.temperatures!r}: expected comma-separated numbers, e.g. 0.5,1")
    if any(not math.isfinite(t) or t < 0 for t in temperatures) or len(set(temperatures)) != len(temperatures):
        parser.error(f"--temperatures {args.temperatures!r}: expected distinct finite temperatures >= 0")
    for name in (
        "budget",
        "prompts",
        "prompt_len",
        "tau_max_new",
        "tau_samples",
        "law_samples",
        "law_tokens",
        "batch_size",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    try:
        study_settings(args.small, {k: v for k, v in vars(args).items() if k in FULL})
    except ValueError as e:
        parser.error(str(e))
    thresholds = {"exact": (1.0, 1.0)}
    if args.lossy != "none":
        parts = args.lossy.split(",")
        try:
            acc, single = (float(x) for x in parts)
        except ValueError:
            parser.error(
                f"--lossy {args.lossy!r}: expected 'THRESHOLD_ACC,THRESHOLD_SINGLE' (two numbers, e.g. 0.5,0.3) "
                "or 'none'"
            )
        if not (0.0 < acc <= 1.0 and 0.0 < single <= 1.0):
            parser.error(f"--lossy {args.lossy!r}: both thresholds must be in (0, 1]")
        thresholds["lossy"] = (acc, single)
    problem = output_problem(args.out)
    if problem:
        parser.error(f"--out {problem}")
    try:
        result = ablation(
            args.target,
            args.drafter,
            small=args.small,
            orders=orders,
            thresholds=thresholds,
            temperatures=temperatures,
            seed=args.seed,
            prompt_seed=args.prompt_seed,
            fit=not args.no_fit,
            progress=not args.no_progress,
            commit=args.commit,
            budget=args.budget,
            num_prompts=args.prompts,
            prompt_len=args.prompt_len,
            tau_max_new=args.tau_max_new,
            tau_samples=args.tau_samples,
            law_samples=args.law_samples,
            law_tokens=args.law_tokens,
            batch_size=args.batch_size,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
