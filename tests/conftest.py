"""Test session setup: CPU JAX with 8 virtual devices (for the sharding tests), quiet Pallas warnings; the tiny
trained pair of the study tests (tests/experiments, the study notebooks)."""

import contextlib
import gc
import io
import os
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


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A tiny target + DFlash drafter trained on CPU once per session with configs/train_tiny.json (~30 s):
    DIR/target (with tokenizer.json), DIR/drafter, DIR/provenance.json, DIR/work/corpus/manifest.json.
    The studies (tests/experiments, the study notebooks) run on it."""
    from ddtree_jax.train.__main__ import main

    out = tmp_path_factory.mktemp("tiny_pair")
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(
                [
                    "all",
                    "--config",
                    os.path.join(ROOT, "configs", "train_tiny.json"),
                    "--out",
                    str(out),
                    "--no-progress",
                    "--commit",
                    "tiny-test",
                ]
            )
            == 0
        )
    return str(out)
