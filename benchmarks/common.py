"""Shared benchmark helpers: timing, the device description, and result files.

A result file records the date, the device, and the commit (passed in with --commit, since the GPU copy
of the repository has no git), so BENCHMARKS.md rows can be traced to code.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import jax


def device_description() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()} (jax {jax.__version__})"


def time_call(fn, inputs: list, *, warmup: int = 3, reps: int = 50) -> dict:
    """Median wall time (us) of fn(x) + block_until_ready, rotating over `inputs` (defeats caching)."""
    for i in range(warmup):
        jax.block_until_ready(fn(inputs[i % len(inputs)]))
    samples = []
    for i in range(reps):
        x = inputs[i % len(inputs)]
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(9 * len(samples)) // 10],
        "reps": reps,
    }


def median_seconds(fn, *args, runs: int = 7) -> float:
    """Median wall seconds of fn(*args) + block_until_ready over `runs` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(reps: int = 20) -> float:
    """bytes/s (read + write) of an XLA elementwise copy of 1 GiB of bf16, `reps` copies inside one jit
    (the achievable-bandwidth roof the kernels are compared with, measured in the same run)."""
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.bfloat16)

    @jax.jit
    def copies(x):
        return jax.lax.fori_loop(0, reps, lambda i, y: y * jnp.asarray(1, y.dtype) + jnp.asarray(i, y.dtype), x)

    return 2 * x.size * x.dtype.itemsize * reps / median_seconds(copies, x)


def write_result(name: str, payload: dict, commit: str, out_dir: str | None = None) -> str:
    out_dir = out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_description(),
        "commit": commit,
        **payload,
    }
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
