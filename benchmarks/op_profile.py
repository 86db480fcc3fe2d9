"""Device time per XLA op of a jitted call, read from a `jax.profiler` trace (no TensorBoard needed).

`op_times(fn, *args, runs=5)` runs fn once to compile, then `runs` times inside `jax.profiler.trace`,
reads the trace's XSpace back with `jax.profiler.ProfileData` and sums, per HLO op (the `hlo_op` stat
the runtime attaches to each kernel or thunk event), the event durations on the device planes
(`/device:GPU:*`; on CPU the host plane, where XLA's thunks carry the same stat). Returns rows sorted by
time, each {"op", "module", "us_per_run", "events_per_run"}: where a program's device time goes, kernel by
kernel, which a wall-clock median cannot say. Pallas kernels appear under their custom call's op name.

`format_op_table(rows, top)` prints the largest rows with each one's share of the total.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import warnings

import jax


def _stats(event) -> dict:
    with warnings.catch_warnings():  # the binding's stat type warns that it has no __module__ (harmless)
        warnings.simplefilter("ignore", DeprecationWarning)
        return {name: value for name, value in event.stats}


def _device_planes(profile) -> list:
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    return planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]


def op_times(fn, *args, runs: int = 5) -> list[dict]:
    """Per-op device time of fn(*args) (module docstring); fn is called runs + 1 times."""
    from jax.profiler import ProfileData

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    jax.block_until_ready(fn(*args))  # compile outside the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
        profile = ProfileData.from_file(paths[0])
        total_ns = collections.Counter()
        count = collections.Counter()
        module = {}
        for plane in _device_planes(profile):
            for line in plane.lines:
                for event in line.events:
                    stats = _stats(event)
                    op = stats.get("hlo_op")
                    if op is None:
                        continue
                    total_ns[op] += event.duration_ns
                    count[op] += 1
                    module.setdefault(op, stats.get("hlo_module", "?"))
    rows = [
        {"op": op, "module": module[op], "us_per_run": total_ns[op] / 1e3 / runs, "events_per_run": count[op] / runs}
        for op in total_ns
    ]
    return sorted(rows, key=lambda r: -r["us_per_run"])


def format_op_table(rows: list[dict], top: int = 12) -> str:
    """The `top` largest ops: time per run (us), share of the summed device time, events per run."""
    total = sum(r["us_per_run"] for r in rows) or 1.0
    lines = [f"  total device time {total:9.1f} us per run over {len(rows)} ops"]
    for r in rows[:top]:
        lines.append(
            f"  {r['us_per_run']:9.1f} us {100 * r['us_per_run'] / total:5.1f}%  x{r['events_per_run']:<5.1f} "
            f"{r['op'][:70]}"
        )
    return "\n".join(lines)
