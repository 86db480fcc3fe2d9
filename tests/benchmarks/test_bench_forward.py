"""benchmarks/bench_forward.py: the roofline's byte counts are the stated formulas, and one tiny row runs
(scan and unrolled, with the donated cache fed back) and records its compile and run times."""

import jax
import jax.numpy as jnp

from benchmarks.bench_engine import SHAPES
from benchmarks.bench_forward import bench_forward, kv_bytes, weight_bytes
from ddtree_jax.models import qwen3


def test_weight_and_kv_bytes():
    config = SHAPES["qwen3-8b"][0]
    params = jax.eval_shape(lambda: qwen3.init_params(config, jax.random.key(0), jnp.bfloat16))
    embed = config.vocab_size * config.hidden_size * 2
    total = sum(leaf.size * 2 for leaf in jax.tree.leaves(params))
    assert weight_bytes(params) == total - embed  # the embedding is a T-row gather, not read whole
    assert abs(weight_bytes(params) / 1e9 - 15.14) < 0.01  # the figure BENCHMARKS.md quotes
    # B * context * layers * (K, V) * kv_heads * head_dim * 2 bytes
    assert kv_bytes(config, 8, 2048) == 8 * 2048 * 36 * 2 * 8 * 128 * 2


def test_a_tiny_row_runs_both_loops():
    config = SHAPES["tiny"][0]
    params = qwen3.init_params(config, jax.random.key(1))
    for loop in ("scan", "unrolled"):
        row = bench_forward(config, params, 2, 5, context=16, matmul_impl="xla", layer_loop=loop, runs=2)
        assert row["layer_loop"] == loop and row["T"] == 5 and row["B"] == 2
        assert row["forward_ms"] > 0 and row["compile_s"] > 0
