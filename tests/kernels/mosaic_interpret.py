"""Shared by the Mosaic GPU kernels' interpret-mode tests (test_{mla,gqa,prefill}_attention_mgpu.py).

Interpret mode runs a CTA's warpgroups as threads that block inside host callbacks (barrier waits); with
XLA's CPU thread pool too small for the warpgroups of the kernel calls running at once, a blocked warpgroup
starves another and the kernel hangs (`mosaic_common.INTERPRET_NPROC`). The cases therefore run in one subprocess
with that pool (NPROC=64, read when the CPU client starts), which prints one JSON line of results. Should one
hang anyway, the subprocess dumps every thread's stack before its time limit, so the failure says where.

The code run there calls each kernel as one jitted program and waits for its result before the next dispatch
(`run_jitted`). The interpreter's callback threads dispatch small JAX ops of their own (`thread_map` makes each
thread's id a JAX scalar); with the main thread dispatching op by op meanwhile (an un-jitted MoE layer's sort, tile
table and gathers), the likely hang (not proven): a callback's op waits behind the main thread's, which waits for
the kernel, which waits for the callback. Under CPU load that race hung the MoE test (tests/models/test_moe.py) for its whole time limit in a CI-like
run, and reproducibly with two CPU-bound processes beside it on 2 cores; jitted and waited for, it passed there."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_in_subprocess(code: str, timeout: int = 600) -> dict:
    """Run `code` (Python that prints a JSON line last) in a CPU subprocess with a 64-thread XLA pool; a run
    past `timeout` seconds fails with every thread's stack."""
    from ddtree_kernels.mosaic_common import INTERPRET_NPROC

    env = dict(os.environ, NPROC=str(INTERPRET_NPROC), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "kernels"), env.get("PYTHONPATH", "")])
    # a hang dumps the stacks and exits before subprocess.run's own limit would kill it silently
    watchdog = f"import faulthandler; faulthandler.dump_traceback_later({timeout - 30}, exit=True)\n"
    proc = subprocess.run(
        [sys.executable, "-c", watchdog + code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        pytest.fail(f"interpret-mode run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_jitted(kernel, *arrays, **static):
    """kernel(*arrays, **static) as one jitted program (`static`: its keyword arguments, closed over), waited for:
    the rule of this module's docstring for code run in the interpret-mode subprocess."""
    import jax

    return jax.block_until_ready(jax.jit(lambda *args: kernel(*args, **static))(*arrays))


def tree_mask(rng, steps: int, capacity: int, kv_lengths) -> np.ndarray:
    """bool [B, T, S]: the prefix (keys < kv_length - T) visible to every query, the last T keys the tree's
    slots under a random ancestor mask (slot j's parent uniform in 0 .. j - 1), nothing from kv_length on."""
    masks = []
    for length in kv_lengths:
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, steps)]
        ancestor = np.zeros((steps, steps), bool)
        for t in range(steps):
            j = t
            while j >= 0:
                ancestor[t, j] = True
                j = parent[j]
        prefix = max(length - steps, 0)
        mask = np.zeros((steps, capacity), bool)
        mask[:, :prefix] = True
        slots = length - prefix  # < T when the row is shorter than the tree
        mask[:, prefix:length] = ancestor[:, steps - slots :]
        masks.append(mask)
    return np.stack(masks)


def compare(out, ref, mask) -> dict:
    """A case's result against its twin: shape, ||out - ref|| / ||ref|| (over the case and the worst of its
    (batch row, tree query, head) rows that see a key), finiteness, and whether the rows that see no key (mask
    [B, T, S]) are exactly zero."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    empty = ~np.asarray(mask).any(-1)  # [B, T] rows that see no key
    row_err = np.linalg.norm(out - ref, axis=-1)[~empty] / np.maximum(np.linalg.norm(ref, axis=-1)[~empty], 1e-30)
    return {
        "shape": list(out.shape),
        "rel_err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
        "max_row_err": float(row_err.max()) if row_err.size else 0.0,
        "finite": bool(np.isfinite(out).all()),
        "empty_rows_zero": bool((out[empty] == 0).all()),
        "empty_rows": int(empty.sum()),
    }


def assert_close(y, ref, tolerance: float) -> None:
    """A compiled kernel's output y against its reference: same shape, finite, and within `tolerance` both as the
    largest error over the largest value and as ||y - ref|| / ||ref||."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape and np.isfinite(y).all()
    assert np.abs(y - ref).max() / np.abs(ref).max() < tolerance
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tolerance
