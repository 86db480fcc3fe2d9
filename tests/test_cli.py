"""The `ddtree-jax` command line: the tree tool, generate and bench (random tiny pair), clear errors, --chat."""

import dataclasses
import json
import os
import re
import subprocess
import types

import jax
import numpy as np
import pytest

from ddtree_jax import __main__ as cli
from ddtree_jax.__main__ import main
from ddtree_jax.checkpoint import to_hf_dict
from ddtree_jax.config import DFlashConfig
from ddtree_jax.engine.run import chat_stop_tokens, check_pair, check_request, random_tiny_pair
from ddtree_jax.tree import build_tree
from ddtree_jax.tree.render import surrogate_tau
from ddtree_jax.tree.synthetic import synthetic_draft_logits

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_tiny")  # hidden 32, vocab 97, 128 positions


def test_tree_tool_prints_the_tree_and_plots(tmp_path, capsys):
    plot = tmp_path / "plots" / "tree.png"  # --plot's directory is created, as the training stages create theirs
    assert main(["tree", "--budget", "12", "--depth", "4", "--vocab", "300", "--seed", "3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    tree = build_tree(synthetic_draft_logits(jax.random.key(3), 1, 4, 300), 12)
    expected = f"{surrogate_tau(tree)[0]:.4f}"
    assert f"surrogate expected acceptance tau = 1 + sum_u q(u) = {expected}" in out
    assert len(re.findall(r"  r\d+  q=", out)) == 12  # one line per node
    assert "nodes per depth: d1:" in out
    assert plot.exists() and plot.stat().st_size > 1000


def test_tree_tool_reads_logits_and_reports_bad_input(tmp_path, capsys):
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    np.save(tmp_path / "l.npy", logits)
    assert main(["tree", "--logits", str(tmp_path / "l.npy"), "--budget", "5"]) == 0
    assert "vocab V = 50" in capsys.readouterr().out
    assert main(["tree", "--logits", str(tmp_path / "l.npy"), "--budget", "0"]) == 2
    assert "error: budget must be an integer >= 1, got 0" in capsys.readouterr().err
    np.save(tmp_path / "flat.npy", logits[0])  # 1-D: no depth axis
    assert main(["tree", "--logits", str(tmp_path / "flat.npy"), "--budget", "5"]) == 2
    assert "flat.npy holds an array of shape (50,): need [L, V] or [B, L, V]" in capsys.readouterr().err
    np.save(tmp_path / "ints.npy", np.zeros((3, 50), np.int64))  # named as int64, not as the int32 of jnp
    assert main(["tree", "--logits", str(tmp_path / "ints.npy"), "--budget", "5"]) == 2
    assert "ints.npy holds int64 values: draft logits must be float" in capsys.readouterr().err
    assert main(["tree", "--sharpness", "nan", "--budget", "5"]) == 2
    assert "error: sharpness must be a finite number > 0, got nan" in capsys.readouterr().err


def test_generate_random_tiny_methods_agree_greedily(capsys):
    assert (
        main(
            [
                "generate",
                "--random-tiny",
                "--method",
                "all",
                "--max-new",
                "6",
                "--budget",
                "4",
                "--repeats",
                "1",
                "--compilation-cache",
                "",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    texts = re.findall(r"^\[[\d, ]+\]$", out, flags=re.M)
    assert len(texts) == 3 and len(set(texts)) == 1  # AR, chain and DDTree emit the same greedy text
    assert "speedup over AR (ddtree)" in out and "compile" in out


def test_generate_reports_an_invalid_row_and_runs_every_method(monkeypatch, capsys):
    """Non-finite weights (loaded with --no-check-finite) make every row invalid (INVALID_TOKEN): generate says so
    and runs the other methods; it used to end at AR with "token id -1 is not in the tokenizer"."""
    import dataclasses

    from ddtree_jax.engine import run as run_module

    tiny = run_module.random_tiny_pair

    def nan_pair(seed=0):
        pair = tiny(seed)
        params = dict(pair.target_params, final_norm=pair.target_params["final_norm"].at[0].set(float("nan")))
        return dataclasses.replace(pair, target_params=params)

    monkeypatch.setattr(run_module, "random_tiny_pair", nan_pair)
    argv = ["generate", "--random-tiny", "--method", "all", "--max-new", "6", "--budget", "4", "--repeats", "1"]
    assert main([*argv, "--compilation-cache", ""]) == 0
    out = capsys.readouterr().out
    assert out.count("the run marked this row invalid") == 3 and "[ddtree budget 4]" in out


# ------------------------------------------------------------------------------------------------ bench
# The same static shapes as the generate test above (batch 1, prompt width 4, max-new 6, budget 4), so in one
# pytest process the AR / chain / DDTree-4 programs compile once for all of these tests.

TINY = ["--random-tiny", "--max-new", "6", "--repeats", "1", "--compilation-cache", ""]


def test_bench_table_and_json(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                *TINY,
                "--budget",
                "4,2",
                "--prompt-ids",
                "1,2,3,4",
                "--prompt-ids",
                "5,6,7",
                "--json",
                str(out_file),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"^method\s+budget\s+block\s+tokens/s\s+mean tau\s+speedup\s+compile s$", out, flags=re.M)
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["ar"], ["chain"], ["ddtree"])]
    assert [row[0] for row in table] == ["ar", "chain", "ddtree", "ddtree"]
    assert table[0][-2] == "1.00x" and table[1][1] == "8" and table[2][1:3] == ["4", "8"] and table[3][1] == "2"
    data = json.loads(out_file.read_text())
    assert set(data) == {"device", "settings", "prompts", "results", "profile"}
    assert data["prompts"] == [[1, 2, 3, 4], [5, 6, 7]] and data["settings"]["budgets"] == [4, 2]
    assert data["profile"] is None
    rows = data["results"]
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("chain", None), ("ddtree", 4), ("ddtree", 2)]
    for row in rows:
        assert {"tokens_per_s", "mean_tau", "speedup", "compile_s", "run_s", "num_tokens", "per_prompt"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["mean_tau"] >= 1.0 and row["num_tokens"] == 12
        assert len(row["per_prompt"]) == 2 and row["same_text_as_ar"]  # greedy: every method emits AR's text
    assert rows[0]["speedup"] == 1.0
    assert rows[2]["speedup"] == rows[2]["tokens_per_s"] / rows[0]["tokens_per_s"]


def test_bench_profile_prints_the_stage_table(capsys):
    assert main(["bench", *TINY, "--methods", "chain", "--prompt-ids", "1,2,3,4", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "per-stage times of one decode step" in out
    header = next(line for line in out.splitlines() if line.startswith("method") and "target fwd" in line)
    assert header.split() == ["method", "draft", "tree", "target", "fwd", "walk", "commit", "sum", "step", "non-fwd"]
    row = next(line for line in out.splitlines() if line.startswith("chain ") and line.endswith("%"))
    assert all(float(v) > 0 for v in row.split()[1:-1])


def test_dtype_loads_the_weights_and_sizes_the_caches(capsys):
    """--dtype bfloat16: the weights load in bf16 and the run's KV caches follow them (`pair_dtype`);
    --dtype auto (the default): float32 off GPU, the checkpoint's stored dtype on GPU (one dtype for the
    pair: the drafter follows the target)."""
    from ddtree_jax.engine.run import DTYPES, load_dtype, load_pair, pair_dtype

    assert pair_dtype(load_pair(FIXTURE, None, DTYPES["bfloat16"])) == jax.numpy.bfloat16
    assert pair_dtype(load_pair(FIXTURE, None)) == jax.numpy.float32
    assert load_dtype("auto") == (jax.numpy.float32 if jax.default_backend() != "gpu" else "auto")
    assert load_dtype("bfloat16") == jax.numpy.bfloat16
    from ddtree_jax import dispatch

    assert cli.DTYPE_CHOICES == dispatch.WEIGHT_DTYPES  # the parser's copy (built before JAX is imported)
    embedded = load_pair(cli.EMBEDDED_TARGET, cli.EMBEDDED_DRAFTER, "auto")  # stored in bf16
    assert pair_dtype(embedded) == jax.numpy.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(embedded.drafter.params)} == {jax.numpy.dtype("bfloat16")}
    argv = ["generate", "--target", FIXTURE, "--method", "ar", "--prompt-ids", "1,2,3", "--max-new", "4"]
    assert main([*argv, "--dtype", "bfloat16", "--compilation-cache", ""]) == 0
    assert "ar" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dtype", "float16", "--compilation-cache", ""])
    assert exit_info.value.code == 2 and "argument --dtype: invalid choice: 'float16'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ errors


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_bad_paths_are_named(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert f"target directory {missing!r} does not exist" in _error(["bench", "--target", missing], capsys)
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in _error(["generate", "--target", str(tmp_path / "file")], capsys)
    assert f"drafter directory {missing!r} does not exist" in _error(
        ["generate", "--target", FIXTURE, "--drafter", missing], capsys
    )
    assert "has no config.json" in _error(["generate", "--target", str(tmp_path)], capsys)
    assert "--drafter needs --target" in _error(["bench", "--drafter", FIXTURE], capsys)
    assert "--prompt-file" in _error(["bench", *TINY, "--prompt-file", missing], capsys)


def _drafter_dir(tmp_path, name, vocab, **kw):
    config = dict(
        hidden_size=32,
        intermediate_size=40,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        mask_token_id=5,
        target_layers=(0, 1),
    )
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(to_hf_dict(DFlashConfig(**{**config, **kw}), vocab)))
    return str(directory)


def test_target_drafter_mismatch_is_named(tmp_path, capsys):
    """The configs are checked before any weight loads (the drafter directories hold a config only)."""
    base = ["generate", "--target", FIXTURE, "--drafter"]  # the fixture: hidden 32, vocab 97, 2 layers
    assert "drafter hidden_size 48 != target hidden_size 32" in _error(
        base + [_drafter_dir(tmp_path, "wide", 97, hidden_size=48)], capsys
    )
    assert "drafter vocab_size 100 != target vocab_size 97" in _error(
        base + [_drafter_dir(tmp_path, "vocab", 100)], capsys
    )
    assert "drafter mask_token_id 97 is outside" in _error(
        base + [_drafter_dir(tmp_path, "mask", 97, mask_token_id=97)], capsys
    )
    assert "drafter target_layers [5]" in _error(
        base + [_drafter_dir(tmp_path, "layers", 97, target_layers=(0, 5))], capsys
    )
    # a built pair whose drafter holds another target's embedding
    pair = random_tiny_pair()
    bad = dataclasses.replace(pair, drafter=dataclasses.replace(pair.drafter, embed=pair.drafter.embed[:, :32]))
    with pytest.raises(
        ValueError,
        match=re.escape("drafter embed has shape (512, 32), expected [target vocab_size, hidden_size] = (512, 64)"),
    ):
        check_pair(bad)


def test_bad_budget_block_size_and_prompts_are_named(tmp_path, capsys):
    assert "budget must be in [1, 1024], got 0" in _error(["generate", *TINY, "--budget", "0"], capsys)
    assert "budget must be in [1, 1024], got 1025" in _error(["bench", *TINY, "--budget", "16,1025"], capsys)
    assert "--budget must be comma-separated integers, got '16,x'" in _error(
        ["bench", *TINY, "--budget", "16,x"], capsys
    )
    assert "block_size must be in [2, 8] (the drafter's block_size), got 9" in _error(
        ["generate", *TINY, "--method", "chain", "--block-size", "9"], capsys
    )
    assert "got 1" in _error(["bench", *TINY, "--block-size", "1"], capsys)
    assert "prompt 0 is empty" in _error(["generate", *TINY, "--method", "ar", "--prompt-ids", ""], capsys)
    assert "prompt 1 is empty" in _error(["bench", *TINY, "--prompt-ids", "1,2", "--prompt-ids", " "], capsys)
    assert "prompt 0 has token id 512 outside the target vocabulary [0, 512)" in _error(
        ["generate", *TINY, "--method", "ar", "--prompt-ids", "1,512"], capsys
    )
    (tmp_path / "empty.txt").write_text("\n\n")
    assert "has no prompts" in _error(["bench", *TINY, "--prompt-file", str(tmp_path / "empty.txt")], capsys)
    assert "--methods must be" in _error(["bench", *TINY, "--methods", "ar,tree"], capsys)
    # the fixture target's max_position_embeddings is 128
    ids = ",".join(["1"] * 100)
    assert "prompt 0 (100 tokens) + max_new_tokens 40 = 140 exceeds the target's max_position_embeddings 128" in _error(
        [
            "generate",
            "--target",
            FIXTURE,
            "--method",
            "ar",
            "--prompt-ids",
            ids,
            "--max-new",
            "40",
            "--compilation-cache",
            "",
        ],
        capsys,
    )


def test_check_request_from_python():
    pair = random_tiny_pair()
    ok = dict(method="ddtree", budget=8, block_size=4, max_new_tokens=4)
    check_request(pair, [[1, 2, 3]], **ok)
    for change, message in [
        (dict(budget=0), "budget must be in"),
        (dict(block_size=9), "got 9"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
        (dict(method="beam"), "method must be one of"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_request(pair, [[1, 2, 3]], **{**ok, **change})
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        check_request(pair, [[1], []], **ok)
    with pytest.raises(ValueError, match="needs a drafter"):
        check_request(dataclasses.replace(pair, drafter=None), [[1]], **ok)
    long = dataclasses.replace(pair, target_config=dataclasses.replace(pair.target_config, max_position_embeddings=8))
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings 8"):
        check_request(long, [[1, 2, 3]], **{**ok, "max_new_tokens": 6})


# ------------------------------------------------------------------------------------------------ chat


def _chatml_dir(tmp_path):
    """A word-level tokenizer.json with ChatML specials; eos <|endoftext|>, end of turn <|im_end|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "hi", "4"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    directory = tmp_path / "chatml"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )
    return directory


def test_generate_chat_stops_at_eos_and_end_of_turn(tmp_path, monkeypatch, capsys):
    from ddtree_jax.checkpoint import load_tokenizer
    from ddtree_jax.engine import run as run_module

    directory = _chatml_dir(tmp_path)
    tok = load_tokenizer(str(directory))
    assert chat_stop_tokens(tok) == [3, 2]  # eos, then <|im_end|>
    # generation_config.json's eos ids stop too (as HF generate), a list kept whole (was cut to its first id)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 3]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    with_generation_config = load_tokenizer(str(directory))
    assert with_generation_config.eos_token_ids == (3, 7, 6)
    assert chat_stop_tokens(with_generation_config) == [3, 7, 6, 2]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, "x"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id holds"):
        load_tokenizer(str(directory))
    for name in ("generation_config.json", "config.json"):
        (directory / name).unlink()
    seen = {}

    def fake_run(pair, prompts, **kwargs):
        seen.update(kwargs, prompt=prompts[0])
        return {"tau": 1.5, "tokens_per_s": 10.0, "compile_s": 0.0, "run_s": 0.2, "tokens": [[7, 2]]}

    monkeypatch.setattr(run_module, "load_pair", lambda target, drafter, **kw: types.SimpleNamespace(tokenizer=tok))
    monkeypatch.setattr(run_module, "run", fake_run)
    monkeypatch.setattr(run_module, "check_request", lambda *args, **kwargs: None)  # run is faked too
    common = ["generate", "--target", str(directory), "--method", "ar", "--compilation-cache", "", "--prompt", "hi"]
    assert main(common + ["--chat"]) == 0
    out = capsys.readouterr().out
    assert seen["stop_tokens"] == [3, 2] and seen["prompt"] == [1, 4, 6, 2, 1, 5]
    assert "tau = 1.50 tokens/step, 10.0 tokens/s" in out and out.splitlines()[-1] == "4"
    assert main(common) == 0 and seen["stop_tokens"] == []  # no chat: no stop tokens


def test_dispatch_prints_every_choice(capsys):
    assert main(["dispatch", "--backend", "gpu", "--budget", "32", "--config", "configs/kimi_k2_6.json"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeekV3Config" in out and "budget 32" in out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "pallas" in lines["tree-forward"] or any("MoE" in line and "pallas" in line for line in out.splitlines())
    assert any(line.strip().startswith("rejection walk") and "pallas" in line for line in out.splitlines())
    assert main(["dispatch", "--attn-impl", "flash"]) == 2
    assert "DecodeOptions.attn_impl must be one of" in capsys.readouterr().err


def test_dispatch_reads_the_stored_dtype_of_a_wrapped_config(tmp_path, capsys):
    """K2.6's dtype sits in its kimi_k25 wrapper's text_config (real configs: there and at the top level): the plan
    was for float32 weights, so XLA attention, where a bf16 checkpoint runs the Mosaic kernel."""
    raw = json.loads(open("configs/kimi_k2_6.json").read())
    assert raw["torch_dtype"] == raw["text_config"]["torch_dtype"] == "bfloat16"
    del raw["torch_dtype"]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps(raw))
    assert main(["dispatch", "--backend", "gpu", "--budget", "32", "--config", str(wrapped)]) == 0
    out = capsys.readouterr().out
    assert "weights bfloat16" in out
    assert any(line.strip().startswith("tree-forward attention") and "pallas" in line for line in out.splitlines())
    del raw["text_config"]["torch_dtype"]
    wrapped.write_text(json.dumps(raw))
    assert main(["dispatch", "--backend", "gpu", "--budget", "32", "--config", str(wrapped)]) == 0
    assert "states no torch_dtype: planned for float32 weights" in capsys.readouterr().out


def test_dispatch_refuses_a_drafter_config_a_negative_context_and_names_a_bad_file(tmp_path, capsys):
    assert "--config checkpoints/embedded/drafter is a drafter (DFlash) config, not a target's" in _error(
        ["dispatch", "--config", "checkpoints/embedded/drafter"], capsys
    )
    assert "--context must be >= 0 (tokens committed before the step), got -500" in _error(
        ["dispatch", "--context", "-500", "--backend", "gpu"], capsys
    )
    not_json = tmp_path / "notes.md"
    not_json.write_text("# not a config\n")
    assert f"{not_json} is not valid JSON: Expecting value" in _error(["dispatch", "--config", str(not_json)], capsys)


# ------------------------------------------------------------------------------------------------ defaults, exit codes


def _error_before_output(argv, capsys) -> str:
    """An `error: ...` line (exit 2) with nothing printed to stdout before it."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    err = captured.err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_generate_and_bench_default_to_the_embedded_pair(monkeypatch, capsys):
    from ddtree_jax.engine import run as run_module

    assert cli.EMBEDDED_TARGET.endswith(os.path.join("checkpoints", "embedded", "target"))
    assert os.path.isdir(cli.EMBEDDED_TARGET) and os.path.isdir(cli.EMBEDDED_DRAFTER)
    seen = []
    tiny = random_tiny_pair()

    def fake_load_pair(target, drafter, **kwargs):
        seen.append((target, drafter, kwargs))
        return tiny

    monkeypatch.setattr(run_module, "load_pair", fake_load_pair)
    common = ["--method", "ar", "--max-new-tokens", "6", "--repeats", "1", "--compilation-cache", ""]
    assert main(["generate", *common, "--prompt-ids", "1,2,3,4"]) == 0  # --max-new-tokens: --max-new's HF name
    assert "max_new_tokens = 6" in capsys.readouterr().out
    assert main(["bench", "--methods", "ar", *common[2:], "--prompt-ids", "1,2,3,4", "--no-progress"]) == 0
    assert "max_new_tokens = 6" in capsys.readouterr().out
    float32 = jax.numpy.float32  # --dtype's default
    defaults = {"dtype": float32, "check_finite": True, "child_head_dir": None}  # no --child-head: DDTree's own trees
    assert seen == [(cli.EMBEDDED_TARGET, cli.EMBEDDED_DRAFTER, defaults)] * 2
    assert main(["generate", "--target", FIXTURE, "--no-check-finite", *common, "--prompt-ids", "1,2,3,4"]) == 0
    assert seen[-1] == (FIXTURE, None, {**defaults, "check_finite": False})


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    with open(os.path.join(FIXTURE, "config.json")) as f:
        (damaged / "config.json").write_text(f.read())
    (damaged / "model.safetensors").mkdir()  # a directory where the weights file should be
    assert "model.safetensors" in _error(["generate", "--target", str(damaged), "--method", "ar"], capsys)
    assert "--prompt needs a tokenizer" in _error(
        ["generate", "--target", FIXTURE, "--method", "ar", "--prompt", "hi", "--compilation-cache", ""], capsys
    )
    assert "--chat wraps --prompt text" in _error(["generate", *TINY, "--chat", "--prompt-ids", "1,2"], capsys)
    assert "--chat wraps prompt texts" in _error(["bench", *TINY, "--chat", "--prompt-ids", "1,2"], capsys)
    assert "--chat needs a tokenizer with a chat template" in _error(["bench", *TINY, "--chat"], capsys)
    assert "prefill_chunk must be an int >= 0 (0: auto), got -1" in _error(
        ["generate", *TINY, "--prompt-ids", "1,2", "--prefill-chunk", "-1"], capsys
    )
    assert "--chat needs a chat template" in _error(
        ["generate", "--target", str(_notemplate_dir(tmp_path)), "--method", "ar", "--prompt", "hi", "--chat"], capsys
    )


def _notemplate_dir(tmp_path):
    """The fixture target with a word-level tokenizer.json and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path / "notemplate"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes(open(os.path.join(FIXTURE, name), "rb").read())
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_a_checkpoint_holding_nan_is_an_error(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    from ddtree_jax.checkpoint.errors import CheckpointError
    from ddtree_jax.engine.run import load_pair

    directory = tmp_path / "nan"
    directory.mkdir()
    (directory / "config.json").write_text(open(os.path.join(FIXTURE, "config.json")).read())
    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    name = "model.norm.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3] = np.nan
    save_file(tensors, str(directory / "model.safetensors"))
    err = _error(["generate", "--target", str(directory), "--method", "ar", "--compilation-cache", ""], capsys)
    assert f"tensor {name!r}" in err and "non-finite" in err
    with pytest.raises(CheckpointError, match="non-finite"):
        load_pair(str(directory), None, check_finite=True)
    assert load_pair(str(directory), None).tokenizer is None  # the check is off by default in Python


def test_bad_requests_fail_before_any_output(capsys):
    assert "temperature[0] = -1.0 must be finite and >= 0" in _error_before_output(
        ["generate", *TINY, "--temperature", "-1"], capsys
    )
    assert "top_p" in _error_before_output(["bench", *TINY, "--top-p", "2"], capsys)
    assert "top_k" in _error_before_output(["generate", *TINY, "--top-k", "-3"], capsys)
    assert "outside the target vocabulary" in _error_before_output(["generate", *TINY, "--prompt-ids", "1,512"], capsys)
    assert "outside the target vocabulary" in _error_before_output(
        ["bench", *TINY, "--prompt-ids", "1,2", "--prompt-ids", "1,512"], capsys
    )


@pytest.fixture
def nothing_runs(monkeypatch):
    """Loading or running a pair fails the test: the request must be refused before any work."""
    from ddtree_jax.engine import run as run_module

    def refuse(*args, **kwargs):
        raise AssertionError("the request was not refused up front")

    for name in ("random_tiny_pair", "load_pair", "run", "benchmark", "enable_compilation_cache"):
        monkeypatch.setattr(run_module, name, refuse)


def test_random_tiny_refuses_pair_options(nothing_runs, capsys):
    for command in ("generate", "bench"):
        for option in ("--target", "--drafter", "--child-head"):
            err = _error_before_output([command, "--random-tiny", option, "/nonexistent"], capsys)
            assert f"--random-tiny builds its own random pair: it cannot be combined with {option} /nonexistent" in err
    assert "--child-head directory '/nonexistent' does not exist" in _error_before_output(
        ["generate", "--child-head", "/nonexistent"], capsys
    )
    assert "--child-head needs a drafter" in _error_before_output(
        ["generate", "--target", FIXTURE, "--child-head", FIXTURE], capsys
    )


def test_output_paths_are_checked_before_any_work(tmp_path, nothing_runs, monkeypatch, capsys):
    from ddtree_jax.tree import render

    monkeypatch.setattr(render, "plot_tree", lambda *args, **kwargs: pytest.fail("plotted"))
    (tmp_path / "file").write_text("x")
    unwritable = str(tmp_path / "file" / "out.json")  # under a file: no directory can be made there
    assert f"--json {unwritable!r} cannot be written: {str(tmp_path / 'file')!r} is not a directory" in (
        _error_before_output(["bench", *TINY, "--json", unwritable], capsys)
    )
    assert f"--json {str(tmp_path)!r} is a directory" in _error_before_output(
        ["bench", *TINY, "--json", str(tmp_path)], capsys
    )
    assert "cannot be written" in _error_before_output(["tree", "--plot", str(tmp_path / "file" / "t.png")], capsys)
    err = _error_before_output(["tree", "--plot", str(tmp_path / "t.xyz")], capsys)
    assert "has extension .xyz: matplotlib writes" in err and "png" in err and "svg" in err
    assert "has no extension" in _error_before_output(["tree", "--plot", str(tmp_path / "t")], capsys)
    cli._check_output(str(tmp_path / "new" / "sub" / "out.json"), "--json")  # can be created: fine
    assert not (tmp_path / "new").exists()  # ... and only when the file is written
    assert {"png", "pdf", "svg"} <= set(cli.plot_formats()) and "pgf" not in cli.plot_formats()


def test_repeats_and_seeds_are_checked_up_front(nothing_runs, capsys):
    for value in ("0", "-1"):
        for command in ("generate", "bench"):
            assert f"repeats must be an integer >= 1, got {value}" in _error_before_output(
                [command, "--random-tiny", "--repeats", value], capsys
            )
    for seed in ("-1", str(2**32)):  # tree takes generate's check
        for command in (["tree"], ["generate", "--random-tiny"]):
            assert f"seed must be an integer in [0, 2^32), got {seed}" in _error_before_output(
                [*command, "--seed", seed], capsys
            )


def test_run_and_benchmark_refuse_repeats_below_one():
    from ddtree_jax.engine.run import benchmark, check_repeats, run

    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"repeats must be an integer >= 1, got {bad!r}")):
            check_repeats(bad)
    assert check_repeats(np.int64(2)) == 2
    # checked first, before the pair is looked at (no pair here) or anything compiles
    with pytest.raises(ValueError, match="got 0"):
        run(None, [[1]], method="ar", budget=1, block_size=None, max_new_tokens=1, temperature=0.0, repeats=0)
    with pytest.raises(ValueError, match="got -1"):
        benchmark(None, [[1]], repeats=-1)


def test_every_generate_and_bench_option_has_help_with_its_default():
    import argparse

    from ddtree_jax.__main__ import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("generate", "bench"):
        sub = commands[name]
        assert sub.description
        formatter = sub.formatter_class(prog=name)
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings)
            assert "default" in formatter._get_help_string(action), (name, action.option_strings)
        text = " ".join(sub.format_help().split())
        assert "(default: 64)" in text and "--max-new-tokens" in text and "--no-check-finite" in text


def test_main_sh_help_says_what_it_passes(tmp_path):
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(os.path.join(root, "scripts", "main.sh"), scripts / "main.sh")
    (scripts / "_venv.sh").write_text(  # this test's Python instead of creating / updating a venv
        f'repo_root="{root}"\nexport PATH="{os.path.dirname(sys.executable)}:$PATH"\n'
        f'export PYTHONPATH="{root}:{root}/kernels"\n'
    )
    out = subprocess.run(
        ["bash", str(scripts / "main.sh"), "--help"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    usage, _, generate_help = out.partition("usage: ddtree-jax generate")
    assert "--method all --budget 64 --max-new 128 --repeats 1" in usage
    assert "--target checkpoints/embedded/target --drafter checkpoints/embedded/drafter" in usage
    assert "--random-tiny --method all --budget 16" in usage
    assert "--max-new-tokens" in generate_help


def test_export_commit_writes_a_runnable_copy_of_a_commit(tmp_path):
    """scripts/export_commit.sh: a commit's code, configs and checkpoints in a folder, without the archived results
    (the same-call before / after of docs/benchmarks.md); a bad commit or an existing folder is refused."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "export_commit.sh")
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "base"
    done = subprocess.run(["bash", script, "HEAD", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for kept in ("ddtree_jax/dispatch.py", "kernels/ddtree_kernels/mosaic_common.py", "configs", "checkpoints"):
        assert (out / kept).exists(), kept
    assert not (out / "benchmarks" / "results_archive").exists() and not (out / "notebooks").exists()
    again = subprocess.run(["bash", script, "HEAD", str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
    bad = subprocess.run(["bash", script, "no-such-commit", str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no-such-commit is not a commit" in bad.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--budget", "0"], "budget must be in [1, 1024], got 0"),
        (["bench", "--budget", "16,5000"], "budget must be in [1, 1024], got 5000"),
        (["generate", "--max-new", "0"], "--max-new must be >= 1, got 0"),
        (["bench", "--block-size", "1"], "block_size must be an int >= 2, got 1"),
        (["generate", "--method", "ar", "--block-size", "0"], "block_size must be an int >= 1, got 0"),
        (["generate", "--prefill-chunk", "-1"], "prefill_chunk"),
    ],
)
def test_request_values_are_checked_before_any_checkpoint_loads(argv, message, monkeypatch, capsys):
    # a bad value used to surface only after both checkpoints had loaded (minutes for K2.6)
    def load(args):
        pytest.fail("the pair was loaded: a bad request value must stop the command before it")

    monkeypatch.setattr(cli, "_load", load)
    assert message in _error_before_output([*argv, "--compilation-cache", ""], capsys)


def test_ar_checks_its_block_size_too(capsys):
    # AR's KV cache is sized by the block size: 10**6 used to size a million-row cache
    assert "block_size must be in [1, 8]" in _error(
        ["generate", "--random-tiny", "--method", "ar", "--block-size", "1000000", "--compilation-cache", ""], capsys
    )


def test_tree_reads_a_one_array_npz_and_refuses_others(tmp_path, capsys):
    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    np.savez(tmp_path / "one.npz", logits=logits)
    np.savez(tmp_path / "two.npz", a=logits, b=logits)
    assert main(["tree", "--logits", str(tmp_path / "one.npz"), "--budget", "4"]) == 0
    assert "budget 4, depth limit L = 3, vocab V = 50" in capsys.readouterr().out
    assert "holds 2 arrays ['a', 'b']" in _error(["tree", "--logits", str(tmp_path / "two.npz")], capsys)
    assert "--max-print must be >= 0, got -1" in _error(["tree", "--max-print", "-1"], capsys)


def test_dispatch_refuses_a_budget_past_the_largest(capsys):
    assert "--budget in [1, 1024]" in _error(["dispatch", "--budget", "5000"], capsys)


def test_a_crlf_prompt_file_gives_the_same_prompts(tmp_path, monkeypatch):
    seen = []
    (tmp_path / "unix.txt").write_text("def f(\nclass A:\n")
    (tmp_path / "dos.txt").write_bytes(b"def f(\r\nclass A:\r\n")
    for name in ("unix.txt", "dos.txt"):
        args = cli.build_parser().parse_args(["bench", "--prompt-file", str(tmp_path / name)])

        class FakePair:
            tokenizer = object()

        monkeypatch.setattr(cli, "_encode", lambda pair, texts, chat, target: seen.append(texts) or [[1]] * len(texts))
        cli._bench_prompts(args, FakePair())
    assert seen[0] == seen[1] == ["def f(", "class A:"]
