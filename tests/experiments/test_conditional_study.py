"""The conditional study (issue #23) on the tiny pair with its child head: the small run with the timing part
(tests/conftest.py: conditional_study_small, run once per test run; the notebook shows the same run), its exactness
at T = 0, the spine accounting, the cost-aware budget's report, and the merge of separately run parts."""

import json
import re

import numpy as np
import pytest

from experiments import conditional_study as cs
from tests.experiments.refusal import assert_refused, refuse_to_run


@pytest.fixture(scope="module")
def result(conditional_study_small):
    return conditional_study_small.result


@pytest.mark.slow
def test_every_column_ran_and_greedy_columns_emit_the_same_tokens(result):
    budgets, temps = result["settings"]["budgets"], result["settings"]["temperatures"]
    keys = {(r["method"], r["budget"], r["temperature"]) for r in result["rows"]}
    expected = {("chain", None, t) for t in temps}
    expected |= {(m, b, t) for m in ("marginal", "conditional") for b in budgets for t in temps}
    assert keys == expected and len(result["rows"]) == len(expected)
    # at T = 0 every method emits the target's greedy continuation: the same number of tokens per column
    greedy = [r for r in result["rows"] if r["temperature"] == 0]
    assert len({r["tokens"] for r in greedy}) == 1 and greedy[0]["tokens"] > 0
    assert all(r["exact_z"] == 0 or not np.isfinite(r["exact_z"]) for r in greedy)


@pytest.mark.slow
def test_the_paired_difference_is_the_difference_of_the_mean_taus(result):
    for temperature in result["settings"]["temperatures"]:
        per = result["targets"]["paired_difference"][f"T={temperature:g}"]
        assert sorted(per) == sorted(result["settings"]["budgets"])
        for budget, v in per.items():
            m, c = (
                next(
                    r
                    for r in result["rows"]
                    if (r["method"], r["budget"], r["temperature"]) == (k, budget, temperature)
                )
                for k in ("marginal", "conditional")
            )
            assert v["mean"] == pytest.approx(c["mean_tau"] - m["mean_tau"], abs=1e-3)
            assert v["se"] >= 0


@pytest.mark.slow
def test_spine_accounting(result):
    for r in result["rows"]:
        assert 0 <= r["spine_hit"] <= r["spine_visited"] and 0 <= r["off_hit"] <= r["off_visited"]
        # each step emits its accepted draft tokens and one more, each generation one token from its prefill (a stop
        # or max_new can only cut it shorter)
        assert r["tokens"] <= r["spine_hit"] + r["off_hit"] + r["decode_steps"] + r["generations"]
        assert r["spine_hit"] + r["off_hit"] > 0
        if r["method"] == "chain":  # the chain is all spine
            assert r["off_visited"] == 0 and r["off_hit"] == 0
        else:
            share = r["off_hit"] / (r["spine_hit"] + r["off_hit"])
            assert r["off_spine_share"] == pytest.approx(share)


@pytest.mark.slow
def test_timing_and_the_cost_aware_budget_report(result):
    settings = result["settings"]
    assert settings["dtype"] == "float32"  # the studies' default weights (--dtype auto: the checkpoint's on GPU)
    assert settings["weights_dtype"] == "float32"  # what the pair was loaded in
    assert sorted({r["temperature"] for r in result["timing"]}) == list(settings["timing_temperatures"])
    for t in settings["timing_temperatures"]:
        timed = [r for r in result["timing"] if r["temperature"] == t]
        labels = {(r["tree"], r["budget"]) for r in timed}
        expected = {("ar", None), ("chain", None)} | {("marginal", "auto"), ("conditional", "auto")}
        expected |= {(tree, b) for tree in ("marginal", "conditional") for b in settings["budgets"]}
        assert labels == expected
        assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in timed)
        assert next(r for r in timed if r["method"] == "ar")["speedup_vs_ar"] == 1.0
        policies = [p for p in result["policies"] if p["temperature"] == t]
        assert sorted(p["tree"] for p in policies) == ["conditional", "marginal"]
        for p in policies:
            assert p["budgets"] == list(settings["auto_budgets"]) and len(p["scale"]) == len(p["budgets"])
            assert all(ms > 0 for ms in p["step_ms"]) and list(p["step_ms"]) == sorted(p["step_ms"])
    for key, v in result["targets"]["auto_vs_best_fixed"].items():
        tree, temp = key.split(" T=")
        fixed = [
            r
            for r in result["timing"]
            if (r["tree"], r["temperature"]) == (tree, float(temp)) and isinstance(r["budget"], int)
        ]
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        assert (v["best_fixed_budget"], v["best_fixed_tokens_per_s"]) == (best["budget"], best["tokens_per_s"])
        assert v["ratio"] == pytest.approx(v["auto_tokens_per_s"] / best["tokens_per_s"])


@pytest.mark.slow
def test_separately_run_parts_merge_into_the_whole(result, tmp_path):
    tau_part = dict(result, timing=[], policies=[], settings=dict(result["settings"], timing=False))
    timing_part = dict(result, rows=[], settings=dict(result["settings"], tau=False), device="gpu:test", commit="abc")
    paths = []
    for name, part in (("tau", tau_part), ("timing", timing_part)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(part, f)
    out = str(tmp_path / "merged.json")
    assert cs.main(["--merge", *paths, "--out", out]) == 0
    with open(out) as f:
        merged = json.load(f)
    assert merged["rows"] == json.loads(json.dumps(result["rows"]))
    assert merged["timing"] == json.loads(json.dumps(result["timing"]))
    assert merged["settings"]["tau"] and merged["settings"]["timing"] and len(merged["settings"]["parts"]) == 2
    assert merged["targets"] == json.loads(json.dumps(result["targets"]))
    assert (tmp_path / "merged.png").stat().st_size > 0
    # each part keeps where it ran; the top level lists both devices and commits
    assert [p["device"] for p in merged["settings"]["parts"]] == [result["device"], "gpu:test"]
    assert merged["device"] == [result["device"], "gpu:test"] and merged["commit"] == [result["commit"], "abc"]
    table = cs.format_table(result)
    assert all(f"| {r['method']} |" in table for r in result["rows"])


def test_the_cli_names_what_is_wrong(tmp_path, capsys):
    assert cs.main(["--no-tau", "--pair", str(tmp_path)]) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert cs.main(["--pair", str(tmp_path / "missing"), "--out", str(tmp_path / "x.json")]) == 2
    assert "missing" in capsys.readouterr().err


def _part(tmp_path, name, *, budgets=(16,), temperatures=(0.0,), **settings):
    """A minimal conditional_study result file (no run): what the merge checks read."""
    part = {
        "study": "conditional_study",
        "device": "cpu:test",
        "commit": "abc",
        "date": "2026-12-05T00:00:00+00:00",
        "pair": {"target": f"/{name}/target", "num_layers": 6, "trained_at_commit": "16cca97"},
        "settings": {
            "budgets": list(budgets),
            "temperatures": list(temperatures),
            "num_prompts": 16,
            "samples": 4,
            "seed": 0,
            "prompt_seed": 0,
            "tau": True,
            "timing": False,
            "dtype": "float32",
        }
        | settings,
        "rows": [
            {"method": m, "budget": b, "temperature": t}
            for t in temperatures
            for m, b in [("chain", None)] * (16 in budgets) + [("marginal", b) for b in budgets]
        ],
        "timing": [],
        "policies": [],
        "wall_s": 1.0,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(part))
    return str(path), part


def test_merge_refuses_incompatible_parts(tmp_path):
    """Parts of different prompts, seeds or pairs, a repeated row, or a file of another study are refused naming
    the files; the columns split across parts (budgets, temperatures, tau / timing, repeats, dtype) and the pair's
    paths may differ."""
    tmp = tmp_path
    a = _part(tmp, "a")[1]
    b = _part(tmp, "b", budgets=(32,), temperatures=(1.0,), repeats=2, dtype="auto", auto_budgets=[16, 32, 64, 128])[1]
    cs.check_mergeable([a, b], ["a.json", "b.json"])  # what may differ (a CPU tau part, a GPU timing part)
    assert "auto_budgets" in cs.PART_SETTINGS  # recorded per part in settings.parts
    cases = [
        (_part(tmp, "c", budgets=(32,), prompt_seed=1)[1], "differ in settings.prompt_seed (0 vs 1)"),
        (_part(tmp, "c", budgets=(32,), num_prompts=8)[1], "differ in settings.num_prompts"),
        (_part(tmp, "c", budgets=(32,), seed=3)[1], "differ in settings.seed"),
        (dict(b, pair=dict(b["pair"], trained_at_commit="x")), "differ in pair.trained_at_commit"),
        (_part(tmp, "c", temperatures=(0.0,))[1], "is in both a.json and c.json"),
        (dict(b, study="budget_sweep"), "c.json: not a conditional_study result (budget_sweep)"),
        ({"rows": []}, "c.json: not a conditional_study result"),
    ]
    for other, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            cs.merge_results([a, other], ["a.json", "c.json"])


def test_merge_cli_refuses_run_flags_duplicates_and_bad_files(tmp_path, capsys):
    a, _ = _part(tmp_path, "a")
    b, _ = _part(tmp_path, "b", budgets=(32,))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"study": "budget_sweep", "settings": {}, "rows": []}))
    out = str(tmp_path / "merged.json")
    for argv, message in [
        (["--merge", a, b, "--budgets", "64"], "--budgets"),
        (["--merge", a, b, "--timing"], "--timing"),
        (["--merge", a, b, "--prompt-seed", "1"], "--prompt-seed"),
        (["--merge", a, a], "given twice"),
        (["--merge", a, str(sweep)], "sweep.json: not a conditional_study result"),
        (["--merge", a, str(tmp_path / "missing.json")], "missing.json"),
        (["--merge", a, b, "--out", str(tmp_path)], "is a directory"),
    ]:
        assert_refused(cs.main, argv + (["--out", out] if "--out" not in argv else []), message, capsys)
    assert not (tmp_path / "merged.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "0"], "budget 0"),
        (["--budgets", "16,16"], "given twice"),
        (["--auto-budgets", "2000"], "budget 2000"),
        (["--prompts", "0"], "--prompts: 0 given"),
        (["--samples", "0"], "--samples: 0 given"),
        (["--repeats", "0"], "--repeats: 0 given"),
        (["--auto-budgets", "64,16"], "strictly increasing"),
        (["--temperatures", "0,-1"], "a temperature is finite and >= 0"),
        (["--temperatures", "nan"], "a temperature is finite and >= 0"),
    ],
)
def test_bad_run_arguments_are_refused_at_parse_time(args, message, tmp_path, monkeypatch, capsys):
    refuse_to_run(monkeypatch, cs, "study")
    assert_refused(cs.main, args + ["--out", str(tmp_path / "x.json")], message, capsys)


def test_parsed_lists_reach_the_study(tmp_path, monkeypatch):
    """--budgets / --temperatures / --auto-budgets reach `study` as parsed tuples (main used to .split() the
    argparse-parsed tuples: an AttributeError for the documented GPU timing command)."""
    seen = {}

    def capture(pair, **kwargs):
        seen.update(kwargs)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(cs, "study", capture)
    argv = ["--no-tau", "--timing", "--temperatures", "0", "--budgets", "16,32,64,128"]
    assert cs.main(argv + ["--auto-budgets", "16,32,64,128", "--repeats", "2", "--out", str(tmp_path / "x.json")]) == 2
    assert seen["budgets"] == (16, 32, 64, 128) and seen["auto_budgets"] == (16, 32, 64, 128)
    assert seen["temperatures"] == (0.0,) and seen["timing"] and not seen["tau"]


def test_above_everywhere_is_undecided_without_measured_ratios():
    # a --no-tau run has no tau ratio: the target is not measured, not met
    assert cs.targets([], [])["conditional_above_marginal_everywhere"] is None
    assert cs.above_everywhere([]) is None
    assert cs.above_everywhere([1.2, None]) is None
    assert cs.above_everywhere([1.2, None, 0.9]) is False
    assert cs.above_everywhere([1.2, 1.01]) is True
