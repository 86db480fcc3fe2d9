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
    # the LM head runs on one row per chunk (the engine's head_rows), not on every prompt token
    assert flops["matmul"] == 2 * 10 * c.num_layers * per_layer + 2 * c.vocab_size * c.hidden_size
    head = prefill_flops(config, 10, head_rows=3)["matmul"] - flops["matmul"]
    assert head == 2 * 2 * c.vocab_size * c.hidden_size
    assert flops["attention"] == c.num_layers * 2 * 2 * q * 10 * 10 / 2
    assert prefill_flops(config, 20)["attention"] == 4 * flops["attention"]  # quadratic in T


def test_prefill_flops_of_an_mla_moe_target():
    """K2.6: the activated experts only (8 routed + 1 shared), each key expanded once, the expanded form's
    attention (Dk = nope + rope = 192, Dv = 128)."""
    from benchmarks.k26_model import k26_config

    c = k26_config(4)
    flops = prefill_flops(c, 1000)
    assert flops["attention"] == 4 * 2 * 64 * (192 + 128) * 1000 * 1000 / 2
    per_token = (flops["matmul"] - 2 * c.vocab_size * c.hidden_size) / 2 / 1000
    # by hand, per layer: MLA projections 101.1M (q_a 11.0M, q_b 18.9M, kv_a 4.1M, o 58.7M, key expansion 8.4M);
    # dense MLP 396.4M; MoE: router 2.8M + 9 experts x 3 x 7168 x 2048 = 399.1M. 4 layers (1 dense): 1,998M
    assert 1.99e9 < per_token < 2.01e9


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


def test_bench_prefill_runs_an_mla_moe_target(tmp_path):
    """--shape k2-tiny: the DeepSeek-V3 / K2 path (random INT4 experts, MLA) chunked and whole, profiled."""
    assert (
        main(
            "--shape k2-tiny --layers 2 --contexts 24 --chunks 0,8 --repeats 1 --profile-top 3 --commit t --out".split()
            + [str(tmp_path)]
        )
        == 0
    )
    rows = json.loads((tmp_path / "prefill_k2-tiny_t.json").read_text())["rows"]
    assert len(rows) == 2 and all("error" not in r and r["tflops"] > 0 for r in rows), rows
    for row in rows:  # --profile-top: the device time by kind of op, GEMMs among them
        kinds = {k["kind"]: k["us_per_run"] for k in row["profile"]["kinds"]}
        assert kinds.get("gemm", 0) > 0 and row["profile"]["device_s"] > 0 and len(row["profile"]["ops"]) > 3
