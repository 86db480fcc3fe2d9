"""Test session setup: CPU JAX with 8 virtual devices (for the sharding tests), quiet Pallas warnings; the tiny
trained pair of the study tests (tests/experiments, the study notebooks) and the small runs of the two studies, each
computed once per test run and shared by every xdist worker (`_once_per_run`)."""

import contextlib
import dataclasses
import fcntl
import gc
import io
import os
import pickle
import shutil
import warnings

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# CLI calls inside tests must not switch on the shared persistent compilation cache for the rest of a
# worker's tests (two workers writing ~/.cache/ddtree_jax/xla at once aborted a run)
os.environ["DDTREE_COMPILATION_CACHE"] = ""
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\._src\.pallas.*")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable keeps a few memory
    maps; a pytest worker that ran half the suite without this reached the kernel's vm.max_map_count
    (65,530) and segfaulted inside the next compile (measured: ~42,000 maps after the kernel, verify,
    model and sampling tests in one process)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


def _once_per_run(tmp_path_factory, name: str, make) -> str:
    """The directory `name`, filled by `make(directory)` once per test run. Under xdist every worker asks for it in
    the run's own temporary directory (the parent of the workers' basetemps; `--dist loadfile` puts the files that
    use it on any worker): the first makes it under a file lock, the others wait for the lock and reuse it. Without
    xdist it lives in the session's basetemp. A failed `make` leaves no marker: the next asker tries again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (path / ".done").exists():
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                make(str(path))
                (path / ".done").touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(path)


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A tiny target + DFlash drafter trained on CPU once per test run with configs/train_tiny.json (~30 s; the
    workers share it, `_once_per_run`): DIR/target (with tokenizer.json), DIR/drafter, DIR/provenance.json,
    DIR/work/corpus/manifest.json. The studies (tests/experiments, the study notebooks) run on it; none writes to it."""
    from ddtree_jax.train.__main__ import main

    def train(out):
        with contextlib.redirect_stdout(io.StringIO()):
            args = ["all", "--config", os.path.join(ROOT, "configs", "train_tiny.json"), "--out", out]
            assert main(args + ["--no-progress", "--commit", "tiny-test"]) == 0

    return _once_per_run(tmp_path_factory, "tiny_pair", train)


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """A study's result (exactly as the study function returned it) and the same result as the study's CLI writes
    it (`studies.write_json`), for the notebook that shows it (DDTREE_NB_RESULT)."""

    result: dict
    json_path: str


def _study_run(tmp_path_factory, name: str, run) -> StudyRun:
    from experiments.studies import write_json

    def make(out):
        result = run()
        with open(os.path.join(out, "result.pkl"), "wb") as f:
            pickle.dump(result, f)
        write_json(result, os.path.join(out, "result.json"))

    path = _once_per_run(tmp_path_factory, name, make)
    with open(os.path.join(path, "result.pkl"), "rb") as f:
        return StudyRun(pickle.load(f), os.path.join(path, "result.json"))


@pytest.fixture(scope="session")
def budget_sweep_small(tiny_pair_dir, tmp_path_factory):
    """The budget sweep's small settings on the tiny pair, run once per test run (the workers share it): checked by
    tests/experiments/test_budget_sweep.py and shown by notebooks/budget_sweep.ipynb, which ran the same call (the
    notebook's `sweep(TARGET, DRAFTER, small=True)`) a second time before."""
    from experiments import budget_sweep
    from experiments.studies import pair_dirs

    target, drafter = pair_dirs(tiny_pair_dir)
    return _study_run(
        tmp_path_factory,
        "budget_sweep_small",
        lambda: budget_sweep.sweep(target, drafter, small=True, progress=False, commit="test"),
    )


@pytest.fixture(scope="session")
def ordering_ablation_small(tiny_pair_dir, tmp_path_factory):
    """The ordering ablation's SMALL grid on the tiny pair (12 configurations, six compiled programs: the order is
    a static option; ~1.5 min alone on 2 CPU cores, ~3 min beside another worker), run once per test run (the
    workers share it): checked by tests/experiments/test_ordering_ablation.py and shown by
    notebooks/ordering_ablation.ipynb, which ran the same grid (the notebook's `ablation(TARGET, DRAFTER,
    small=True)`) a second time before."""
    from experiments import ordering_ablation
    from experiments.studies import pair_dirs

    target, drafter = pair_dirs(tiny_pair_dir)
    return _study_run(
        tmp_path_factory,
        "ordering_ablation_small",
        lambda: ordering_ablation.ablation(target, drafter, small=True, progress=False, commit="test"),
    )


@pytest.fixture(scope="session")
def tiny_head_pair_dir(tiny_pair_dir, tmp_path_factory):
    """A copy of the tiny pair with a path-conditioned child head trained on it (the `child_head` stage of
    configs/train_tiny.json, a few steps: close to the marginal), once per test run: DIR/child_head beside the pair's
    target/, drafter/, provenance.json and work/. The tiny pair itself stays untouched."""
    from ddtree_jax.train.__main__ import main

    def train(out):
        for part in ("target", "drafter", "work"):
            shutil.copytree(os.path.join(tiny_pair_dir, part), os.path.join(out, part))
        shutil.copy(os.path.join(tiny_pair_dir, "provenance.json"), out)
        with contextlib.redirect_stdout(io.StringIO()):
            args = ["child_head", "--config", os.path.join(ROOT, "configs", "train_tiny.json"), "--out", out]
            assert main(args + ["--no-progress", "--commit", "tiny-test"]) == 0

    return _once_per_run(tmp_path_factory, "tiny_head_pair", train)


@pytest.fixture(scope="session")
def conditional_study_small(tiny_head_pair_dir, tmp_path_factory):
    """The conditional study's SMALL settings with the timing part on the tiny pair with its child head, run once per
    test run: checked by tests/experiments/test_conditional_study.py and shown by notebooks/conditional_study.ipynb."""
    from experiments import conditional_study

    return _study_run(
        tmp_path_factory,
        "conditional_study_small",
        lambda: conditional_study.study(tiny_head_pair_dir, small=True, timing=True, progress=False, commit="test"),
    )
