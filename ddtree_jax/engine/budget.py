"""Start-up fitting of the cost-aware budget (`options.BudgetPolicy`, issue #23): the step time of each budget
measured on this device, and the surrogate's calibration measured on real prompts.

  measure_step_ms    per budget: one compiled fixed-budget generation run twice per repeat, every row stopped
                     after `short` and after `long` new tokens (the per-row max_new: one program); the step time
                     is the difference of the two wall times over the difference of their loop iterations, so
                     the prefill, the compile and the host round trip of the call cancel out (after one untimed
                     call of each: `time_short_long`).
  calibrate_scale    one generation at the largest budget; each step's sub-tree surrogates and the draft tokens
                     each sub-tree would have accepted (`tree.budget.prefix_accepted`: exact at T = 0, coupled
                     to the same coins at T > 0) give scale_b = sum(accepted_b) / sum(surrogate_b - 1): the
                     surrogate's excess over one token is, on this pair and temperature, off by that factor.
                     Times that fall with the budget (noise) are pooled into a non-decreasing fit.
  fit_budget_policy  both: the `BudgetPolicy` and a report of what was measured.

The policy is fitted per (pair, device, temperature, batch size): step times depend on the device and the
batch, the calibration on the temperature and the prompts' domain.
"""

from __future__ import annotations

import functools
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.engine.generate import generate, generate_recorded
from ddtree_jax.engine.run import Pair, generate_static, request_args, resolve_block_size
from ddtree_jax.engine.step import StepTrace
from ddtree_jax.options import BudgetPolicy, DecodeOptions, check_budgets
from ddtree_jax.tree.budget import prefix_accepted, prefix_surrogates

DEFAULT_BUDGETS = (8, 16, 32, 64, 128)


def _request(pair: Pair, prompt_ids, *, temperature: float, seed: int, max_new_tokens: int, stop_tokens=()):
    return request_args(
        pair, prompt_ids, temperature=temperature, seed=seed, stop_tokens=stop_tokens, max_new_tokens=max_new_tokens
    )


def time_short_long(run, short_args, long_args, repeats: int) -> tuple[list[float], list[float]]:
    """(per-repeat step ms by difference, per-repeat long-run mean ms): `run(args)` returns a generation result
    (with `.steps`); each repeat times the short and the long call. One untimed call of each comes first: a
    program's first execution carries one-time costs (on the GPU the command buffers' instantiation, module
    loading) that would otherwise land on the first short call and shrink its difference (measured on the H200:
    0.01-0.12 ms/step on the first repeat against 0.72-0.92 on the second, the loop's own step 0.76-0.94 ms)."""
    for call_args in (short_args, long_args):
        jax.block_until_ready(run(call_args))
    per_repeat, long_means = [], []
    for _ in range(max(repeats, 1)):
        runs = []
        for call_args in (short_args, long_args):
            start = time.perf_counter()
            result = jax.block_until_ready(run(call_args))
            runs.append((time.perf_counter() - start, int(np.asarray(result.steps).max())))
        (t_short, n_short), (t_long, n_long) = runs
        long_means.append(1e3 * t_long / max(n_long, 1))
        if n_long > n_short:
            per_repeat.append(1e3 * (t_long - t_short) / (n_long - n_short))
    return per_repeat, long_means


def measure_step_ms(
    pair: Pair,
    prompt_ids: list[list[int]],
    budgets=DEFAULT_BUDGETS,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    short: int = 8,
    long: int = 64,
    repeats: int = 3,
    options: DecodeOptions = DecodeOptions(),
    progress=None,
) -> tuple[tuple[float, ...], list[dict]]:
    """(step_ms per budget, details per budget): the DDTree decode step's time at each budget for this batch of
    prompts (module docstring; no stop tokens, so the lengths are exactly `short` and `long`). The median of
    `repeats` differences is kept; where it is not positive (timer noise above the signal: tiny models, CPU) the
    long run's mean step time stands in, with a warning and `estimate` in the details; the returned times are the
    non-decreasing fit over the budgets (`monotone_fit`; each detail keeps its raw `step_ms` and `fitted_ms`)."""
    budgets = check_budgets(budgets)
    if not 1 <= short < long:
        raise ValueError(f"need 1 <= short < long, got short={short}, long={long}")
    options = options.replace(budget_policy=None)
    args = _request(pair, prompt_ids, temperature=temperature, seed=seed, max_new_tokens=long)
    batch = len(prompt_ids)
    short_args = args[:-1] + (jnp.full((batch,), short, jnp.int32),)
    raw_ms, details = [], []
    for budget in budgets:
        static = generate_static(
            pair,
            method="ddtree",
            budget=budget,
            block_size=resolve_block_size(pair, "ddtree", None),
            max_new_tokens=long,
            options=options,
        )
        compiled = generate.lower(*args, **static).compile()
        per_repeat, long_means = time_short_long(lambda call_args: compiled(*call_args[1:]), short_args, args, repeats)
        if not per_repeat:
            raise ValueError(
                f"budget {budget}: the long run took no more decode steps than the short one; raise `long` ({long})"
            )
        ms, estimate = float(np.median(per_repeat)), "difference"
        if ms <= 0:  # the timer's noise exceeds the (long - short) steps' time: an upper bound instead, said so
            ms, estimate = float(np.median(long_means)), "long_run_mean"
            warnings.warn(
                f"budget {budget}: the step time by difference was not positive ({np.median(per_repeat):.4f} ms: "
                f"noise above the signal); using the long run's mean {ms:.4f} ms per step (prefill included). "
                f"Raise `long` ({long}) or `repeats` ({repeats}) for a real measurement.",
                stacklevel=2,
            )
        raw_ms.append(ms)
        details.append(
            {
                "budget": budget,
                "step_ms": ms,
                "estimate": estimate,
                "repeats_ms": [round(x, 4) for x in per_repeat],
            }
        )
        if progress is not None:
            progress(f"budget {budget}: {ms:.3f} ms/step")
    step_ms = monotone_fit(raw_ms)
    for detail, fitted in zip(details, step_ms):
        detail["fitted_ms"] = fitted
    return tuple(step_ms), details


def monotone_fit(values) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a larger tree never costs less
    per step, so timer noise that says otherwise is averaged out rather than trusted. Positive in, positive out."""
    blocks = []  # [mean, count] per pooled block
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return tuple(m for m, c in blocks for _ in range(c))


def _calibration_record(trace: StepTrace, sampling, *, budgets: tuple[int, ...]) -> dict:
    """Per row and step: the sub-tree surrogates [B, K], the draft tokens each sub-tree accepts [B, K], active."""
    del sampling
    return {
        "surrogate": prefix_surrogates(trace.tree, budgets),
        "accepted": prefix_accepted(trace.result.accept_index, trace.result.num_accepted, budgets),
        "active": trace.active,
    }


def calibrate_scale(
    pair: Pair,
    prompt_ids: list[list[int]],
    budgets=DEFAULT_BUDGETS,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    stop_tokens=(),
    options: DecodeOptions = DecodeOptions(),
) -> tuple[tuple[float, ...], dict]:
    """(scale per budget, details): the surrogate's calibration from one generation at the largest budget
    (module docstring). details: steps used, and per budget the mean surrogate and mean accepted + 1."""
    budgets = check_budgets(budgets)
    args = _request(
        pair, prompt_ids, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens
    )
    static = generate_static(
        pair,
        method="ddtree",
        budget=budgets[-1],
        block_size=resolve_block_size(pair, "ddtree", None),
        max_new_tokens=max_new_tokens,
        options=options.replace(budget_policy=None),
    )
    recorder = functools.partial(_calibration_record, budgets=budgets)
    _, records = jax.device_get(generate_recorded(*args, recorder=recorder, **static))
    active = np.asarray(records["active"], bool)  # [S, B]
    surrogate = np.asarray(records["surrogate"], np.float64)[active]  # [n, K]
    accepted = np.asarray(records["accepted"], np.float64)[active]
    if len(surrogate) == 0:
        raise ValueError("the calibration run took no decode step: use longer max_new_tokens or other prompts")
    excess = (surrogate - 1.0).sum(axis=0)
    scale = np.where(excess > 0, accepted.sum(axis=0) / np.maximum(excess, 1e-12), 1.0)
    scale = np.maximum(scale, 1e-3)  # a policy's scales are > 0 (a budget whose trees never paid: tiny)
    details = {
        "steps": int(len(surrogate)),
        "per_budget": [
            {
                "budget": b,
                "surrogate_mean": float(surrogate[:, k].mean()),
                "measured_mean": float(accepted[:, k].mean() + 1.0),
                "scale": float(scale[k]),
            }
            for k, b in enumerate(budgets)
        ],
    }
    return tuple(float(s) for s in scale), details


def fit_budget_policy(
    pair: Pair,
    prompt_ids: list[list[int]],
    budgets=DEFAULT_BUDGETS,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    calibration_tokens: int = 64,
    stop_tokens=(),
    short: int = 8,
    long: int = 64,
    repeats: int = 3,
    options: DecodeOptions = DecodeOptions(),
    progress=None,
    calibration_prompt_ids: list[list[int]] | None = None,
) -> tuple[BudgetPolicy, dict]:
    """(the `BudgetPolicy`, a report): step times per budget measured on this device for this batch, and the
    surrogate's calibration on these prompts (or on `calibration_prompt_ids`, e.g. more prompts than the batch
    the policy will serve) at this temperature. A run with the policy passes `options.replace(budget_policy=
    policy)` and `budget=policy.max_budget`."""
    began = time.perf_counter()
    scale, calibration = calibrate_scale(
        pair,
        prompt_ids if calibration_prompt_ids is None else calibration_prompt_ids,
        budgets,
        temperature=temperature,
        seed=seed,
        max_new_tokens=calibration_tokens,
        stop_tokens=stop_tokens,
        options=options,
    )
    step_ms, timing = measure_step_ms(
        pair,
        prompt_ids,
        budgets,
        temperature=temperature,
        seed=seed,
        short=short,
        long=long,
        repeats=repeats,
        options=options,
        progress=progress,
    )
    policy = BudgetPolicy(budgets=check_budgets(budgets), step_ms=step_ms, scale=scale)
    report = {
        "budgets": list(policy.budgets),
        "step_ms": list(policy.step_ms),
        "scale": list(policy.scale),
        "calibration": calibration,
        "timing": timing,
        "temperature": float(temperature),
        "batch": len(prompt_ids),
        "fit_s": round(time.perf_counter() - began, 2),
    }
    return policy, report
