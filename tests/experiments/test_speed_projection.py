"""Speed projection: tau per budget x step times (a bench_engine JSON or the roofline) -> tokens/s, speed-ups, the
best budget; interpolation between measured budgets; a clear error without any step-time source."""

import json
import os

import pytest

from experiments import speed_projection as sp
from tests.experiments.refusal import assert_refused

SWEEP = {
    "settings": {"block_size": 16},
    "rows": [
        {"method": "chain", "budget": None, "temperature": 0.0, "mean_tau": 3.0, "pooled_tau": 2.4},
        {"method": "ddtree", "budget": 16, "temperature": 0.0, "mean_tau": 4.0, "pooled_tau": 3.2},
        {"method": "ddtree", "budget": 32, "temperature": 0.0, "mean_tau": 4.5, "pooled_tau": 3.6},
        {"method": "ddtree", "budget": 64, "temperature": 0.0, "mean_tau": 5.0, "pooled_tau": 4.0},
        {"method": "ddtree", "budget": 512, "temperature": 0.0, "mean_tau": 5.2, "pooled_tau": 4.16},
        {"method": "chain", "budget": None, "temperature": 1.0, "mean_tau": 2.0, "pooled_tau": 1.6},
        {"method": "ddtree", "budget": 16, "temperature": 1.0, "mean_tau": 2.5, "pooled_tau": 2.0},
        {"method": "ddtree", "budget": 64, "temperature": 1.0, "mean_tau": 3.0, "pooled_tau": 2.4},
    ],
}


@pytest.fixture
def bench(tmp_path):
    """bench_engine.py's output format: rows with B, method, budget, step_ms (two attention impls for one row)."""
    rows = [
        {"B": 1, "method": "ar", "budget": None, "step_ms": 10.0, "attn_impl": "xla", "context": 2048},
        {"B": 1, "method": "chain", "budget": None, "step_ms": 12.0, "attn_impl": "xla"},
        {"B": 1, "method": "ddtree", "budget": 16, "step_ms": 13.0, "attn_impl": "xla"},
        {"B": 1, "method": "ddtree", "budget": 16, "step_ms": 12.5, "attn_impl": "pallas"},
        {"B": 1, "method": "ddtree", "budget": 64, "step_ms": 16.0, "attn_impl": "xla"},
        {"B": 8, "method": "ar", "budget": None, "step_ms": 20.0, "attn_impl": "xla"},
    ]
    path = tmp_path / "engine_qwen3-8b_matmul-xla.json"
    path.write_text(json.dumps({"benchmark": "engine_qwen3-8b", "device": "gpu:H200", "commit": "abc", "rows": rows}))
    return str(path)


def test_projection_from_a_bench_json(bench, monkeypatch):
    monkeypatch.setattr(sp, "roofline_available", lambda: False)
    result = sp.speed_projection(SWEEP, bench=bench, tau_kind="mean")
    assert result["step_times"]["source"] == "bench_engine" and result["step_times"]["commit"] == "abc"
    row = {(r["temperature"], r["method"], r["budget"]): r for r in result["rows"]}
    ar, chain = row[(0.0, "ar", None)], row[(0.0, "chain", None)]
    assert ar["tokens_per_s"] == pytest.approx(100.0) and chain["tokens_per_s"] == pytest.approx(250.0)
    b16 = row[(0.0, "ddtree", 16)]  # the faster of the two implementations
    assert b16["step_ms"] == pytest.approx(12.5) and b16["step_source"] == "measured"
    assert b16["tokens_per_s"] == pytest.approx(4.0 / 0.0125)
    assert b16["speedup_vs_ar"] == pytest.approx(3.2) and b16["speedup_vs_chain"] == pytest.approx(320 / 250)
    b32 = row[(0.0, "ddtree", 32)]  # interpolated in N = budget + 1 between 16 (N 17) and 64 (N 65)
    assert b32["step_source"] == "interpolated" and b32["step_ms"] == pytest.approx(12.5 + (16 / 48) * 3.5)
    assert row[(0.0, "ddtree", 512)]["step_ms"] is None  # outside the measured range, no roofline
    assert (
        result["best_budget"]["T=0"]["budget"]
        == max(
            (r for r in result["rows"] if r["temperature"] == 0.0 and r["method"] == "ddtree" and r["tokens_per_s"]),
            key=lambda r: r["tokens_per_s"],
        )["budget"]
    )
    assert set(result["best_budget"]) == {"T=0", "T=1"}
    table = sp.format_table(result)
    assert "best budget at T=0" in table and "interpolated" in table
    with pytest.raises(sp.NoStepTimes, match="batch 4"):
        sp.speed_projection(SWEEP, bench=bench, batch=4)


def test_pooled_tau_is_the_default(bench, monkeypatch):
    """Throughput over a workload is all tokens / all steps: the pooled tau, not the mean of per-generation
    taus (which a few long repetitive generations dominate)."""
    monkeypatch.setattr(sp, "roofline_available", lambda: False)
    result = sp.speed_projection(SWEEP, bench=bench)
    assert result["tau_kind"] == "pooled" and "tau (pooled)" in sp.format_table(result)
    b16 = next(r for r in result["rows"] if r["temperature"] == 0.0 and r["budget"] == 16)
    assert b16["tau"] == 3.2 and b16["tokens_per_s"] == pytest.approx(3.2 / 0.0125)
    with pytest.raises(ValueError, match="tau_kind must be one of"):
        sp.speed_projection(SWEEP, bench=bench, tau_kind="median")


def test_roofline_scales_budgets_outside_the_measured_range(bench):
    if not sp.roofline_available():
        pytest.skip("no roofline model")
    result = sp.speed_projection(SWEEP, bench=bench)
    b512 = next(r for r in result["rows"] if r["budget"] == 512)
    assert b512["step_source"] == "roofline-scaled" and b512["step_ms"] > 16.0


def test_projection_from_the_roofline():
    if not sp.roofline_available():
        pytest.skip("no roofline model")
    result = sp.speed_projection(SWEEP, use_roofline=True)
    assert result["step_times"]["source"] == "roofline"
    steps = [r["step_ms"] for r in result["rows"] if r["temperature"] == 0.0 and r["method"] == "ddtree"]
    assert all(s > 0 for s in steps) and steps == sorted(steps)  # more slots, no faster
    ar = next(r for r in result["rows"] if r["method"] == "ar")
    assert ar["speedup_vs_ar"] == 1.0 and ar["step_source"] == "roofline"


def test_no_step_times_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sp, "roofline_available", lambda: False)
    monkeypatch.setattr(sp, "find_bench_json", lambda root=None, batch=1: None)
    with pytest.raises(sp.NoStepTimes, match="bench_engine.py"):
        sp.speed_projection(SWEEP)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(SWEEP))
    assert sp.main(["--sweep", str(path), "--out", str(tmp_path / "out.json")]) == 2
    assert "no step times" in capsys.readouterr().err
    assert sp.main(["--sweep", str(tmp_path / "missing.json")]) == 2


def test_cli_writes_json(bench, tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(SWEEP))
    out = tmp_path / "speed.json"
    assert sp.main(["--sweep", str(path), "--bench", bench, "--out", str(out), "--commit", "c0ffee"]) == 0
    assert json.loads(out.read_text())["best_budget"]
    assert json.loads(out.read_text())["commit"] == "c0ffee"
    assert "speedup vs AR" in capsys.readouterr().out


def _write(path, payload, mtime):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    os.utime(path, (mtime, mtime))


def test_the_newest_bench_is_picked_by_its_recorded_date_not_its_mtime(tmp_path):
    """A fresh clone gives every file the same (or an arbitrary) modification time: the recorded date decides,
    ties by file name."""
    archive = tmp_path / "benchmarks" / "results_archive"
    rows = {
        "rows": [
            {"B": 1, "method": "ar", "budget": None, "step_ms": 10.0},
            {"B": 1, "method": "ddtree", "budget": 16, "step_ms": 12.0},
        ]
    }
    _write(archive / "engine_qwen3-8b_b_old.json", {"date": "2026-11-30T19:45:31+00:00", "commit": "a", **rows}, 300)
    _write(archive / "engine_qwen3-8b_a_new.json", {"date": "2026-11-30T23:44:22+00:00", "commit": "b", **rows}, 100)
    _write(tmp_path / "benchmarks" / "results" / "engine_qwen3-8b_x.json", {"commit": "c", **rows}, 400)  # no date
    assert os.path.basename(sp.find_bench_json(str(tmp_path))) == "engine_qwen3-8b_a_new.json"
    _write(archive / "engine_qwen3-8b_c_tie.json", {"date": "2026-11-30T23:44:22+00:00", "commit": "d", **rows}, 50)
    assert os.path.basename(sp.find_bench_json(str(tmp_path))) == "engine_qwen3-8b_c_tie.json"  # tie: file name
    assert sp.find_bench_json(str(tmp_path / "empty")) is None


def test_without_sweep_the_newest_committed_sweep_is_used(bench, tmp_path, monkeypatch, capsys):
    results = tmp_path / "repo" / "experiments" / "results"
    _write(results / "budget_sweep_2026-11-30_cpu_new.json", {**SWEEP, "date": "2026-11-30T20:00:00+00:00"}, 100)
    _write(results / "budget_sweep_2026-11-29_cpu_old.json", {"rows": [], "date": "2026-11-29T20:00:00+00:00"}, 900)
    monkeypatch.setattr(sp, "REPO", str(tmp_path / "repo"))
    monkeypatch.chdir(tmp_path)  # no outputs/budget_sweep.json here
    assert sp.find_sweep_json().endswith("budget_sweep_2026-11-30_cpu_new.json")
    assert sp.main(["--bench", bench, "--out", str(tmp_path / "speed.json")]) == 0
    assert "budget_sweep_2026-11-30_cpu_new.json" in capsys.readouterr().out
    assert json.loads((tmp_path / "speed.json").read_text())["best_budget"]
    monkeypatch.setattr(sp, "REPO", str(tmp_path / "nothing"))
    assert sp.main(["--bench", bench, "--out", str(tmp_path / "speed2.json")]) == 2
    assert "no committed sweep" in capsys.readouterr().err


def test_the_repository_has_a_committed_sweep():
    assert sp.find_sweep_json() is not None and os.path.isfile(sp.find_sweep_json())


def test_newest_bench_skips_results_without_ar_and_ddtree_rows(tmp_path):
    """Profile-only results (DDTree rows without the AR baseline, or AR alone) are newer but cannot carry the
    projection: skipped."""
    results = tmp_path / "benchmarks" / "results"
    ar = {"B": 1, "method": "ar", "budget": None, "step_ms": 10.0}
    dd = {"B": 1, "method": "ddtree", "budget": 64, "step_ms": 12.0}
    _write(results / "engine_qwen3-8b_old.json", {"date": "2026-11-30T19:00:00+00:00", "rows": [ar, dd]}, 100)
    _write(results / "engine_qwen3-8b_profile.json", {"date": "2026-12-01T19:00:00+00:00", "rows": [dd]}, 200)
    _write(results / "engine_qwen3-8b_ar_profile.json", {"date": "2026-12-02T19:00:00+00:00", "rows": [ar]}, 300)
    assert os.path.basename(sp.find_bench_json(str(tmp_path))) == "engine_qwen3-8b_old.json"
    assert sp.find_bench_json(str(tmp_path), batch=8) is None  # no AR row at batch 8 anywhere


def test_a_bench_without_an_ar_row_is_named_in_the_error(tmp_path):
    path = tmp_path / "engine_qwen3-8b_profile.json"
    path.write_text(json.dumps({"rows": [{"B": 1, "method": "ddtree", "budget": 64, "step_ms": 12.0}]}))
    with pytest.raises(sp.NoStepTimes, match="engine_qwen3-8b_profile.json"):
        sp.speed_projection(SWEEP, bench=str(path))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--roofline", "--bench", "/nonexistent.json"], "exclude each other"),
        (["--bench", "/nonexistent.json"], "no such file"),
        (["--batch", "0"], "--batch 0"),
    ],
)
def test_bad_arguments_are_refused_up_front(argv, message, tmp_path, capsys):
    assert_refused(sp.main, [*argv, "--out", str(tmp_path / "out.json")], message, capsys)
    assert not (tmp_path / "out.json").exists()
