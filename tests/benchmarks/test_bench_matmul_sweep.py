"""benchmarks/bench_matmul.py --grouped-sweep on a tiny expert shape (CPU, interpret mode): one row per
tiling with its time, TFLOP/s and the plan's splits, the JSON written."""

import json

import jax
import pytest

import benchmarks.bench_matmul as bench
from benchmarks.bench_matmul import PREFILL_SWEEP_TILES, grouped_sweep


@pytest.fixture(autouse=True)
def _one_timed_product(monkeypatch):
    """One product timed once (interpret mode is slow; the rows' layout is what is checked, not the times)."""
    monkeypatch.setattr(bench, "REPS", 1)
    monkeypatch.setattr(bench, "TIMING_RUNS", 1)


def test_grouped_sweep_rows_per_tiling(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    tiles = PREFILL_SWEEP_TILES[:2]  # the decode default and its one-dot form
    rows = grouped_sweep(
        [4], float("nan"), jax.random.key(0), "t", tiles_list=tiles, experts=8, projections=(("gate", 64, 512),)
    )
    assert [(r["block_n"], r["block_k"]) for r in rows] == [(t.block_n, t.block_k) for t in tiles]
    for r in rows:
        assert r["assignments"] == 32 and r["us"] > 0 and r["splits"] == 1  # K = 512: 1-2 K tiles, too few to split
        assert abs(r["TFLOPs"] - 2 * 32 * 64 * 512 / (r["us"] * 1e-6) / 1e12) < 1e-9
    assert len(json.loads((tmp_path / "grouped_sweep_t.json").read_text())["rows"]) == 2


def test_tile_fields_read_back_the_tiling():
    from benchmarks.bench_matmul import SWEEP_TILES, GroupedTiles, tile_fields

    for tiles in SWEEP_TILES + PREFILL_SWEEP_TILES:
        row = {**vars(tiles), "splits": tiles.splits or 3, "splits_rule": tiles.splits is None}
        assert GroupedTiles(**tile_fields(row)) == tiles


def test_grouped_sweep_records_the_tiling_that_runs(tmp_path, monkeypatch):
    """A requested tiling too large for the shared memory runs cut down (`fit_grouped_tiles`): the row says so, and
    a second request that runs as the same tiling is skipped, not timed twice under another name."""
    from benchmarks.bench_matmul import GroupedTiles

    monkeypatch.setenv("OUT", str(tmp_path))
    # 64 rows: 256-wide K steps, 2 stages (with the dequantised one-dot tile, 128 x 512 at 2 stages does not fit: the
    # H200 refused it, 294,912 bytes)
    big = GroupedTiles(block_n=128, block_k=1024, num_stages=4, one_dot=True)
    same = GroupedTiles(block_n=128, block_k=512, num_stages=2, one_dot=True)
    rows = grouped_sweep(
        [16], float("nan"), jax.random.key(0), "t", tiles_list=[big, same], experts=2, projections=(("gate", 32, 1024),)
    )
    assert len(rows) == 1
    (row,) = rows
    assert (row["block_k"], row["num_stages"], row["block_m"]) == (256, 2, 64)
    assert row["requested"]["block_k"] == 1024 and row["requested"]["num_stages"] == 4


def test_grouped_sweep_times_the_mosaic_kernel(tmp_path):
    """`--grouped-impl mosaic`: the Mosaic GPU kernel timed on the same inputs (interpret mode, in a subprocess
    with NPROC=64: its warpgroups are threads), one row per tiling with its error against the Triton kernel."""
    from tests.kernels.mosaic_interpret import run_in_subprocess

    out = run_in_subprocess(
        "import json, os, jax\n"
        f"os.environ['OUT'] = {str(tmp_path)!r}\n"
        "import benchmarks.bench_matmul as bench\n"
        "bench.REPS = bench.TIMING_RUNS = 1  # one timed product: the rows' layout is what is checked\n"
        "from benchmarks.bench_matmul import PREFILL_SWEEP_TILES, grouped_sweep\n"
        "rows = grouped_sweep([4], float('nan'), jax.random.key(0), 't', tiles_list=PREFILL_SWEEP_TILES[:1],\n"
        "    experts=4, projections=(('gate', 128, 256),), mosaic_list=[dict(block_m=64, block_k=256)])\n"
        "print(json.dumps(rows))"
    )
    triton, mosaic = out
    assert "impl" not in triton and mosaic["impl"] == "mosaic" and mosaic["block_m"] == 64
    assert mosaic["assignments"] == 32
    assert abs(mosaic["TFLOPs"] - 2 * 32 * 128 * 256 / (mosaic["us"] * 1e-6) / 1e12) < 1e-9
    assert mosaic["max_err"] < 1e-2  # bf16 outputs of two kernels on the same inputs
    assert len(json.loads((tmp_path / "grouped_sweep_t.json").read_text())["rows"]) == 2


def test_grouped_sweep_times_each_plan_once(tmp_path, monkeypatch):
    """Requests that differ only in K splits a one-K-step shape cannot use (the TP8 shard's down projection, K = 256)
    run as one plan: timed once, the row holding the splits that ran and the default found among the rows."""
    from benchmarks.bench_matmul import GroupedTiles

    monkeypatch.setenv("OUT", str(tmp_path))
    tiles = [GroupedTiles(block_n=32, block_k=256, splits=s) for s in (None, 1, 4, 7)]
    rows = grouped_sweep(
        [2], float("nan"), jax.random.key(0), "t", tiles_list=tiles, experts=8, projections=(("down", 64, 256),)
    )
    assert len(rows) == 1
    assert rows[0]["splits"] == 1 and rows[0]["effective"]["splits"] == 1 and rows[0]["splits_rule"]


def test_shard_sweep_tiles_are_valid_int4_tilings():
    from benchmarks.bench_matmul import DEQUANT_SWEEP_TILES, GROUPED_SHAPES, SHARD_SWEEP_TILES

    for tiles_list in (SHARD_SWEEP_TILES, DEQUANT_SWEEP_TILES):
        assert len(set(tiles_list)) == len(tiles_list)
        for tiles in tiles_list:
            tiles.check("int4")
    assert {t.dequant for t in DEQUANT_SWEEP_TILES} == {"convert", "magic_bf16"}
    assert GROUPED_SHAPES["shard"] == (("gate", 256, 7168), ("down", 7168, 256))


def test_mosaic_decode_sweep_fits_the_shard_gate():
    """Every `--grouped-impl mosaic-decode` tiling is one the Mosaic kernel takes for a TP8 shard's gate / up
    (K = 7,168 in 256-wide steps split evenly; 8- or 16-row tiles), so a GPU sweep times each of them there."""
    from benchmarks.bench_matmul import MOSAIC_DECODE_SWEEP
    from ddtree_kernels.grouped_int4_mgpu import BLOCK_MS

    assert len({tuple(sorted(c.items())) for c in MOSAIC_DECODE_SWEEP}) == len(MOSAIC_DECODE_SWEEP)
    for config in MOSAIC_DECODE_SWEEP:
        assert config["block_m"] in BLOCK_MS and config["block_m"] <= 16
        assert 7168 % (config["block_k"] * config["k_splits"]) == 0, config


def test_stream_sweep_fits_the_shard_gate():
    """Every `--grouped-impl stream` configuration is one the streamed kernel takes for a TP8 shard's gate / up (K =
    7,168: 28 steps of 256, chunks dividing them; 8- or 16-row tiles; the ring depth within shared memory)."""
    from benchmarks.bench_matmul import STREAM_SWEEP
    from ddtree_kernels.grouped_int4_stream_mgpu import (
        SMEM_BUDGET,
        STREAM_BLOCK_MS,
        stream_fixed_bytes,
        stream_stage_bytes,
    )

    assert len({tuple(sorted(c.items())) for c in STREAM_SWEEP}) == len(STREAM_SWEEP)
    for config in STREAM_SWEEP:
        block_m = config["block_m"]
        assert block_m in STREAM_BLOCK_MS
        assert 28 % config.get("chunks", 1) == 0, config
        room = (SMEM_BUDGET - stream_fixed_bytes(block_m, False)) // stream_stage_bytes(block_m)
        assert config.get("stages", 1) <= room, config


def test_gather_ab_times_both_forms_on_the_same_rows(tmp_path, monkeypatch):
    """`--grouped-gather-ab`: one row per form (rows gathered first / read through a row index) a token count, both
    timed on the same fresh token sets (outputs checked equal inside), the JSON written."""
    from benchmarks.bench_matmul import gather_ab

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = gather_ab([3], float("nan"), jax.random.key(0), "t", (("gate", 64, 512), ("down", 512, 64)), experts=8)
    assert [(r["projection"], r["T"], r["gather"]) for r in rows] == [("gate", 3, "xla"), ("gate", 3, "kernel")]
    for r in rows:
        assert r["assignments"] == 24 and r["us"] > 0 and len(r["runs_us"]) == 2
    assert len(json.loads((tmp_path / "grouped_gather_ab_t.json").read_text())["rows"]) == 2
