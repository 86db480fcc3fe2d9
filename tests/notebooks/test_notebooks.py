"""Every notebook runs headless, top to bottom, in a small configuration. The study notebooks (budget sweep,
ordering ablation) run on the session's tiny trained pair, with the study tests' compilation cache."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STUDIES = {"budget_sweep.ipynb", "ordering_ablation.ipynb"}  # need a trained pair (DDTREE_PAIR_DIR)


def _execute(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
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
def test_study_notebook_executes_on_the_tiny_pair(path, monkeypatch, tiny_pair_dir):
    monkeypatch.setenv("DDTREE_PAIR_DIR", tiny_pair_dir)
    monkeypatch.setenv("DDTREE_NB_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = _execute(path)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"pair: {tiny_pair_dir}" in text and "small settings: True" in text


def test_every_study_notebook_exists():
    assert STUDIES <= {p.name for p in NOTEBOOKS}
