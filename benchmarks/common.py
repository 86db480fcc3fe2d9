"""Shared benchmark helpers: the one timer (`time_calls`, `median_seconds`), the device description, result
files, and the Mosaic kernel benchmarks' H200 roofline, rotated input sets, per-variant columns, split sweep and
progress line.

A result file records the date, the device, and the commit (passed in with --commit, since the GPU copy
of the repository has no git), so BENCHMARKS.md rows can be traced to code.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Sequence

import jax

from benchmarks.op_profile import device_seconds

COPY_BANDWIDTH = 4.3e12  # bytes/s read + write, XLA copy on this H200 (BENCHMARKS.md)
PEAK_FLOPS = 790e12  # bf16 matmul rate measured on this H200
L2_BYTES = 50 << 20
MIN_SETS = 4


def device_description() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()} (jax {jax.__version__})"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall seconds of the timed calls of `time_calls`, sorted ascending."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def summary_us(self) -> dict:
        """{"median_us", "p10_us", "p90_us", "reps"}: microseconds; p10 / p90 the sorted samples at
        len // 10 and 9 * len // 10."""
        us = [s * 1e6 for s in self.seconds]
        return {
            "median_us": statistics.median(us),
            "p10_us": us[len(us) // 10],
            "p90_us": us[(9 * len(us)) // 10],
            "reps": len(us),
        }


def time_calls(fn, arg_sets: Sequence[tuple], *, runs: int = 7, warmup: int = 1, pipeline: int = 1) -> Timing:
    """The one benchmark timer: `warmup` untimed calls, then `runs` timed samples, each of `pipeline`
    back-to-back calls fn(*arg_sets[i % n]) (i counts the calls from 0 in each phase; several argument
    sets rotate the inputs, so no call reuses the previous call's data) and one jax.block_until_ready on
    the last result; a sample is its seconds per call. pipeline 1: one call's latency, dispatch included;
    pipeline > 1: the calls queue on the device (async dispatch), so small kernels are timed without
    their host dispatch gaps. fn may close over state it updates (a donated cache fed back), with
    arg_sets = [()]."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    call = 0
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(pipeline):
            out = fn(*arg_sets[call % len(arg_sets)])
            call += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / pipeline)
    return Timing(tuple(sorted(samples)))


def median_seconds(fn, *args, runs: int = 7, warmup: int = 1) -> float:
    """Median wall seconds of fn(*args) + block_until_ready over `runs` calls, after `warmup` calls."""
    return time_calls(fn, [args], runs=runs, warmup=warmup).median


def in_jit_seconds(fn, sets: Sequence[tuple], *, shared: tuple = (), runs: int = 7) -> float:
    """Seconds per call of fn(*shared, *set): one jitted program calls it once on each input set in turn and
    returns every output whole (so XLA cannot trim a call to the part a reduction would read), timed by
    `time_calls` (`runs` samples after 2 warm-ups) and divided by the number of sets. Inside one program the
    calls run back to back on the device: no host dispatch per call, which a host-queued loop of small
    kernels measures instead."""

    @jax.jit
    def run(shared, sets):
        return [fn(*shared, *args) for args in sets]

    return time_calls(run, [(tuple(shared), list(sets))], runs=runs, warmup=2).median / len(sets)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| (Frobenius, float32)."""
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def max_relative_error(out, ref) -> float:
    """max |out - ref| / max |ref| (float32)."""
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def error_text(err: Exception, limit: int = 300) -> str:
    """A failure as a result row records it: "ExceptionType: message", the message cut to `limit` characters."""
    return f"{type(err).__name__}: {str(err)[:limit]}"


def time_variant_into(row: dict, name: str, fn, sets: list[tuple], ref, *, flops: float, nbytes: float, roof_s: float):
    """The kernel benchmarks' columns of one variant `name` of fn (inputs `sets`): row[name_rel_err] (fn(*sets[0])
    against ref; none when ref is None), name_wall_us (`in_jit_seconds`), name_us (device time,
    `op_profile.device_seconds`), name_TFLOPs / name_GBps (flops and nbytes per call over it) and name_of_roofline
    (over roof_s seconds). A variant that fails (e.g. does not compile) is a result: name_us = nan and
    row[name_error] (`error_text`)."""
    try:
        out = fn(*sets[0])
        if ref is not None:
            row[f"{name}_rel_err"] = relative_error(out, ref)
        row[f"{name}_wall_us"] = in_jit_seconds(fn, sets) * 1e6
        seconds = device_seconds(fn, sets)
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_TFLOPs"] = flops / seconds / 1e12
        row[f"{name}_GBps"] = nbytes / seconds / 1e9
        row[f"{name}_of_roofline"] = seconds / roof_s
    except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result
        row[f"{name}_us"] = float("nan")
        row[f"{name}_error"] = error_text(err)


def time_variants_into(row: dict, fns: dict, sets: list[tuple], *, flops: float, nbytes: float, timed=None) -> None:
    """Every variant of `fns` (name -> fn, in order) on `sets` into row: the reference fns["xla"](*sets[0]) first
    (its failure: row["xla_error"], `error_text`; the variants are then timed without rel_err), then
    `time_variant_into` for each name in `timed` (default: all) against the roofline of `flops` FLOPs and
    `nbytes` bytes (`roofline_seconds`); a name not timed gets name_us = nan."""
    ref = None
    try:
        ref = fns["xla"](*sets[0])
    except Exception as err:  # noqa: BLE001 - recorded, the kernels still run
        row["xla_error"] = error_text(err)
    roof_s = roofline_seconds(flops, nbytes)
    for name, fn in fns.items():
        if timed is not None and name not in timed:
            row[f"{name}_us"] = float("nan")  # not asked for
            continue
        time_variant_into(row, name, fn, sets, ref, flops=flops, nbytes=nbytes, roof_s=roof_s)


def roofline_seconds(flops: float, nbytes: float) -> float:
    """Seconds of one call on the H200 roofline: max(nbytes / COPY_BANDWIDTH, flops / PEAK_FLOPS)."""
    return max(nbytes / COPY_BANDWIDTH, flops / PEAK_FLOPS)


def roofline_columns(flops: float, nbytes: float) -> dict:
    """A kernel case row's counted columns of one call of `flops` FLOPs moving `nbytes` bytes: "GFLOP", "MB",
    "roofline_us" (`roofline_seconds`) and "bound" ("compute" when flops / PEAK_FLOPS is the larger, else
    "memory")."""
    return {
        "GFLOP": flops / 1e9,
        "MB": nbytes / 1e6,
        "roofline_us": roofline_seconds(flops, nbytes) * 1e6,
        "bound": "compute" if flops / PEAK_FLOPS > nbytes / COPY_BANDWIDTH else "memory",
    }


def roofline_header(commit: str) -> str:
    """The Mosaic kernel benchmarks' first line: the device, the commit and the roofline's two rates."""
    return (
        f"device: {device_description()}; commit {commit}; roofline {COPY_BANDWIDTH / 1e12:.1f} TB/s, "
        f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    )


def roofline_payload(rows: list[dict]) -> dict:
    """A Mosaic kernel benchmark's result (`write_result` payload): its case rows and the roofline's rates."""
    return {"rows": rows, "copy_bandwidth_Bps": COPY_BANDWIDTH, "peak_flops": PEAK_FLOPS}


def rotating_set_count(nbytes: float, max_sets: int) -> int:
    """How many input sets of `nbytes` bytes one timed program rotates through: enough that together they exceed
    twice L2_BYTES (no call reads the previous call's data from L2), at least MIN_SETS, at most `max_sets`."""
    return min(max_sets, max(MIN_SETS, math.ceil(2 * L2_BYTES / nbytes)))


def block_capacity(keys: int, block: int = 64) -> int:
    """A cache's capacity for `keys` keys in whole `block`-key blocks, as an engine allocates it (the Mosaic
    kernels' TMA reads whole key blocks; a ragged capacity would make their wrappers pad, i.e. copy, the cache)."""
    return -(-keys // block) * block


def int_list_argument(parser, name: str, text: str) -> list[int]:
    """`text` as distinct comma-separated integers >= 1, or a parser error naming `--name` (the drivers' lists of
    layers, budgets, contexts, batches)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"--{name} {text!r}: expected comma-separated integers")
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        parser.error(f"--{name} {text!r}: expected distinct integers >= 1")
    return values


def temperature_argument(text: str) -> float:
    """An argparse type: a sampling temperature, finite and >= 0 (0: greedy), so a bad one fails at parse time,
    not after a model is built."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a temperature must be finite and >= 0, got {text!r}")
    return value


def random_tree_mask(rng, batch: int, steps: int, context: int):
    """bool [B, N, context + N] (numpy): the whole prefix, then each slot's ancestors and itself (slot 0 = root;
    slot i's parent uniform in 0 .. i - 1)."""
    import numpy as np

    mask = np.zeros((batch, steps, context + steps), bool)
    mask[:, :, :context] = True
    for b in range(batch):
        ancestors = np.zeros((steps, steps), bool)
        for i in range(steps):
            if i:
                ancestors[i] = ancestors[rng.integers(0, i)]
            ancestors[i, i] = True
        mask[b, :, context:] = ancestors
    return mask


def padded_tree_mask(batch: int, steps: int, context: int, capacity: int) -> jax.Array:
    """bool [B, N, capacity]: `random_tree_mask` (rng seeded steps * 7 + batch, as `bench_attention` seeds it) over
    context + N keys, then capacity - context - N keys no row sees."""
    import jax.numpy as jnp
    import numpy as np

    mask = random_tree_mask(np.random.default_rng(steps * 7 + batch), batch, steps, context)
    return jnp.asarray(np.pad(mask, ((0, 0), (0, 0), (0, capacity - context - steps))))


def split_sweep_into(row: dict, split_counts, with_splits, sets: list[tuple], error_limit: int = 300) -> None:
    """The kernel at other key-split counts: row["mgpu_split_sweep_us"][str(n)] = device us of with_splits(n) on
    `sets` for each n of split_counts (`op_profile.device_seconds`), or the failure (`error_text`)."""
    for num_splits in split_counts:
        try:
            seconds = device_seconds(with_splits(num_splits), sets)
            row.setdefault("mgpu_split_sweep_us", {})[str(num_splits)] = seconds * 1e6
        except Exception as err:  # noqa: BLE001
            row.setdefault("mgpu_split_sweep_us", {})[str(num_splits)] = error_text(err, error_limit)


def add_profile_top_argument(parser) -> None:
    """The Mosaic kernel benchmarks' --profile-top option (`op_profile.profile_into`) on an argparse parser."""
    parser.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="also print the N largest device ops of one mgpu / xla call (input set 0 repeated: L2-warm at small "
        "sizes, unlike the rotated sets of the *_us columns) and the in-jit timeline",
    )


def mgpu_case_line(label: str, row: dict, others: str) -> str:
    """The Mosaic kernel benchmarks' progress line of one case row: label, B, N, context, bound and roofline, the
    mgpu kernel's device us, TFLOP/s, GB/s, x roofline and relative error, then `others` (the other variants'
    columns), the failures (row[*_error]) and the split sweep (row["mgpu_split_sweep_us"]), when any."""
    errors = "; ".join(f"{k}: {v}" for k, v in row.items() if k.endswith("_error"))
    return (
        f"{label} B={row['B']} N={row['N']:3d} ctx={row['context']:6d} ({row['bound']}, roof {row['roofline_us']:.1f} "
        f"us): mgpu {row['mgpu_us']:8.1f} us ({row['mgpu_TFLOPs']:5.1f} TFLOP/s, {row['mgpu_GBps']:5.0f} GB/s, "
        f"{row['mgpu_of_roofline']:5.2f}x roof, rel err {row['rel_err']:.1e})  {others}"
        + (f"  [{errors}]" if errors else "")
        + (f"\n      splits -> us: {row['mgpu_split_sweep_us']}" if "mgpu_split_sweep_us" in row else "")
    )


MGPU_TABLE_HEADER = ["B", "N", "context", "bound", "roof us", "mgpu us", "TFLOP/s"]


def mgpu_table_cells(row: dict) -> list:
    """The Mosaic kernel benchmarks' leading table cells of one case row, under MGPU_TABLE_HEADER: B, N, context,
    bound, roofline us, and the mgpu kernel's device us and TFLOP/s."""
    return [
        row["B"],
        row["N"],
        row["context"],
        row["bound"],
        row["roofline_us"],
        row["mgpu_us"],
        f"{row['mgpu_TFLOPs']:.0f}",
    ]


def copy_bandwidth(reps: int = 20) -> float:
    """bytes/s (read + write) of an XLA elementwise copy of 1 GiB of bf16, `reps` copies inside one jit
    (the achievable-bandwidth roof the kernels are compared with, measured in the same run)."""
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.bfloat16)

    @jax.jit
    def copies(x):
        return jax.lax.fori_loop(0, reps, lambda i, y: y * jnp.asarray(1, y.dtype) + jnp.asarray(i, y.dtype), x)

    return 2 * x.size * x.dtype.itemsize * reps / median_seconds(copies, x)


def result_dir(out_dir: str | None = None) -> str:
    """Where `write_result` writes: out_dir, else $OUT, else benchmarks/results."""
    return out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")


def out_dir_problem(out_dir: str | None = None) -> str | None:
    """Why `write_result` could not write into `result_dir(out_dir)` (a file there, or an ancestor that is a file
    or not writable), else None: a driver checks it before its runs, so a bad --out fails at once, not after them."""
    path = result_dir(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path!r} is a file, not a directory"
    return ancestor_problem(path)


def ancestor_problem(path: str, folder: str | None = None) -> str | None:
    """Why `folder` (default `path`) cannot be made and written into (its nearest existing ancestor is a file or
    not writable), naming `path`, else None: what an output checked before a long run needs (`out_dir_problem`,
    the studies' `output_problem`)."""
    parent = os.path.abspath(path if folder is None else folder)
    while not os.path.exists(parent):  # the nearest existing ancestor: the writer makes the rest
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{path!r}: {parent!r} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path!r}: {parent!r} is not writable"
    return None


def write_result(name: str, payload: dict, commit: str, out_dir: str | None = None) -> str:
    out_dir = result_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
