"""benchmarks/plot_e2e.py draws the archived bench_e2e results (two settings) and names a result without AR."""

import json
import os

import pytest

from benchmarks.plot_e2e import plot_e2e

ARCHIVE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results_archive")


def _load(name):
    with open(os.path.join(ARCHIVE, name)) as f:
        return json.load(f)


def test_the_archived_e2e_results_plot(tmp_path):
    results = [_load("e2e_embedded_T0_ef5aa8e.json"), _load("e2e_embedded_T1_ef5aa8e.json")]
    path = tmp_path / "e2e.png"
    fig = plot_e2e(results, str(path))
    assert path.stat().st_size > 10_000 and len(fig.axes) == 4
    line = fig.axes[0].lines[0]  # T = 0 tokens/s: the DDTree budgets in order
    assert list(line.get_xdata()) == [16, 32, 64, 128]
    without_ar = {**results[0], "results": [r for r in results[0]["results"] if r["method"] != "ar"]}
    with pytest.raises(ValueError, match="has no AR row"):
        plot_e2e([without_ar])
