"""The cost-aware budget in the engine: a policy that must pick budget b generates exactly what the fixed
budget b generates (same keys, T = 0 and T = 1); a real choice varies per step and stays greedy-exact; the
start-up fit measures positive step times and a calibration on the tiny random pair."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine import budget as budget_module
from ddtree_jax.engine.budget import fit_budget_policy, monotone_fit, time_short_long
from ddtree_jax.engine.run import random_tiny_pair
from ddtree_jax.options import BudgetPolicy, DecodeOptions
from tests.engine.test_generate import DFLASH, LENGTHS, PROMPTS, _run


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_policy_forced_to_one_budget_generates_what_that_budget_generates(temperature):
    budgets, forced = (2, 4, 8), 1
    step_ms = tuple(0.01 if k == forced else 100.0 for k in range(len(budgets)))  # budget 4: far cheapest
    policy = BudgetPolicy(budgets, step_ms, (1.0,) * len(budgets))
    got, records = _run(
        DFLASH,
        PROMPTS,
        LENGTHS,
        method="ddtree",
        temperature=temperature,
        budget=8,
        recorder=_budget_record,
        options=DecodeOptions(budget_policy=policy),
    )
    # the choice itself, every active step: the outputs alone cannot show it at T = 0 with this drafter (greedy
    # text is the same at every budget, and it accepts too little for the steps to differ between 4 and 8)
    chosen = np.asarray(records["budget"])[np.asarray(records["active"])]
    assert chosen.size and set(chosen.tolist()) == {budgets[forced]}, chosen
    want = _run(DFLASH, PROMPTS, LENGTHS, method="ddtree", temperature=temperature, budget=budgets[forced])
    for name in ("tokens", "num_generated", "steps", "accepted"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


def _budget_record(trace, sampling):
    return {"budget": jnp.broadcast_to(trace.budget, trace.active.shape), "active": trace.active}


def test_a_real_choice_varies_per_step_and_keeps_greedy_text(ar_greedy_tokens):
    """Step times that make the large budget pay only when the surrogate is high: the chosen budget changes
    between steps, and greedy text still equals AR's."""
    policy = BudgetPolicy((1, 8), (1.0, 2.3), (1.0, 1.0))  # the batch's S_8 / S_1 runs 1.9 .. 2.5
    result, records = _run(
        DFLASH,
        PROMPTS,
        LENGTHS,
        method="ddtree",
        max_new=12,
        recorder=_budget_record,
        options=DecodeOptions(budget_policy=policy),
    )
    chosen = np.asarray(records["budget"])[np.asarray(records["active"]).any(axis=1), 0]
    assert set(chosen.tolist()) == {1, 8}, chosen
    np.testing.assert_array_equal(np.asarray(result.tokens), ar_greedy_tokens)


@pytest.fixture(scope="module")
def ar_greedy_tokens():
    return np.asarray(_run(None, PROMPTS, LENGTHS, method="ar", max_new=12).tokens)


def test_a_policy_needs_ddtree_at_its_largest_budget():
    policy = BudgetPolicy((2, 4), (1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="largest budget 4; got method 'ddtree', budget 8"):
        _run(DFLASH, PROMPTS, LENGTHS, method="ddtree", budget=8, options=DecodeOptions(budget_policy=policy))


def test_monotone_fit_pools_what_falls_with_the_budget():
    assert monotone_fit([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == pytest.approx((1.0, 2.5, 2.5, 4.0))
    assert monotone_fit([5.0, 1.0, 0.5]) == pytest.approx((6.5 / 3,) * 3)
    rng = np.random.default_rng(0)
    values = rng.uniform(0.1, 2.0, size=9)
    fitted = np.asarray(monotone_fit(values))
    assert np.all(np.diff(fitted) >= 0) and fitted.sum() == pytest.approx(values.sum())  # blocks keep their mean


def test_the_start_up_fit_measures_step_times_and_calibrates_the_surrogate():
    pair = random_tiny_pair(seed=0, vocab=64)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    policy, report = fit_budget_policy(pair, prompts, (2, 6), short=2, long=6, repeats=1, calibration_tokens=8)
    assert policy.budgets == (2, 6) and policy.max_budget == 6
    assert all(ms > 0 for ms in policy.step_ms) and all(s > 0 for s in policy.scale)
    assert list(policy.step_ms) == sorted(policy.step_ms)  # the non-decreasing fit
    assert all(d["estimate"] in ("difference", "long_run_mean") and d["step_ms"] > 0 for d in report["timing"])
    assert report["calibration"]["steps"] > 0
    # the calibration is the ratio of what the sub-trees accepted to their surrogates' excess
    for row in report["calibration"]["per_budget"]:
        excess = row["surrogate_mean"] - 1.0
        if excess > 0:
            assert row["scale"] == pytest.approx((row["measured_mean"] - 1.0) / excess, rel=1e-6, abs=1e-3)
    # at T = 0 a sub-tree accepts the greedy path's part inside it: never more than a larger sub-tree
    measured = [row["measured_mean"] for row in report["calibration"]["per_budget"]]
    assert measured == sorted(measured)
    with pytest.raises(ValueError, match="short < long"):
        fit_budget_policy(pair, prompts, (2, 6), short=6, long=6)


def test_the_step_timing_leaves_a_programs_first_run_out(monkeypatch):
    """A program's first execution carries one-time costs (on the GPU: command-buffer instantiation): on a fake
    clock where the first call costs 100 ms extra and each decode step 1 ms over a 5 ms call overhead, every
    repeat's difference is exactly 1 ms per step (timed on the first call, the first repeat would read negative)."""
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(budget_module, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))

    def run(steps):
        clock["now"] += 0.005 + 0.001 * steps + (0.1 if clock["calls"] == 0 else 0.0)
        clock["calls"] += 1
        return types.SimpleNamespace(steps=np.asarray([steps]))

    per_repeat, long_means = time_short_long(run, 3, 20, repeats=3)
    np.testing.assert_allclose(per_repeat, [1.0, 1.0, 1.0], rtol=1e-9)
    np.testing.assert_allclose(long_means, [25.0 / 20] * 3, rtol=1e-9)
    assert clock["calls"] == 2 + 2 * 3  # one untimed call of each, then the repeats
