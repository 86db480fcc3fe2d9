"""experiments/sampling_correctness.py's arguments: bad values are refused before any chain runs, and the JSON
records the tree shapes actually run (no model or chain runs here: run_grid is replaced)."""

import json

import pytest

from experiments import sampling_correctness as sc
from tests.experiments.refusal import assert_refused, refuse_to_run


@pytest.fixture
def no_runs(monkeypatch):
    refuse_to_run(monkeypatch, sc, "run_grid")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--samples", "0"], "--samples 0"),
        (["--samples", "-5"], "--samples -5"),
        (["--chunk", "0"], "--chunk 0"),
        (["--filters", ""], "empty filter"),
        (["--filters", "none,none"], "only once"),
        (["--filters", "none,bogus"], "'bogus'"),
        (["--shapes", "4x2,4x2"], "only once"),
        (["--shapes", "abc"], "BUDGETxDEPTH"),
        (["--shapes", "4x2x1"], "BUDGETxDEPTH"),
        (["--shapes", "0x2"], "at least 1"),
    ],
)
def test_bad_arguments_are_refused_up_front(argv, message, no_runs, tmp_path, capsys):
    assert_refused(sc.main, [*argv, "--quick", "--out", str(tmp_path)], message, capsys)


def test_the_json_records_the_shapes_run_and_explicit_counts(monkeypatch, tmp_path):
    seen = {}

    def run_grid(configs, samples, chunk, seed, on_row=None, impl="xla"):
        seen.update(samples=samples, chunk=chunk, shapes=sorted({(c.budget, c.depth) for c in configs}))
        row = {
            **sc.dataclasses.asdict(configs[0]),
            "lossy": False,
            "samples": samples,
            "tv": 0.0,
            "tv_noise_floor": 0.0,
            "chi2_p": 0.5,
            "tau_analytic": 1.0,
            "tau_empirical": 1.0,
            "tau_z": 0.0,
            "seconds": 0.0,
        }
        on_row([row])
        return [row]

    monkeypatch.setattr(sc, "run_grid", run_grid)
    argv = ["--quick", "--samples", "7", "--chunk", "3", "--shapes", "4x2,6x3", "--filters", "none"]
    assert sc.main([*argv, "--out", str(tmp_path)]) == 0
    assert seen == {"samples": 7, "chunk": 3, "shapes": [(4, 2), (6, 3)]}
    problem = json.loads((tmp_path / "sampling_correctness.json").read_text())["problem"]
    assert problem["shapes"] == [{"budget": 4, "depth": 2}, {"budget": 6, "depth": 3}]
    assert "budget" not in problem and "depth" not in problem
