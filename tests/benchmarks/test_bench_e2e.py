"""benchmarks/bench_e2e.py on CPU, tiny: the bench CLI's JSON layout, the prefill timed apart, and the same
greedy text for every column (exact verification at T = 0)."""

import json

import pytest

from benchmarks import bench_e2e


def test_prompt_files_are_checked(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"ids": [1, 2, 3]}, [4, 5]]))
    assert bench_e2e.load_prompt_ids(str(path)) == [[1, 2, 3], [4, 5]]
    path.write_text(json.dumps([{"ids": []}]))
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        bench_e2e.load_prompt_ids(str(path))
    assert len(bench_e2e.load_prompt_ids(bench_e2e.PROMPTS)) == 16  # the committed 16 held-out prompts


@pytest.mark.slow
def test_a_tiny_run_writes_the_bench_layout(tmp_path):
    prompts = tmp_path / "p.json"
    held_out = bench_e2e.load_prompt_ids(bench_e2e.PROMPTS)
    prompts.write_text(json.dumps([p[:16] for p in held_out[:2]]))
    args = [
        "--commit",
        "test",
        "--prompts",
        str(prompts),
        "--budgets",
        "4",
        "--max-new",
        "6",
        "--repeats",
        "1",
        "--settings",
        "T0",
        "--out",
        str(tmp_path),
    ]
    assert bench_e2e.main(args) == 0
    out = json.loads((tmp_path / "e2e_embedded_T0_test.json").read_text())
    assert out["commit"] == "test" and out["settings"]["temperature"] == 0.0 and out["device"]["platform"] == "cpu"
    rows = out["results"]
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("chain", None), ("ddtree", 4)]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["mean_tau"] >= 1 and row["prefill_ms"] > 0
        assert all(p["decode_s"] > 0 and p["num_tokens"] == 6 for p in row["per_prompt"])
    ar_text = [p["tokens"] for p in rows[0]["per_prompt"]]
    assert all([p["tokens"] for p in row["per_prompt"]] == ar_text for row in rows)  # greedy: the same text


def test_quick_fills_only_the_options_not_given(tmp_path, monkeypatch):
    """--quick's 64 new tokens / 1 repeat / budgets 16,64 are defaults: an explicit --max-new, --repeats or
    --budgets wins (they were overwritten, and the JSON recorded the overwritten values). No pair is run here."""
    seen = []

    class Stop(Exception):
        pass

    def capture(pair, prompt_ids, *, budgets, max_new, repeats, **kwargs):
        seen.append((len(prompt_ids), list(budgets), max_new, repeats))
        raise Stop

    monkeypatch.setattr(bench_e2e, "load_pair", lambda *args: None)
    monkeypatch.setattr(bench_e2e, "pair_dtype", lambda pair: "float32")
    monkeypatch.setattr(bench_e2e, "run_setting", capture)
    for argv in (["--quick"], ["--quick", "--max-new", "8", "--repeats", "2", "--budgets", "4"]):
        with pytest.raises(Stop):
            bench_e2e.main([*argv, "--settings", "T0", "--out", str(tmp_path)])
    assert seen == [(4, [16, 64], 64, 1), (4, [4], 8, 2)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "16,2000"], "budgets in 1 .. 1024"),  # was refused after AR had compiled
        (["--budgets", "16,x"], "--budgets '16,x'"),
        (["--out", "A_FILE"], "is a file, not a directory"),  # was a FileExistsError after the first setting
    ],
)
def test_bad_arguments_are_refused_before_the_pair_loads(argv, message, tmp_path, monkeypatch):
    def loaded(*args, **kwargs):
        pytest.fail("the pair was loaded: an argument error must stop the benchmark before it")

    monkeypatch.setattr(bench_e2e, "load_pair", loaded)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    argv = [str(a_file) if a == "A_FILE" else a for a in argv]
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(".", r"\.")):
        bench_e2e.main(["--quick", *argv])
