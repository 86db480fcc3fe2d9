"""benchmarks/bench_prefill.py on the tiny shape (CPU): rows for every (context, chunk), FLOPs counted by
the formula in its docstring, the JSON written."""

import json

from benchmarks.bench_engine import SHAPES
from benchmarks.bench_prefill import main, prefill_flops


def test_prefill_flops_count_matmuls_and_causal_attention():
    config = SHAPES["tiny"][0]
    c = config
    flops = prefill_flops(config, 10)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    assert flops["matmul"] == 2 * 10 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)
    assert flops["attention"] == c.num_layers * 2 * 2 * q * 10 * 10 / 2
    assert prefill_flops(config, 20)["attention"] == 4 * flops["attention"]  # quadratic in T


def test_bench_prefill_writes_a_row_per_context_and_chunk(tmp_path, capsys):
    assert (
        main(
            [
                "--shape",
                "tiny",
                "--layers",
                "1",
                "--contexts",
                "16,40",
                "--chunks",
                "0,8",
                "--repeats",
                "1",
                "--out",
                str(tmp_path),
                "--commit",
                "test",
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "prefill_tiny_test.json").read_text())
    rows = data["rows"]
    assert [(r["context"], r["chunk"]) for r in rows] == [(16, 0), (16, 8), (40, 0), (40, 8)]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["tflops"] > 0 and row["temp_bytes"] >= 0
    assert data["layers"] == 1
    assert "| context | chunk |" in capsys.readouterr().out
