"""Benchmarks and experiments are packages run with `python -m` from the repository root: no sys.path edits,
no private (underscore) names of the library or the kernels, no experiment imported by a benchmark; the
presets module imports no higher layer. And the one timer of benchmarks/common.py."""

import ast
import pathlib

import jax.numpy as jnp
import pytest

from benchmarks.common import Timing, median_seconds, time_calls

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "experiments").glob("*.py"))
# private names still imported, each with the module that has to give it a public name
KNOWN_PRIVATE: set = set()


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_edit_no_path_and_import_no_private_name(path):
    rel = str(path.relative_to(ROOT))
    assert "sys.path" not in path.read_text()
    for module, names in _imports(path):
        if module.split(".")[0] in ("ddtree_jax", "ddtree_kernels"):
            private = {n for n in names if n.startswith("_")} | {p for p in module.split(".") if p.startswith("_")}
            assert {(rel, module, n) for n in private} <= KNOWN_PRIVATE, (rel, module, private)
        if rel.startswith("benchmarks/"):
            assert module.split(".")[0] != "experiments", (rel, module)


def test_presets_import_no_higher_layer():
    for module, _ in _imports(ROOT / "ddtree_jax" / "presets.py"):
        assert not module.startswith(("ddtree_jax.engine", "benchmarks", "experiments", "ddtree_jax.analysis")), module


def test_the_timer_rotates_inputs_and_summarises_in_microseconds():
    seen = []

    def fn(x):
        seen.append(int(x))
        return jnp.asarray(x)

    timing = time_calls(fn, [(0,), (1,), (2,)], runs=4, warmup=2)
    assert seen == [0, 1, 0, 1, 2, 0]  # warm-up calls, then the timed ones, each from the first input
    assert isinstance(timing, Timing) and len(timing.seconds) == 4 and list(timing.seconds) == sorted(timing.seconds)
    summary = Timing((1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 6e-6, 7e-6, 8e-6, 9e-6, 10e-6)).summary_us()
    assert summary == pytest.approx({"median_us": 5.5, "p10_us": 2.0, "p90_us": 10.0, "reps": 10})
    assert median_seconds(fn, 3, runs=3) >= 0 and seen[-4:] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        time_calls(fn, [(0,)], runs=0)
