"""scripts/import_graph.py on tiny synthetic package trees: it finds exactly the cycle, the upward edge and
the function-level imports planted there, and nothing in a clean tree."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "import_graph.py"

_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
ig = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = ig  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(ig)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CLEAN = {
    "kernels/__init__.py": "",
    "kernels/matmul.py": "import jax\n",
    "ddtree_jax/__init__.py": "from ddtree_jax.config import Config\n",
    "ddtree_jax/config.py": "import dataclasses\nfrom typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n    from ddtree_jax.engine import run\n",  # typing-only: ignored
    "ddtree_jax/models/__init__.py": "from . import layers\n",
    "ddtree_jax/models/layers.py": "from kernels.matmul import x\nfrom ..config import Config\n",
    "ddtree_jax/engine/__init__.py": "",
    "ddtree_jax/engine/run.py": "import ddtree_jax.models.layers as layers\nfrom ddtree_jax import config\n",
    "benchmarks/__init__.py": "",
    "benchmarks/bench_x.py": "from ddtree_jax.engine import run\nimport numpy\n",
}


def test_clean_tree(tmp_path):
    report = ig.analyse(write(tmp_path, CLEAN))
    assert report.cycles == [] and report.upward == [] and report.function_level == []
    assert not report.failed and report.unlayered == []
    pairs = {(e.src, e.dst) for e in report.edges}
    assert pairs == {
        ("ddtree_jax", "ddtree_jax.config"),
        ("ddtree_jax.config", "ddtree_jax.engine.run"),  # the TYPE_CHECKING import, kept as "typing"
        ("ddtree_jax.models", "ddtree_jax.models.layers"),
        ("ddtree_jax.models.layers", "kernels.matmul"),
        ("ddtree_jax.models.layers", "ddtree_jax.config"),
        ("ddtree_jax.engine.run", "ddtree_jax.models.layers"),
        ("ddtree_jax.engine.run", "ddtree_jax.config"),
        ("benchmarks.bench_x", "ddtree_jax.engine.run"),
    }
    assert {e.kind for e in report.edges if e.src == "ddtree_jax.config"} == {"typing"}
    assert ig.main(["--root", str(tmp_path), "--check"]) == 0


def test_cycle_and_upward_edge(tmp_path):
    files = dict(CLEAN)
    # a cycle through a function-level import: engine.run <-> engine.step
    files["ddtree_jax/engine/step.py"] = "from ddtree_jax.engine.run import go\n"
    files["ddtree_jax/engine/run.py"] = CLEAN["ddtree_jax/engine/run.py"] + (
        "def f():\n    from ddtree_jax.engine import step\n    return step\n"
    )
    # an upward edge: a kernel importing a model module
    files["kernels/matmul.py"] = "import jax\nfrom ddtree_jax.models.layers import linear\n"
    report = ig.analyse(write(tmp_path, files))

    assert report.cycles == [
        ["ddtree_jax.engine.run", "ddtree_jax.engine.step"],
        # the upward edge closes a second cycle: models.layers -> kernels.matmul -> models.layers
        ["ddtree_jax.models.layers", "kernels.matmul"],
    ]
    assert [(e.src, e.dst, e.kind, lo, hi) for e, lo, hi in report.upward] == [
        ("kernels.matmul", "ddtree_jax.models.layers", "module", "kernels", "models")
    ]
    (fn,) = report.function_level
    assert (fn.src, fn.dst, fn.file, fn.line) == (
        "ddtree_jax.engine.run",
        "ddtree_jax.engine.step",
        "ddtree_jax/engine/run.py",
        4,
    )

    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "## (a) import cycles: 2" in out.stdout
    assert (
        "kernels.matmul -> ddtree_jax.models.layers  [module]  kernels/matmul.py:2  (kernels imports models)"
        in out.stdout
    )
    assert out.stdout.rstrip().endswith("2 cycles, 1 upward edges, 1 function-level first-party imports")
    assert (
        subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True).returncode == 0
    )  # without --check: report only


def test_the_kernel_package_and_layers():
    # kernels/ddtree_kernels/ is imported as ddtree_kernels, at the bottom layer
    assert ig.layer_of("ddtree_kernels.tree_attention")[1] == "kernels"
    assert ig.layer_of("ddtree_jax")[1] == "verify"
    assert ig.layer_of("ddtree_jax.tree.build")[1] == "tree+sampling"
    assert ig.layer_of("ddtree_kernels.quant")[1] == "kernels"  # the quantised weight formats live with the kernels
    assert ig.layer_of("ddtree_jax.sharding.regions")[1] == "parallel"  # below every layer that shards a call
    assert ig.layer_of("ddtree_jax.sharding.memory")[1] == "analysis"
    assert ig.layer_of("ddtree_jax.missing") is None  # "=ddtree_jax" matches the package alone
    ranks = [
        ig.layer_of(m)[0]
        for m in (
            "kernels.x",
            "ddtree_jax.config",
            "ddtree_jax.options",
            "ddtree_jax.sharding",
            "ddtree_jax.sampling",
            "ddtree_jax.verify",
            "ddtree_jax.models",
            "ddtree_jax.checkpoint",
            "ddtree_jax.presets",
            "ddtree_jax.analysis",
            "ddtree_jax.engine",
            "ddtree_jax.train",
            "ddtree_jax.__main__",
            "benchmarks.b",
        )
    ]
    assert ranks == sorted(ranks)


def test_future_kernel_package_discovery(tmp_path):
    write(
        tmp_path,
        {
            "kernels/ddtree_kernels/__init__.py": "from .attn import a\n",
            "kernels/ddtree_kernels/attn.py": "import jax\n",
            "kernels/__init__.py": "",
        },
    )
    modules, edges = ig.collect(tmp_path)
    assert set(modules) == {"kernels", "ddtree_kernels", "ddtree_kernels.attn"}
    assert [(e.src, e.dst) for e in edges] == [("ddtree_kernels", "ddtree_kernels.attn")]


def test_the_repository_has_no_cycles_or_upward_imports():
    """The repository itself passes `--check` (a module-level cycle or an upward import fails here, in CI)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 cycles, 0 upward edges" in proc.stdout
