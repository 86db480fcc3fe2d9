"""experiments/routing_spread.py on the tiny K2 (CPU): one row per (router bias, MoE layer), counts within their
bounds, the uniform expectation right."""

import json

import pytest

from experiments import routing_spread
from experiments.routing_spread import main, uniform_distinct
from tests.experiments.refusal import assert_refused, refuse_to_run


def test_uniform_expectation():
    assert uniform_distinct(384, 1) == pytest.approx(1.0)
    assert uniform_distinct(384, 136) == pytest.approx(384 * (1 - (383 / 384) ** 136))
    assert 114 < uniform_distinct(384, 136) < 115  # 17 rows x top-8 over K2.6's 384 experts


def test_the_script_on_the_tiny_shard(tmp_path):
    assert (
        main(["--tiny", "--model-size", "2", "--layers", "3", "--rows", "5", "--tokens", "12", "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "routing_spread.json").read_text())
    assert [(r["router_bias"], r["moe_layer"]) for r in data["results"]] == [
        ("zero", 0),
        ("zero", 1),
        ("random", 0),
        ("random", 1),
    ]
    for r in data["results"]:
        assert 1 <= r["distinct_experts"] <= r["assignments"] and r["assignments"] % 5 == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "0"], "--rows 0"),
        (["--rows", "100", "--tokens", "48"], "--rows 100"),  # was: the whole sequence, recorded as rows 100
        (["--tokens", "0"], "--tokens 0"),
        (["--layers", "1"], "--layers 1"),
        (["--model-size", "8"], "--model-size 2 or 4"),  # the tiny K2's experts: half an INT4 group each 8 ways
    ],
)
def test_bad_arguments_are_refused_before_any_model_is_built(argv, message, monkeypatch, capsys):
    refuse_to_run(monkeypatch, routing_spread, "random_int4_target")
    assert_refused(main, ["--tiny", *argv], message, capsys)
