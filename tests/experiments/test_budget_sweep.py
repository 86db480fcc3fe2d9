"""The budget sweep on the tiny trained pair (small settings): well-formed rows, tau bounds, surrogate and exact
expectation per step, the plot and the CLI."""

import json
import os

import numpy as np
import pytest

from experiments import budget_sweep
from experiments.studies import pair_dirs
from tests.experiments.refusal import assert_refused, refuse_to_run


@pytest.fixture(scope="module")
def sweep(budget_sweep_small):
    """`budget_sweep.sweep(target, drafter, small=True)` on the tiny pair (tests/conftest.py: run once per test run,
    the budget_sweep notebook shows the same run)."""
    return budget_sweep_small.result


def test_rows_cover_every_column_and_temperature(sweep):
    s = budget_sweep.SMALL
    keys = {(r["method"], r["budget"], r["temperature"]) for r in sweep["rows"]}
    want = {(m, b, t) for m, b in budget_sweep.columns(s["budgets"]) for t in s["temperatures"]}
    assert keys == want and len(sweep["rows"]) == len(want)
    assert len(sweep["prompts"]) == s["num_prompts"] and all(len(p["ids"]) == s["prompt_len"] for p in sweep["prompts"])
    assert sweep["pair"]["block_size"] == 16 and sweep["pair"]["recipe"].endswith("train_tiny.json")
    json.dumps(sweep, default=float)  # serialisable (write_json handles numpy scalars too)


def test_tau_bounds_and_step_records(sweep):
    block = sweep["settings"]["block_size"]
    for r in sweep["rows"]:
        assert r["generations"] >= 1 and r["decode_steps"] >= r["generations"]
        assert 1.0 <= r["mean_tau"] <= block and 1.0 <= r["pooled_tau"] <= block
        steps = r["steps"]
        # one step emits at most its accepted drafts + 1: the chain's L = block - 1 drafts, a DDTree's
        # min(budget, L) (a path holds one node per depth)
        most = block if r["method"] == "chain" else min(block, r["budget"] + 1)
        assert max(steps["measured"]) <= most
        if r["method"] != "chain":
            assert r["step_surrogate_mean"] <= r["budget"] + 1
        assert len(steps["measured"]) == r["decode_steps"]
        assert min(steps["measured"]) >= 1 and min(steps["surrogate"]) >= 1 and min(steps["expected"]) >= 1
        assert r["step_measured_mean"] == pytest.approx(r["pooled_tau"], rel=1e-6)
        if r["temperature"] == 0:  # greedy: the exact expectation is the greedy path's length, what was accepted
            np.testing.assert_allclose(steps["measured"], steps["expected"], atol=1e-3)
            assert r["exact_z"] == 0.0
        else:  # exact verification: measured - expected averages to zero (fixed seed; |z| < 4.5)
            assert abs(r["exact_z"]) < 4.5
        assert sum(c["steps"] for c in r["calibration"]) == r["decode_steps"]


def test_surrogate_grows_with_the_budget(sweep):
    """A bigger best-first tree holds every node of a smaller one (up to near-ties), so its surrogate is larger."""
    for t in budget_sweep.SMALL["temperatures"]:
        tree = sorted(
            (r for r in sweep["rows"] if r["method"] == "ddtree" and r["temperature"] == t), key=lambda r: r["budget"]
        )
        means = [r["step_surrogate_mean"] for r in tree]
        assert means == sorted(means)


def test_targets_table_and_plot(sweep, tmp_path):
    t = sweep["targets"]
    assert t["tau_budget64_T0"] is None  # budget 64 is not in the small sweep
    assert set(t["ddtree_above_chain"]) == {"T=0", "T=1"}
    table = budget_sweep.format_table(sweep)
    assert table.count("\n| ") >= len(sweep["rows"]) and "DDTree above the chain" in table
    path = tmp_path / "sweep.png"
    budget_sweep.plot_sweep(sweep, str(path))
    assert path.stat().st_size > 10_000


def test_targets_logic():
    rows = [
        {"method": "chain", "budget": None, "temperature": 0.0, "mean_tau": 3.0},
        {"method": "ddtree", "budget": 4, "temperature": 0.0, "mean_tau": 2.0},
        {"method": "ddtree", "budget": 8, "temperature": 0.0, "mean_tau": 3.5},
        {"method": "ddtree", "budget": 64, "temperature": 0.0, "mean_tau": 4.2},
    ]
    t = budget_sweep.targets(rows)
    assert t["tau_budget64_T0"] == 4.2 and t["tau_budget64_T0_at_least_4"] is True
    assert t["ddtree_above_chain"]["T=0"] == {"per_budget": {8: True, 64: True}, "all": True}
    assert "pooled" not in t  # rows without pooled taus
    rows[2]["mean_tau"] = 2.9
    assert budget_sweep.targets(rows)["ddtree_above_chain"]["T=0"]["all"] is False
    for r, pooled in zip(rows, (2.5, 1.9, 2.6, 3.9)):  # pooled view: judged on its own numbers
        r["pooled_tau"] = pooled
    p = budget_sweep.targets(rows)["pooled"]
    assert p["tau_budget64_T0"] == 3.9 and p["tau_budget64_T0_at_least_4"] is False
    assert p["ddtree_above_chain"]["T=0"] == {"per_budget": {8: True, 64: True}, "all": True}


def test_cli_writes_json_and_plot(tiny_pair_dir, tmp_path, capsys, monkeypatch):
    target, drafter = pair_dirs(tiny_pair_dir)
    out = tmp_path / "sweep.json"
    # after every row the output holds the rows so far (a run cut short keeps them), marked incomplete
    partial = []
    write_json = budget_sweep.write_json
    monkeypatch.setattr(
        budget_sweep,
        "write_json",
        lambda payload, path: partial.append({**payload, "rows": list(payload["rows"])}) or write_json(payload, path),
    )
    assert (
        budget_sweep.main(
            [
                "--target",
                target,
                "--drafter",
                drafter,
                "--small",
                "--budgets",
                "4",
                "--temperatures",
                "0",
                "--out",
                str(out),
                "--no-progress",
                "--no-steps",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert [len(p["rows"]) for p in partial] == [1, 2, 2] and [p["complete"] for p in partial] == [False, False, True]
    assert result["complete"] and {(r["method"], r["budget"]) for r in result["rows"]} == {
        ("chain", None),
        ("ddtree", 4),
    }
    assert "steps" not in result["rows"][0] and os.path.exists(tmp_path / "sweep.png")
    assert "| 0 | ddtree | 4 |" in capsys.readouterr().out
    assert budget_sweep.main(["--target", str(tmp_path / "missing"), "--drafter", drafter, "--out", str(out)]) == 2
    assert "no trained target" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "0"], "budget 0"),
        (["--budgets", "4,1025"], "budget 1025"),
        (["--budgets", "4,4"], "budget 4 given twice"),
        (["--budgets", "4,x"], "comma-separated integers"),
        (["--temperatures", "0,0"], "given twice"),
        (["--prompts", "0"], "--prompts: 0 given; must be >= 1"),
        (["--samples", "0"], "--samples: 0 given"),
        (["--max-new", "-3"], "--max-new: -3 given"),
        (["--batch-size", "-1"], "--batch-size: -1 given"),
        (["--out", "{tmp}"], "is a directory"),
        (["--out", "{tmp}/afile/x.json"], "is a file, not a directory"),
    ],
)
def test_bad_arguments_are_refused_before_the_sweep(args, message, tmp_path, monkeypatch, capsys):
    """Each is an argparse error (exit 2) naming the value, before any model is loaded: budget 0 once ran budget 1
    and recorded 0, --prompts 0 ran 4 prompts, --batch-size -1 raised IndexError, and a bad --out failed only
    after the whole sweep."""
    (tmp_path / "afile").write_text("")
    refuse_to_run(monkeypatch, budget_sweep, "sweep")
    argv = [a.format(tmp=tmp_path) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "ok.json")]
    assert_refused(budget_sweep.main, argv, message, capsys)


def test_library_calls_refuse_bad_budgets_and_counts():
    """`sweep` (the notebooks' entry) checks before loading anything: 0 is not "unset"."""
    with pytest.raises(ValueError, match="budget 0"):
        budget_sweep.sweep("missing", "missing", budgets=(0,))
    with pytest.raises(ValueError, match="num_prompts must be >= 1; got 0"):
        budget_sweep.sweep("missing", "missing", num_prompts=0)
