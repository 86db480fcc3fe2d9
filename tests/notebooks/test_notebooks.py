"""Every notebook runs headless, top to bottom, in a small configuration. The study notebooks (budget sweep,
ordering ablation) run on the session's tiny trained pair and show the small run of their study that the study's
tests check (tests/conftest.py: computed once per test run), instead of running it a second time in the kernel."""

import importlib
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# need a trained pair (DDTREE_PAIR_DIR); each shows its study's small run (the session fixture named here)
STUDIES = {
    "budget_sweep.ipynb": "budget_sweep_small",
    "ordering_ablation.ipynb": "ordering_ablation_small",
    "conditional_study.ipynb": "conditional_study_small",
}
# the pair fixture each study notebook runs on, where it is not the tiny pair (tests/conftest.py)
PAIRS = {"conditional_study.ipynb": "tiny_head_pair_dir"}


def _execute(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in STUDIES], ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("DDTREE_NB_SAMPLES", "4000")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    _execute(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name in STUDIES], ids=lambda p: p.name)
def test_study_notebook_executes_on_the_tiny_pair(path, monkeypatch, request):
    """The notebook on the tiny pair, showing the run `<study>(target, drafter, small=True)` that the study's tests
    check (DDTREE_NB_RESULT: the same call the notebook makes with DDTREE_NB_SMALL=1, written as the study's CLI
    writes it): every later cell (tables, plots, the speed projection) runs on it, and its tables are the study's."""
    run = request.getfixturevalue(STUDIES[path.name])
    tiny_pair_dir = request.getfixturevalue(PAIRS.get(path.name, "tiny_pair_dir"))
    study = importlib.import_module(f"experiments.{path.stem}")
    monkeypatch.setenv("DDTREE_PAIR_DIR", tiny_pair_dir)
    monkeypatch.setenv("DDTREE_NB_SMALL", "1")
    monkeypatch.setenv("DDTREE_NB_RESULT", run.json_path)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = _execute(path)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"pair: {tiny_pair_dir}" in text and "small settings: True" in text
    assert f"the result file {run.json_path} (commit test," in text
    # the JSON the notebook read is the study's result: every row of the study's tables shows (the lines after the
    # tables may differ: JSON makes int dict keys strings)
    rows = [line for line in study.format_table(run.result).splitlines() if line.startswith("| ")]
    assert len(rows) > len(run.result["rows"]) and all(line in text for line in rows)


def test_every_study_notebook_exists():
    assert set(STUDIES) <= {p.name for p in NOTEBOOKS}
