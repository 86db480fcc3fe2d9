"""The decode-step roofline: distinct-expert counts, monotonicity, break-even tau on K2.6, the CLI."""

import pytest

from ddtree_jax import presets
from ddtree_jax.analysis import memory, roofline
from ddtree_jax.analysis.roofline import (
    Hardware,
    break_even_tau,
    expected_distinct_experts,
    expected_max_group_experts,
    format_table,
    roofline_table,
    step_cost,
)

K2, K2_DRAFTER = presets.preset_pair("kimi-k2.6")
QWEN, QWEN_DRAFTER = presets.preset_pair("qwen3-8b")


def test_distinct_experts_formula():
    assert expected_distinct_experts(1) == pytest.approx(8)
    assert round(expected_distinct_experts(17)) == 116  # models.md: ~116 at n = 17
    assert round(expected_distinct_experts(65)) == 286  # ~286 at n = 65
    values = [expected_distinct_experts(n) for n in range(0, 700, 7)]
    assert values[0] == 0 and all(a < b for a, b in zip(values, values[1:])) and values[-1] < 384
    # EP: the busiest of 8 ranks of 48 experts; one group is the plain expectation
    for n in (1, 9, 65, 520):
        assert expected_max_group_experts(n, 384, 8, 1) == pytest.approx(expected_distinct_experts(n))
        busiest = expected_max_group_experts(n, 384, 8, 8)
        assert expected_distinct_experts(n) / 8 <= busiest <= 48
    assert expected_max_group_experts(10_000, 384, 8, 8) == pytest.approx(48)
    assert 2.0 < expected_max_group_experts(1, 384, 8, 8) < 3.0  # 8 experts over 8 ranks: ~2.6 on the busiest


@pytest.mark.parametrize("layout", ["tp8", "ep8"])
def test_k2_6_more_tokens_more_bytes_and_break_even_grows_with_budget(layout):
    costs = roofline_table(K2, K2_DRAFTER, layout=layout, batch=1, context=4096, budgets=(8, 16, 32, 64))
    ar, chain, trees = costs[0], costs[1], costs[2:]
    assert (ar.method, ar.tokens_per_row, chain.tokens_per_row) == ("ar", 1, 8)
    assert [t.tokens_per_row for t in trees] == [9, 17, 33, 65]
    for a, b in zip(costs, costs[1:]):  # ar < chain (8 tokens) < ddtree 8 (9) < ... < ddtree 64 (65)
        assert a.total_bytes < b.total_bytes and a.flops < b.flops and a.step_s < b.step_s
    taus = [break_even_tau(t, ar) for t in trees]
    assert all(t > 1 for t in taus) and all(a < b for a, b in zip(taus, taus[1:])), taus
    assert taus[-1] > 4  # at batch 1, budget 64 needs > 4 accepted tokens per step just to match AR
    assert break_even_tau(ar, ar) == 1
    for c in costs:  # batch 1 decode on K2.6 is memory-bound
        assert c.memory_s > c.compute_s
        assert c.tokens_per_s(3.0) == pytest.approx(3.0 / c.step_s)


def test_k2_6_ar_reads_eight_experts_under_tp_and_more_under_ep():
    tp = step_cost(K2, method="ar", layout="tp8")
    assert tp.experts_per_layer == pytest.approx(8)
    per_device_routed = memory.weight_bytes(K2, "tp8")["routed_experts"]
    assert tp.verify.bytes["routed_experts"] == pytest.approx(per_device_routed * 8 / 384)
    ep = step_cost(K2, method="ar", layout="ep8")
    assert ep.verify.bytes["routed_experts"] > tp.verify.bytes["routed_experts"]  # whole experts, busiest rank
    # TP: 2 all-reduces per layer + embedding + logits; the EP all-to-all variant adds 2 per MoE layer
    assert tp.verify.num_collectives == 2 * 61 + 2
    assert step_cost(K2, method="ar", layout="ep8").verify.num_collectives == 2 * 61 + 2
    a2a = step_cost(K2, method="ar", layout="ep8", ep_collective="all_to_all")
    assert a2a.verify.num_collectives == 2 * 61 + 2 + 2 * 60 and a2a.collectives_s > ep.collectives_s
    # zero-latency, infinite links: no collective cost; a fixed overhead adds to every step
    free = Hardware(link_bytes_per_s=1e30, allreduce_latency_s=0.0, all_to_all_latency_s=0.0)
    assert step_cost(K2, method="ar", layout="tp8", hardware=free).collectives_s == pytest.approx(0, abs=1e-12)
    assert step_cost(K2, method="ar", overhead_s=1e-3).step_s == pytest.approx(tp.step_s + 1e-3)


def test_batch_multiplies_tokens_and_saturates_experts():
    one = step_cost(K2, drafter=K2_DRAFTER, method="ddtree", budget=64, batch=1)
    eight = step_cost(K2, drafter=K2_DRAFTER, method="ddtree", budget=64, batch=8)
    assert eight.experts_per_layer == pytest.approx(expected_distinct_experts(8 * 65)) and eight.experts_per_layer > 380
    assert eight.total_bytes > one.total_bytes and eight.flops > 7 * one.flops
    split = step_cost(K2, drafter=K2_DRAFTER, method="ddtree", budget=64, batch=8, layout="tp4-dp2")
    assert split.verify.tokens == 4 * 65  # 4 rows per data shard


def test_qwen3_8b_on_one_h200():
    costs = roofline_table(QWEN, QWEN_DRAFTER, layout="single", budgets=(16, 64, 256))
    assert [c.tokens_per_row for c in costs] == [1, 16, 17, 65, 257]
    assert all(c.collectives_s == 0 for c in costs)
    assert all(a.total_bytes < b.total_bytes for a, b in zip(costs, costs[1:]))
    assert costs[0].verify.total_bytes > 15e9  # 8.2B bf16 parameters (head read, embedding rows only) + KV
    assert costs[-1].verify.compute_s > costs[-1].verify.memory_s  # 257 tokens: compute-bound on one H200
    taus = [break_even_tau(c, costs[0]) for c in costs[2:]]
    assert 1 < taus[0] <= taus[1] < taus[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="beam"), "method must be one of .* got 'beam'"),
        (dict(method="ddtree", budget=0), "budget >= 1, got 0"),
        (dict(method="ddtree", budget=None), "got None"),
        (dict(method="chain", drafter=None), "needs a drafter"),
        (dict(batch=0), "batch must be an integer >= 1, got 0"),
        (dict(context=-1), "got -1"),
        (dict(layout="ep5"), "384 routed experts do not divide over 5 devices"),
        (dict(ep_collective="ring"), "got 'ring'"),
        (dict(cache_dtype="int2"), "got 'int2'"),
    ],
)
def test_bad_inputs_raise_naming_the_value(kwargs, message):
    args = dict(drafter=K2_DRAFTER, method="ar")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        step_cost(K2, **args)
    with pytest.raises(ValueError, match="n must be >= 0, got -3"):
        expected_distinct_experts(-3)
    with pytest.raises(ValueError, match="peak_flops must be > 0, got 0"):
        Hardware(peak_flops=0)


def test_table_cli_and_plot(capsys, tmp_path):
    costs = roofline_table(K2, K2_DRAFTER, budgets=(8, 64))
    table = format_table(costs, taus=(4.0,))
    assert table.count("\n") == 1 + len(costs) and "| ddtree 64 | 65 |" in table
    with pytest.raises(ValueError, match="first row must be AR"):
        format_table(costs[1:])
    assert roofline.main(["--model", "k2.6", "--ep", "8", "--batch", "8", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "ep8" in out and "| ddtree 64 |" in out and "| chain |" in out
    assert roofline.main(["--model", "qwen3-8b", "--budgets", "16,256", "--tau", "5"]) == 0
    assert "| ddtree 256 | 257 |" in capsys.readouterr().out
    assert roofline.main(["--model", "k2.6", "--tp", "3"]) == 2
    assert "error:" in capsys.readouterr().err
    path = tmp_path / "roofline.png"
    roofline.plot_tokens_per_second(costs, str(path))
    assert path.stat().st_size > 1000


def test_a_mesh_of_size_zero_is_refused_and_a_model_without_moe_layers_is_costed(capsys):
    """--tp 0 / --ep 0 printed the default TP8 table (0 read as "not given"); a DeepSeek-V3 config of dense layers
    only divided by its zero MoE layers."""
    import dataclasses

    from ddtree_jax.analysis.roofline import main, step_cost
    from ddtree_jax.presets import preset

    for flag in ("--tp", "--ep"):
        assert main(["--model", "k2.6", flag, "0"]) == 2
        assert "mesh sizes must be >= 1, got model=0" in capsys.readouterr().err
    dense_only = dataclasses.replace(preset("kimi-k2-mesh-tiny"), first_k_dense_replace=2)
    cost = step_cost(dense_only, method="ar", layout="single")
    assert cost.verify.bytes["routed_experts"] == 0 and cost.verify.bytes["weights"] > 0
