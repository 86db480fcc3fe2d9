"""experiments/tp_shard_step.py on CPU: the tiny K2's TP2 shard built, initialised and stepped; each row carries
the modelled collectives and the predicted multi-GPU step (their sum with the shard step measured in the on-device
loop)."""

import json
import sys

import jax
import numpy as np
import pytest

from benchmarks.k26_model import SpreadDraftsDrafter
from experiments import tp_shard_step
from tests.experiments.refusal import assert_refused, refuse_to_run


def test_the_shard_steps_and_its_rows_add_up(tmp_path, monkeypatch):
    # the shard is checked on the one main builds and steps (building another here compiled its weights twice)
    built, real = [], tp_shard_step.shard_pair

    def shard_pair(*args, **kwargs):
        built.append((args, kwargs, real(*args, **kwargs)))
        return built[-1][2]

    monkeypatch.setattr(tp_shard_step, "shard_pair", shard_pair)
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["tp_shard_step", "--tiny", "--model-size", "2", "--layers", "2", "--drafter-layers", "1"]
    argv += ["--methods", "ar,ddtree", "--budgets", "4", "--contexts", "32", "--batches", "1", "--repeats", "1"]
    argv += ["--profile-top", "3", "--mla-schedule", "alternate"]
    argv += ["--grouped-gather", "kernel,xla_apart", "--grouped-int4-decode", "triton"]
    argv += ["--router-topk", "rank,auto"]
    monkeypatch.setattr(sys, "argv", argv)
    settings = (("MLA_SCHEDULE", "default"), ("GROUPED_GATHER", "auto"), ("GROUPED_INT4_DECODE", "auto"))
    for name, value in settings + (("ROUTER_TOPK", "auto"),):
        monkeypatch.setattr(tp_shard_step.dispatch, name, value)  # restored after: main() sets them
    tp_shard_step.main()
    assert tp_shard_step.dispatch.MLA_SCHEDULE == "alternate"
    [(args, kwargs, (full, _, pair))] = built
    assert args == (2, 1, 2) and kwargs == {
        "tiny": True,
        "dtype": jax.numpy.float32,
        "router_bias": "zero",
        "drafts": "spread",
    }
    assert isinstance(pair.drafter, SpreadDraftsDrafter)  # the default: a different token a depth
    assert pair.target_config.num_heads == full.num_heads // 2
    assert pair.target_params["embed"].shape[0] == full.vocab_size // 2  # its half of the vocabulary
    record = json.loads((tmp_path / "k26_tp2_shard_tiny.json").read_text())
    # the model apart from the file's name (k26_prediction combines tagged files of one model by these fields)
    assert (record["model_size"], record["tiny"], record["tag"], record["drafter_layers"]) == (2, True, None, 1)
    rows = record["rows"]
    # one row per (method, grouped gather form, router top-k), each recording its settings
    assert [(r["method"], r["budget"], r["grouped_gather"], r["router_topk"]) for r in rows] == [
        (method, budget, gather, topk)
        for method, budget in (("ar", None), ("ddtree", 4))
        for gather in ("kernel", "xla_apart")
        for topk in ("rank", "auto")
    ]
    for r in rows:
        assert r["step_ms"] > 0 and r["collectives_ms"] > 0 and r["mla_schedule"] == "alternate"
        assert r["router_bias"] == "zero" and r["drafts"] == "spread" and r["temperature"] == 0.0 and r["repeats"] == 1
        assert r["grouped_int4_decode"] == "triton"
        # a difference of two timings (17 steps less 1): on a loaded 2-core CPU the tiny shard's 16 steps can sit
        # within the noise (-0.004 ms a step once in CI), so only its presence and finiteness are checked here
        assert r["loop_steps"] == 16 and np.isfinite(r["loop_step_ms"])
        # the prediction rests on the step inside the on-device loop (no host dispatch)
        assert abs(r["predicted_tp_step_ms"] - r["loop_step_ms"] - r["collectives_ms"]) < 1e-9
        # --profile-top: the step's device time by kind of op, GEMMs among them, and its largest ops
        assert len(r["op_profile"]) == 3 and any(k["kind"] == "gemm" and k["us_per_run"] > 0 for k in r["op_kinds"])
        # and by stage: the target's forward found, every op counted once, the non-forward share in (0, 1)
        stages = r["stages"]
        assert stages["tree_forward"]["us"] > 0
        assert sum(s["us"] for s in stages.values()) == pytest.approx(r["device_us"])
        assert 0 < r["device_non_forward_share"] < 1 and r["device_non_forward_us"] > 0
    tree_row = next(r for r in rows if r["method"] == "ddtree")
    assert {"draft", "tree", "walk", "commit"} <= set(tree_row["stages"])  # the tree step's stages all ran


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "ar,bogus"], "--methods"),
        (["--methods", "ar,ar"], "--methods"),
        (["--budgets", "4,0"], "--budgets"),
        (["--contexts", "abc"], "--contexts"),
        (["--repeats", "0"], "--repeats 0"),
        (["--model-size", "8"], "--model-size 2 or 4"),  # the tiny K2's experts: half an INT4 group each 8 ways
        (["--model-size", "3"], "--model-size 3"),
        (["--attn-impls", "bogus"], "attn_impl"),
        (["--tag", "a/b"], "--tag 'a/b'"),
        (["--grouped-gather", "xla,sideways"], "--grouped-gather 'xla,sideways': ['sideways'] not of"),
        (["--grouped-gather", "xla,xla"], "['xla'] more than once"),
        (["--grouped-gather", "auto,xla"], "['xla'] more than once (auto is xla)"),
        (["--drafts", "oracle"], "--drafts"),
        (["--router-topk", "lax,heap"], "--router-topk 'lax,heap': ['heap'] not of"),
        (["--router-topk", "auto,lax"], "['lax'] more than once (auto is lax)"),
        (["--temperature", "nan"], "finite and >= 0"),
        (["--temperature", "-1"], "finite and >= 0"),
        (["--mla-reduce-rows", "-1"], "--mla-reduce-rows -1"),
    ],
)
def test_bad_arguments_are_refused_before_the_shard_is_built(argv, message, monkeypatch, capsys):
    refuse_to_run(monkeypatch, tp_shard_step, "shard_pair")
    argv = ["--tiny", "--model-size", "2", "--layers", "2", "--drafter-layers", "1", *argv]
    assert_refused(tp_shard_step.main, argv, message, capsys)
