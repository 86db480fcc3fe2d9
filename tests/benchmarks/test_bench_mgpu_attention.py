"""benchmarks/bench_gqa_mgpu.py and bench_mla_mgpu.py on CPU: a case row's columns, failures kept as results, the
split sweep and the progress line (`benchmarks.common`'s shared helpers), with every variant stood in for by the
XLA reference (the Mosaic kernels' interpret mode takes minutes a case on a CPU; their values are checked by
tests/kernels)."""

import jax
import numpy as np

import benchmarks.bench_gqa_mgpu as gqa
import benchmarks.bench_mla_mgpu as mla
from benchmarks.common import mgpu_case_line


def _failing(*args):
    raise RuntimeError("does not compile here")


def test_gqa_case_row(monkeypatch):
    xla = gqa.variants(64)["xla"]
    monkeypatch.setattr(gqa, "variants", lambda block_kv: {"mgpu": xla, "triton": _failing, "xla": xla})
    monkeypatch.setattr(gqa, "mgpu_with_splits", lambda num_splits, block_kv: xla if num_splits == 2 else _failing)
    row = gqa.run_case("embedded", 1, 9, 512, jax.random.key(0), 64, split_sweep=(2, 3))
    assert row["mgpu_rel_err"] == 0.0 and row["rel_err"] == 0.0  # the stand-in is the reference itself
    assert row["mgpu_us"] > 0 and np.isclose(row["mgpu_TFLOPs"], row["GFLOP"] * 1e9 / (row["mgpu_us"] * 1e-6) / 1e12)
    assert np.isnan(row["triton_us"]) and row["triton_error"] == "RuntimeError: does not compile here"
    assert row["mgpu_split_sweep_us"]["2"] > 0 and row["mgpu_split_sweep_us"]["3"].startswith("RuntimeError")
    line = mgpu_case_line("embedded", row, "others")
    assert line.startswith("embedded B=1 N=  9 ctx=   512") and "[triton_error: RuntimeError" in line
    assert "splits -> us" in line


def test_mla_case_row(monkeypatch):
    xla = mla.ATTEND["xla"]
    monkeypatch.setattr(mla, "ATTEND", {name: (_failing if name == "pallas" else xla) for name in mla.ATTEND})
    monkeypatch.setattr(mla, "mgpu_with_splits", lambda num_splits: xla)
    row = mla.run_case("mla8", 1, 9, 256, jax.random.key(1), split_sweep=(4,), impls=("mgpu", "pallas", "xla"))
    assert row["rel_err"] == 0.0 and row["mgpu_us"] > 0 and row["mgpu_split_sweep_us"]["4"] > 0
    assert np.isnan(row["pallas_us"]) and "does not compile here" in row["pallas_error"]
    assert np.isnan(row["mgpu_overlap_us"])  # not asked for (impls)
    assert mgpu_case_line("mla8 ", row, "").startswith("mla8  B=1 N=  9 ctx=   256")
