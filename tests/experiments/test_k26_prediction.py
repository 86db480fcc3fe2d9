"""experiments/k26_prediction.py: the prediction arithmetic on small hand-made inputs (step + collectives,
tau from the chain's and the measured DDTree / chain ratio, capped), and the script end to end on the
archived JSONs."""

import json

import pytest

from experiments.k26_prediction import acceptance_ratios, main, predict


def _e2e(chain_steps, ddtree_steps):
    def row(method, budget, steps):
        return {"method": method, "budget": budget, "per_prompt": [{"steps": steps, "num_tokens": 101}]}

    return {
        "settings": {"temperature": 0.0},
        "results": [row("chain", None, chain_steps), row("ddtree", 64, ddtree_steps)],
    }


def test_ratio_tau_step_and_break_even():
    ratios = acceptance_ratios(_e2e(chain_steps=50, ddtree_steps=25))  # 2 and 4 tokens a step
    assert ratios == {64: pytest.approx(2.0)}
    shard = [
        {"B": 1, "context": 4096, "method": "ar", "budget": None, "step_ms": 9.0, "collectives_ms": 1.0},
        {"B": 1, "context": 4096, "method": "ddtree", "budget": 64, "step_ms": 28.0, "collectives_ms": 2.0},
        {"B": 1, "context": 4096, "method": "ddtree", "budget": 64, "step_ms": 38.0, "collectives_ms": 2.0},  # slower
    ]
    rows = {(r["method"], r["chain_tau"]): r for r in predict(shard, ratios, [3.0, 5.0], max_tau=8.0)}
    tree = rows["ddtree", 3.0]
    assert tree["predicted_step_ms"] == 30.0 and tree["tau"] == 6.0  # the fastest row; 3 x 2
    assert tree["tokens_per_s"] == pytest.approx(200.0) and tree["x_ar"] == pytest.approx(2.0)
    assert tree["break_even_tau"] == pytest.approx(3.0)
    assert rows["ddtree", 5.0]["tau"] == 8.0  # 10 capped at the block's 8
    assert rows["ar", 3.0]["tokens_per_s"] == pytest.approx(100.0)


def test_the_loop_step_is_used_where_measured():
    """Rows with the on-device loop's step (`loop_step_ms`) are predicted from it, not from the host-called step."""
    shard = [
        {"B": 1, "context": 4096, "method": "ar", "budget": None, "step_ms": 11.0, "loop_step_ms": 9.0},
        {"B": 1, "context": 4096, "method": "chain", "budget": None, "step_ms": 23.0, "loop_step_ms": 19.0},
    ]
    for row in shard:
        row["collectives_ms"] = 1.0
    rows = {r["method"]: r for r in predict(shard, {}, [4.0])}
    assert rows["ar"]["predicted_step_ms"] == 10.0 and rows["ar"]["shard_step_timing"] == "loop"
    assert rows["chain"]["predicted_step_ms"] == 20.0 and rows["chain"]["break_even_tau"] == pytest.approx(2.0)
    assert rows["chain"]["ar_timing"] == "loop"


def test_host_and_loop_timings_are_never_mixed():
    """Older JSONs hold only the host-called step (`loop_step_ms` absent or None): alone they are predicted from it;
    beside loop-timed rows they are left out (a host-called step would lose to any loop row and mix commits)."""
    host = [
        {"B": 1, "context": 4096, "method": "ar", "budget": None, "step_ms": 11.0, "loop_step_ms": None},
        {"B": 1, "context": 4096, "method": "chain", "budget": None, "step_ms": 23.0},
    ]
    loop = [{"B": 1, "context": 4096, "method": "ar", "budget": None, "step_ms": 12.0, "loop_step_ms": 10.0}]
    for row in host + loop:
        row["collectives_ms"] = 1.0
    alone = {r["method"]: r for r in predict(host, {}, [4.0])}
    assert alone["ar"]["predicted_step_ms"] == 12.0 and alone["chain"]["predicted_step_ms"] == 24.0
    assert alone["chain"]["shard_step_timing"] == alone["chain"]["ar_timing"] == "host"
    mixed = predict(host + loop, {}, [4.0])
    assert [(r["method"], r["predicted_step_ms"]) for r in mixed] == [("ar", 11.0)]  # the host chain row left out


def test_the_script_on_the_archived_runs(tmp_path):
    archive = "benchmarks/results_archive/"
    assert (
        main(
            [
                "--shard",
                archive + "k26_tp8_shard_003b11c.json",
                "--e2e",
                archive + "e2e_embedded_T0_25753af.json," + archive + "e2e_embedded_T1_25753af.json",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "k26_prediction.json").read_text())
    assert data["kind"] == "prediction"
    assert {r["temperature"] for r in data["rows"]} == {0.0, 1.0}
    assert all(r["break_even_tau"] >= 1.0 for r in data["rows"] if r["method"] != "ar")
    with pytest.raises(SystemExit):
        main(["--shard", "x", "--e2e", "y", "--chain-taus", "0.5"])


def test_each_column_keeps_its_colour_in_every_panel():
    from experiments.k26_prediction import column_colours

    def row(context, method, budget, b=1):
        return {"B": b, "context": context, "method": method, "budget": budget}

    rows = [row(4096, "chain", None), row(4096, "ddtree", 32), row(4096, "ddtree", 64), row(32768, "ddtree", 64)]
    rows.append(row(4096, "ddtree", 128, b=8))  # not plotted: no colour
    colours = column_colours(rows)
    assert set(colours) == {("chain", 0), ("ddtree", 32), ("ddtree", 64)}
    assert len(set(colours.values())) == 3
