"""benchmarks/bench_tree_sampling.py: every timed call reads its own logits (no loop-invariant work for XLA
to hoist), a tiny case runs end to end on CPU, and the pipelined timer counts seconds per call."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_tree_sampling
from benchmarks.common import time_calls
from ddtree_jax.sampling import SamplingParams


def test_input_sets_are_distinct_and_exceed_the_l2(monkeypatch):
    monkeypatch.setattr(bench_tree_sampling, "ROTATE_BYTES", 4 * 9 * 300 * 2)  # small enough for a CPU test
    params = SamplingParams.create(1, temperature=1.0, top_p=0.9)
    sets = bench_tree_sampling.input_sets(1, 9, 300, 0, None, params)
    assert len(sets) == 4  # ceil(ROTATE_BYTES / one set's logits bytes)
    logits = [np.asarray(s[1], np.float32) for s in sets]
    assert all(not np.array_equal(logits[i], logits[i + 1]) for i in range(3))  # fresh logits for every call
    keys = [np.asarray(jax.random.key_data(s[3])) for s in sets]
    assert all(not np.array_equal(keys[i], keys[i + 1]) for i in range(3))


def test_a_tiny_case_runs_and_agrees():
    row = bench_tree_sampling.run_case(1, 9, 300, 0.9, copy_bw=1e12, runs=1)
    assert row["agree"] == 1.0 and row["input_sets"] >= 2
    assert row["xla_us"] > 0 and row["pallas_us"] > 0 and row["x_roofline"] > 0


def test_layout_columns_sit_side_by_side():
    """--layouts single,single:8x1024: both kernel tilings timed on the same input sets, each its own column."""
    row = bench_tree_sampling.run_case(1, 9, 300, 0.9, copy_bw=1e12, runs=1, layouts=("single", "single:8x1024"))
    assert row["pallas_single_us"] > 0 and row["pallas_single_8x1024_us"] > 0
    assert row["pallas_us"] == row["pallas_single_us"]  # speedup and x_roofline: the first layout's
    name, tiling = bench_tree_sampling.kernel_layout("single:8x1024")
    assert name == "single" and (tiling.warps, tiling.search_block) == (8, 1024)


def test_the_pipelined_timer_counts_seconds_per_call():
    calls = []

    def fn(x):
        calls.append(int(x))
        return jnp.asarray(x)

    timing = time_calls(fn, [(1,), (2,), (3,)], runs=2, warmup=1, pipeline=4)
    assert calls == [1, 1, 2, 3, 1, 2, 3, 1, 2]  # warm-up, then 2 samples of 4 calls rotating the sets
    assert len(timing.seconds) == 2 and all(s >= 0 for s in timing.seconds)
