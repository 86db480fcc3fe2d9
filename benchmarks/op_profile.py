"""Device time per XLA op of a jitted call, read from a `jax.profiler` trace (no TensorBoard needed).

`op_times(fn, *args, runs=5)` runs fn once to compile, then `runs` times inside `jax.profiler.trace`,
reads the trace's XSpace back with `jax.profiler.ProfileData` and sums, per HLO op (the `hlo_op` stat
the runtime attaches to each kernel or thunk event), the event durations on the device planes
(`/device:GPU:*`; on CPU the host plane, where XLA's thunks carry the same stat). Returns rows sorted by
time, each {"op", "module", "us_per_run", "events_per_run"}: where a program's device time goes, kernel by
kernel, which a wall-clock median cannot say. Pallas kernels appear under their custom call's op name.

`format_op_table(rows, top)` prints the largest rows with each one's share of the total.

`op_sources(hlo_text)` names the JAX op path each HLO instruction came from (its metadata; with the source line
where the text holds one), and
`op_kinds(hlo_text)` names what each HLO instruction of a compiled program is (a GEMM, a Pallas / Mosaic kernel by
its name, an elementwise or reduce fusion, a copy, ...), and `kind_table(rows, kinds)` sums the op rows by kind:
where a program's time goes by kind of work when its op names (fusion.123) say nothing.

`device_timeline(fn, *args, runs=1)` reads the same trace as a timeline: every device event (start, duration,
op) in order, and `timeline_gaps(events)` sums where the device sat idle between them: busy and idle time over
the span and the largest idle gaps grouped by the (op before, op after) pair. Inside a compiled
`while_loop` the idle time is what the host adds (each iteration's predicate read back, launches outside any
CUDA graph), which the summed device time of `op_times` cannot show.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import warnings

import jax

STAGE_SCOPES = ("append", "draft", "tree_forward", "tree", "walk", "commit", "emit")  # engine.step's named scopes
NON_FORWARD_SCOPES = ("append", "tree", "walk", "commit", "emit")  # outside the target's and the drafter's forwards
_STAGE_RE = re.compile(r"ddtree_(" + "|".join(STAGE_SCOPES) + r")\b")


def op_stages(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the decode-step stage whose named scope (`engine.step`, "ddtree_<stage>")
    its op_name metadata carries. A fusion whose own metadata names no op (XLA drops it on many fusions)
    takes the stage most of its fused computation's instructions carry; instructions outside every stage
    are left out."""
    computation_stages: dict[str, dict[str, int]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$", line)
        if header:
            current = computation_stages.setdefault(header.group(1), {})
            continue
        if current is not None:
            found = re.search(r'op_name="([^"]*)"', line)
            match = _STAGE_RE.search(found.group(1)) if found else None
            if match:
                current[match.group(1)] = current.get(match.group(1), 0) + 1
    stages = {}
    for line in hlo_text.splitlines():
        instr = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
        if not instr:
            continue
        found = re.search(r'op_name="([^"]*)"', line)
        match = _STAGE_RE.search(found.group(1)) if found else None
        if match:
            stages[instr.group(1)] = match.group(1)
            continue
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        counts = computation_stages.get(calls.group(1), {}) if calls else {}
        if counts:
            stages[instr.group(1)] = max(counts, key=counts.get)
    return stages


def stage_table(ops: list[dict], stages: dict[str, str]) -> dict[str, dict]:
    """Per stage: {"us", "launches"} summed over `ops` rows (per step), "other" for ops of no stage."""
    table = {}
    for row in ops:
        stage = stages.get(row["op"], "other")
        entry = table.setdefault(stage, {"us": 0.0, "launches": 0.0})
        entry["us"] += row["us_per_run"]
        entry["launches"] += row["events_per_run"]
    return table


def stage_shares(table: dict[str, dict]) -> dict[str, float]:
    """From `stage_table`'s per-stage device time: {"device_forward_us", "device_non_forward_us",
    "device_other_us", "device_non_forward_share"}. Forward: the two models' forwards (draft, tree_forward);
    non-forward: the tree build, the walk, the commit, the drafter's context append and the output bookkeeping
    (`NON_FORWARD_SCOPES`: the stages `bench_engine`'s host-timed `non_forward_ms` = step - draft - tree_forward
    holds); other: ops outside every scope (the loop's control, the budget policy's scope, fusions XLA left without
    metadata, and in a whole generation's timeline its prefill). The share is of the whole device time, other
    included, as the host-timed share is of the whole step (0 when there is no device time)."""
    us = {stage: entry["us"] for stage, entry in table.items()}
    forward = sum(us.get(s, 0.0) for s in STAGE_SCOPES if s not in NON_FORWARD_SCOPES)
    non_forward = sum(us.get(s, 0.0) for s in NON_FORWARD_SCOPES)
    total = sum(us.values())
    return {
        "device_forward_us": forward,
        "device_non_forward_us": non_forward,
        "device_other_us": us.get("other", 0.0),
        "device_non_forward_share": non_forward / total if total > 0 else 0.0,
    }


def format_stages(stages: dict[str, dict]) -> str:
    """`stage_table`'s rows, then the non-forward share of the device time (`stage_shares`)."""
    lines = [
        "  by stage (device us per step, launches per step; under 'other': ops outside every stage, such as the "
        "loop's control and, in a whole generation, its prefill):"
    ]
    for stage in (*STAGE_SCOPES, "other"):
        if stage in stages:
            lines.append(f"  {stage:>13} {stages[stage]['us']:9.1f} us  x{stages[stage]['launches']:.1f}")
    shares = stage_shares(stages)
    lines.append(
        f"  non-forward ({', '.join(NON_FORWARD_SCOPES)}): {shares['device_non_forward_us']:.1f} us, "
        f"{shares['device_non_forward_share']:.1%} of the device time"
    )
    return "\n".join(lines)


def _stats(event) -> dict:
    with warnings.catch_warnings():  # the binding's stat type warns that it has no __module__ (harmless)
        warnings.simplefilter("ignore", DeprecationWarning)
        return {name: value for name, value in event.stats}


def _device_planes(profile) -> list:
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    return planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]


def _traced_events(fn, args: tuple, runs: int) -> list[dict]:
    """Every device event carrying an `hlo_op` stat while fn(*args) ran `runs` times (after one untraced call
    that compiles): {"op", "module", "start_ns", "duration_ns"}."""
    from jax.profiler import ProfileData

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    jax.block_until_ready(fn(*args))  # compile outside the trace
    events = []
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
        profile = ProfileData.from_file(paths[0])
        for plane in _device_planes(profile):
            for line in plane.lines:
                for event in line.events:
                    stats = _stats(event)
                    op = stats.get("hlo_op")
                    if op is None:
                        continue
                    events.append(
                        {
                            "op": op,
                            "module": stats.get("hlo_module", "?"),
                            "start_ns": event.start_ns,
                            "duration_ns": event.duration_ns,
                        }
                    )
    return events


def op_times(fn, *args, runs: int = 5) -> list[dict]:
    """Per-op device time of fn(*args) (module docstring); fn is called runs + 1 times."""
    total_ns = collections.Counter()
    count = collections.Counter()
    module = {}
    for event in _traced_events(fn, args, runs):
        op = event["op"]
        total_ns[op] += event["duration_ns"]
        count[op] += 1
        module.setdefault(op, event["module"])
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
            f"{r['op'][:70]}" + (f"  [{r['source'][:90]}]" if r.get("source") else "")
        )
    return "\n".join(lines)


def device_timeline(fn, *args, runs: int = 1) -> list[dict]:
    """The device events of fn(*args) called `runs` times (after one compiling call), sorted by start:
    {"op", "module", "start_ns", "duration_ns"} (module docstring)."""
    return sorted(_traced_events(fn, args, runs), key=lambda e: e["start_ns"])


def timeline_gaps(events: list[dict], *, min_gap_ns: int = 0, max_gap_ns: int | None = None) -> dict:
    """Busy and idle time of a sorted device timeline (overlapping events merged), and the idle gaps
    grouped by the ops on either side: {"span_ns", "busy_ns", "idle_ns", "events", "gaps": [{"before",
    "after", "count", "total_ns"}] largest first}. Gaps shorter than min_gap_ns count as idle but are not
    grouped; gaps longer than max_gap_ns (e.g. between two calls) are left out of idle and of the groups."""
    if not events:
        return {"span_ns": 0, "busy_ns": 0, "idle_ns": 0, "events": 0, "gaps": []}
    busy = idle = 0
    groups = collections.defaultdict(lambda: [0, 0])
    end = events[0]["start_ns"]
    last_op = None
    first = events[0]["start_ns"]
    skipped = 0
    for event in events:
        start, stop = event["start_ns"], event["start_ns"] + event["duration_ns"]
        if start > end and last_op is not None:
            gap = start - end
            if max_gap_ns is not None and gap > max_gap_ns:
                skipped += gap
            else:
                idle += gap
                if gap >= min_gap_ns:
                    group = groups[(last_op, event["op"])]
                    group[0] += 1
                    group[1] += gap
        busy += max(0, stop - max(start, end))
        if stop >= end:
            end, last_op = stop, event["op"]
    gaps = [{"before": b, "after": a, "count": c, "total_ns": t} for (b, a), (c, t) in groups.items()]
    return {
        "span_ns": end - first - skipped,
        "busy_ns": busy,
        "idle_ns": idle,
        "events": len(events),
        "gaps": sorted(gaps, key=lambda g: -g["total_ns"]),
    }


def per_call_timeline(fn, sets: list[tuple], shared: tuple = ()) -> dict:
    """fn(*shared, *set) called once on each input set inside one jitted program (as `common.in_jit_seconds` times
    it), read as a device timeline: {"calls", "events_per_call", "busy_us_per_call", "idle_us_per_call",
    "span_us_per_call"}. Busy is what the device spent in kernels, idle the gaps between them inside the program
    (launch latency, host work of a custom call): busy + idle (the span) is what a call costs back to back. Under
    the profiler XLA usually runs without command buffers (CUDA graphs; `xla_enable_command_buffers_during_profiling`
    is off by default), kernels launched one by one, so the idle part can exceed a graph's; but a traced program
    may keep some (the K2.6 prefill's loop ran as 5 command-buffer events): `XLA_FLAGS=
    --xla_gpu_enable_command_buffer=` makes sure."""
    program = jax.jit(lambda shared, sets: [fn(*shared, *args) for args in sets])
    summary = timeline_gaps(device_timeline(program, tuple(shared), list(sets)))
    calls = len(sets)
    return {
        "calls": calls,
        "events_per_call": summary["events"] / calls,
        "busy_us_per_call": summary["busy_ns"] / 1e3 / calls,
        "idle_us_per_call": summary["idle_ns"] / 1e3 / calls,
        "span_us_per_call": summary["span_ns"] / 1e3 / calls,
    }


def device_seconds(fn, sets: list[tuple], *, shared: tuple = (), runs: int = 3) -> float:
    """Seconds of device time a call of fn(*shared, *set) costs back to back: the median over `runs` traced
    programs (each calls fn once on every set, `per_call_timeline`) of the span from the program's first kernel
    to its last, per call, with kernels usually launched one by one (`per_call_timeline`: command buffers under the
    profiler). Unlike a wall-clock time of the program (`common.in_jit_seconds`), it holds no host dispatch or
    synchronisation of the program: at a few sets per program those add ~100 us a call on the H200 (mla8 at 32k
    keys: 149 us wall against 53 on the device, attention_mgpu_7ba6e57_profile.json)."""
    spans = sorted(per_call_timeline(fn, sets, shared)["span_us_per_call"] for _ in range(runs))
    return spans[len(spans) // 2] * 1e-6


def device_busy_seconds(fn, sets: list[tuple], *, shared: tuple = (), runs: int = 3) -> float:
    """Seconds the device spends in kernels per call of fn(*shared, *set): the median over `runs` traced programs
    of `per_call_timeline`'s busy time (the gaps between kernels left out). For a program whose gaps are not the
    call's own cost: a `lax.scan` of calls, whose while loop reads its predicate back to the host every iteration
    when kernels launch one by one, a gap of the loop, not of what it runs."""
    busy = sorted(per_call_timeline(fn, sets, shared)["busy_us_per_call"] for _ in range(runs))
    return busy[len(busy) // 2] * 1e-6


def profile_into(row: dict, name: str, fn, sets: list[tuple], top: int) -> None:
    """The kernel benchmarks' `--profile-top` for one variant `name`: fn's device time per op on the first set
    (`op_times`; its `top` largest ops in row[name_profile], their sum in row[name_device_us]) and the in-jit
    timeline of fn on up to 4 sets (row[name_timeline]), both printed; a profile that fails is recorded in
    row[name_profile_error] and the row's timings stand."""
    try:
        ops = op_times(fn, *sets[0])
        row[f"{name}_profile"] = ops[:top]
        row[f"{name}_device_us"] = sum(op["us_per_run"] for op in ops)
        print(f"  {name} ops:\n" + format_op_table(ops, top), flush=True)
        timeline = per_call_timeline(fn, sets[:4])
        row[f"{name}_timeline"] = timeline
        print(
            f"  {name} in-jit timeline: busy {timeline['busy_us_per_call']:.1f} us + idle "
            f"{timeline['idle_us_per_call']:.1f} us a call, {timeline['events_per_call']:.1f} kernels a call",
            flush=True,
        )
    except Exception as err:  # noqa: BLE001 - a profile that fails is noted, the timings stand
        row[f"{name}_profile_error"] = f"{type(err).__name__}: {str(err)[:200]}"


_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? ([\w\-]+)\(")
CONTAINER_KINDS = ("while", "conditional", "call")  # their events (CPU thunks) span their bodies' ops
# a CUDA graph XLA built (no HLO instruction of that name): its kernels are not seen one by one
COMMAND_BUFFER = "command buffer (XLA_FLAGS=--xla_gpu_enable_command_buffer= shows its kernels)"
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) (?:\(.*\) -> .*)?\{\s*$")
_GEMM_OPS = (" dot(", " convolution(", " ragged-dot(")


_BACKEND_NAME_RES = (
    re.compile(r'(?<![\w\\])name\s*=\s*"([\w.\-]+)"'),  # an FFI custom call's attributes: {ir = ..., name = "..."}
    re.compile(r'\\?"name\\?"\s*:\s*\\?"([\w.\-]+)'),  # a JSON backend config
)
_JIT_NAME_RE = re.compile(r"jit\(([\w.\-]+)\)")


def _kernel_name(line: str) -> str | None:
    """A Pallas / Mosaic GPU custom call's kernel name: its backend config's "name" (Pallas on Triton: the kernel
    function's), else the innermost jit(...) of its op_name metadata (Mosaic GPU's config has no name: the
    jitted entry that called it), else None."""
    for pattern in _BACKEND_NAME_RES:
        found = pattern.search(line)
        if found:
            return found.group(1)
    op_name = re.search(r'op_name="([^"]*)"', line)
    jits = _JIT_NAME_RE.findall(op_name.group(1)) if op_name else []
    return jits[-1] if jits else None


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> what it is, from a compiled module's text (`compiled.as_text()`):
      "gemm"              a cuBLAS / cuBLASLt call, a Triton GEMM fusion, or a fusion whose computation holds a dot
      "kernel:<name>"     a Pallas (Triton) or Mosaic GPU custom call, by `_kernel_name` (else its target)
      "custom-call:<t>"   another custom call, by its target
      "fusion"            a fusion with no dot (elementwise, reductions, gathers, ...)
      "<opcode>"          anything else XLA launches on its own (copy, dynamic-update-slice, sort, ...)
    Every computation's instructions are named (those inside a fusion too); a profile only ever looks up what
    launches."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and " = " not in line:
            current = computations.setdefault(header.group(1), [])
            continue
        if current is not None:
            current.append(line)
    with_dot = {name for name, lines in computations.items() if any(op in ln for ln in lines for op in _GEMM_OPS)}
    kinds = {}
    for line in hlo_text.splitlines():
        instr = _INSTR_RE.match(line)
        if not instr:
            continue
        name, opcode = instr.groups()
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            target = target.group(1) if target else "?"
            if "cublas" in target.lower():
                kinds[name] = "gemm"
            elif "triton" in target.lower() or "mosaic" in target.lower():
                kinds[name] = f"kernel:{_kernel_name(line) or target}"
            else:
                kinds[name] = f"custom-call:{target}"
        elif opcode == "fusion":
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            gemm = "triton_gemm" in line or "cublas" in line.lower() or (calls and calls.group(1) in with_dot)
            kinds[name] = "gemm" if gemm else "fusion"
        elif any(op in line for op in _GEMM_OPS):
            kinds[name] = "gemm"
        else:
            kinds[name] = opcode
    return kinds


_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_SOURCE_RE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


def op_sources(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> where it came from, from the `metadata` XLA keeps on each instruction of a compiled
    module's text: the JAX op path's last three parts (jit and named scopes, e.g. "jit(sort)/sort") and, where the
    text holds it, the source file:line (compiled modules of this JAX keep a stack-frame id instead), so that a
    profile's fusion.123 says which op of the model it runs. Instructions without metadata are left out."""
    sources = {}
    for line in hlo_text.splitlines():
        instr = _INSTR_RE.match(line)
        if not instr or "metadata=" not in line:
            continue
        op_name = _OP_NAME_RE.search(line)
        source = _SOURCE_RE.search(line)
        parts = []
        if op_name:
            parts.append("/".join(op_name.group(1).split("/")[-3:]))
        if source:
            parts.append(f"@ {os.path.basename(source.group(1))}:{source.group(2)}")
        if parts:
            sources[instr.group(1)] = " ".join(parts)
    return sources


def kind_table(rows: list[dict], kinds: dict[str, str]) -> list[dict]:
    """`op_times` rows summed by `op_kinds` kind: [{"kind", "us_per_run", "events_per_run", "ops"}], largest
    first; an op the module text does not name is "other", or `COMMAND_BUFFER` for XLA's CUDA graphs (a traced
    program may keep them: the K2.6 prefill's loop ran as 5 command buffers under the profiler). Containers (`CONTAINER_KINDS`:
    a while loop's event spans its body's, which are counted themselves) are left out."""
    table: dict[str, dict] = {}
    for row in rows:
        kind = kinds.get(row["op"], COMMAND_BUFFER if row["op"].startswith("command_buffer") else "other")
        if kind in CONTAINER_KINDS:
            continue
        entry = table.setdefault(kind, {"kind": kind, "us_per_run": 0.0, "events_per_run": 0.0, "ops": 0})
        entry["us_per_run"] += row["us_per_run"]
        entry["events_per_run"] += row["events_per_run"]
        entry["ops"] += 1
    return sorted(table.values(), key=lambda r: -r["us_per_run"])


def format_kind_table(table: list[dict]) -> str:
    """`kind_table`'s rows: time per run (us), share, launches per run, distinct ops."""
    total = sum(r["us_per_run"] for r in table) or 1.0
    return "\n".join(
        f"  {r['us_per_run']:11.1f} us {100 * r['us_per_run'] / total:5.1f}%  x{r['events_per_run']:<7.1f} "
        f"{r['ops']:4d} ops  {r['kind'][:60]}"
        for r in table
    )


def format_profile(kinds: list[dict], ops: list[dict], top: int) -> str:
    """A profiled program in a few lines: its device time and launches (over `kind_table`'s rows, containers left
    out), the time by kind of op, and its `top` largest ops."""
    total_us = sum(r["us_per_run"] for r in kinds)
    launches = sum(r["events_per_run"] for r in kinds)
    return (
        f"  profiled: {total_us / 1e3:.2f} ms of device time in {launches:.0f} launches\n"
        + format_kind_table(kinds)
        + "\n"
        + format_op_table(ops, top=top)
    )
