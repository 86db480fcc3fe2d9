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


def _shard_file(
    tmp_path,
    name,
    layers,
    *,
    model_size=8,
    drafter_layers=6,
    ms=1.0,
    drafts=None,
    benchmark="k26_tp8_shard",
    tiny=None,
    row_fields=None,
):
    rows = [
        {"B": 1, "context": 4096, "method": m, "budget": b, "loop_step_ms": ms * k, "step_ms": ms * k}
        | {"collectives_ms": 0.1, "layers": layers}
        | ({} if drafts is None else {"drafts": drafts})
        | (row_fields or {})
        for m, b, k in (("ar", None, 1.0), ("ddtree", 64, 2.0))
    ]
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "benchmark": benchmark,
                "commit": "c0ffee",
                "date": "2026-12-05T00:00:00+00:00",
                "device": "gpu:test",
                "model_size": model_size,
                "drafter_layers": drafter_layers,
                "rows": rows,
            }
            | ({} if tiny is None else {"tiny": tiny})
        )
    )
    return str(path)


def _e2e_file(tmp_path, name="e2e.json"):
    path = tmp_path / name
    path.write_text(json.dumps(_e2e(chain_steps=50, ddtree_steps=25)))
    return str(path)


def test_shard_files_of_different_models_are_refused(tmp_path, capsys):
    """A 61-layer and a 4-layer shard file would mix models (AR from one, DDTree from the other): refused, naming
    both files and the field, before anything is written; so are a file given twice and other model fields."""
    deep = _shard_file(tmp_path, "deep.json", 61, row_fields={"router_bias": "zero", "temperature": 0.0})
    e2e = _e2e_file(tmp_path)
    out = tmp_path / "out"
    cases = [
        (_shard_file(tmp_path, "shallow.json", 4, ms=0.1), "layers (61 vs 4)"),
        (_shard_file(tmp_path, "tp4.json", 61, model_size=4), "model_size (8 vs 4)"),
        (_shard_file(tmp_path, "drafter3.json", 61, drafter_layers=3), "drafter_layers (6 vs 3)"),
        # the tiny K2's shard: by the "tiny" field, and by the name of a file from before the field
        (_shard_file(tmp_path, "tiny.json", 61, tiny=True), "tiny (False vs True)"),
        (_shard_file(tmp_path, "tiny_old.json", 61, benchmark="k26_tp8_shard_tiny_x"), "tiny (False vs True)"),
        # settings the rows record: a random router bias (faster steps) or another temperature beside zero / 0
        (
            _shard_file(tmp_path, "random.json", 61, row_fields={"router_bias": "random"}),
            "router_bias ('zero' vs 'random')",
        ),
        (_shard_file(tmp_path, "hot.json", 61, row_fields={"temperature": 1.0}), "temperature (0.0 vs 1.0)"),
        # the random drafter's own drafts (rows without the field: before it existed) beside spread ones
        (_shard_file(tmp_path, "spread.json", 61, drafts="spread"), "drafts ('model' vs 'spread')"),
        (deep, "given twice"),
    ]
    for other, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["--shard", f"{deep},{other}", "--e2e", e2e, "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and deep in err and (other in err or other == deep), err
    with pytest.raises(SystemExit):  # the same e2e file twice would count every row twice
        main(["--shard", deep, "--e2e", f"{e2e},{e2e}", "--out", str(out)])
    assert "given twice" in capsys.readouterr().err
    assert not out.exists()
    rows = json.loads((tmp_path / "deep.json").read_text())["rows"]
    with pytest.raises(ValueError, match="different depths"):  # the library call refuses mixed rows too
        predict(rows + [dict(rows[1], layers=4)], {}, [4.0])
    with pytest.raises(ValueError, match="different drafts"):
        predict(rows + [dict(rows[1], drafts="spread")], {}, [4.0])
    mixed = tmp_path / "mixed.json"  # one file whose rows ran two router biases
    data = json.loads((tmp_path / "deep.json").read_text())
    data["rows"][1]["router_bias"] = "random"
    mixed.write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        main(["--shard", str(mixed), "--e2e", e2e, "--out", str(out)])
    assert "rows of different router_bias" in capsys.readouterr().err
    # a file from before the fields (rows without them) combines with one that recorded them
    old = _shard_file(tmp_path, "old.json", 61)
    assert main(["--shard", f"{deep},{old}", "--e2e", e2e, "--out", str(tmp_path / "combined")]) == 0


def test_shard_files_of_one_model_with_other_tags_combine(tmp_path):
    """--tag names a run's file (`k26_tp8_shard_<tag>`), not its model: a 4k run and a 32k run of one model, tagged
    apart, give one prediction with both contexts."""
    first = _shard_file(tmp_path, "a.json", 61, benchmark="k26_tp8_shard_61l_spread", drafts="spread", tiny=False)
    second = _shard_file(tmp_path, "b.json", 61, benchmark="k26_tp8_shard_61l_spread_32k", drafts="spread")
    data = json.loads((tmp_path / "b.json").read_text())
    for row in data["rows"]:
        row["context"] = 32768
    (tmp_path / "b.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    assert main(["--shard", f"{first},{second}", "--e2e", _e2e_file(tmp_path), "--out", str(out)]) == 0
    record = json.loads((out / "k26_prediction.json").read_text())
    assert {r["context"] for r in record["rows"]} == {4096, 32768}


def test_the_prediction_json_records_date_commit_and_sources(tmp_path):
    shard = _shard_file(tmp_path, "a.json", 61)
    out = tmp_path / "out"
    assert main(["--shard", shard, "--e2e", _e2e_file(tmp_path), "--out", str(out), "--commit", "abc1234"]) == 0
    record = json.loads((out / "k26_prediction.json").read_text())
    assert record["commit"] == "abc1234" and record["date"].endswith("+00:00")
    assert record["shard_device"] == ["gpu:test"]
    assert record["shard_sources"] == [
        {"file": shard, "commit": "c0ffee", "date": "2026-12-05T00:00:00+00:00", "device": "gpu:test"}
    ]
    assert {r["method"] for r in record["rows"]} == {"ar", "ddtree"}


def test_e2e_files_of_one_temperature_combine(tmp_path):
    """A later run of budget 8 beside the main run: each budget's ratio against its own file's chain; a budget in
    both files takes the first file listed."""
    main_run = _e2e(chain_steps=50, ddtree_steps=25)  # budget 64: ratio 2
    later = _e2e(chain_steps=40, ddtree_steps=32)  # its own chain: budget 8 at 50 / 40 -> ratio 1.25
    later["results"][1]["budget"] = 8
    later["results"].append(dict(later["results"][1], budget=64))  # budget 64 again: ratio 1.25 here, ignored
    paths = []
    for name, data in (("main.json", main_run), ("b8.json", later)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    shard = _shard_file(tmp_path, "a.json", 61)
    data = json.loads((tmp_path / "a.json").read_text())
    data["rows"].append(dict(data["rows"][-1], budget=8, loop_step_ms=data["rows"][-1]["loop_step_ms"] / 2))
    (tmp_path / "a.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    assert main(["--shard", shard, "--e2e", ",".join(paths), "--out", str(out), "--chain-taus", "4"]) == 0
    record = json.loads((out / "k26_prediction.json").read_text())
    trees = {r["budget"]: r for r in record["rows"] if r["method"] == "ddtree"}
    assert trees[64]["acceptance_ratio"] == pytest.approx(2.0) and trees[64]["e2e_source"] == paths[0]
    assert trees[8]["acceptance_ratio"] == pytest.approx(1.25) and trees[8]["e2e_source"] == paths[1]
    assert trees[8]["tau"] == pytest.approx(5.0)


def test_e2e_files_of_different_runs_do_not_combine(tmp_path, capsys):
    """Files of one temperature but other requests (here top-p) would mix ratios of different runs: refused naming
    both files and the field; a file without a chain row is named too."""
    first, other = _e2e(chain_steps=50, ddtree_steps=25), _e2e(chain_steps=40, ddtree_steps=32)
    first["settings"]["top_p"], other["settings"]["top_p"] = 1.0, 0.95
    no_chain = _e2e(chain_steps=50, ddtree_steps=25)
    no_chain["results"] = no_chain["results"][1:]
    paths = {}
    for name, data in (("first.json", first), ("other.json", other), ("nochain.json", no_chain)):
        (tmp_path / name).write_text(json.dumps(data))
        paths[name] = str(tmp_path / name)
    shard = _shard_file(tmp_path, "a.json", 61)
    for e2e, message in (
        (f"{paths['first.json']},{paths['other.json']}", "differ in top_p (1.0 vs 0.95)"),
        (paths["nochain.json"], f"--e2e {paths['nochain.json']}: the e2e JSON has no chain row"),
    ):
        with pytest.raises(SystemExit):
            main(["--shard", shard, "--e2e", e2e, "--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err


def test_missing_or_foreign_files_are_named_in_one_error_line(tmp_path, capsys):
    """A missing file, a file that is not JSON, or a shard JSON given as --e2e: one argparse error naming the flag
    and the file (were a FileNotFoundError / JSONDecodeError / KeyError traceback)."""
    shard, e2e = _shard_file(tmp_path, "a.json", 61), _e2e_file(tmp_path)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    missing = str(tmp_path / "missing.json")
    for argv, message in (
        (["--shard", missing, "--e2e", e2e], f"--shard {missing!r}"),
        (["--shard", shard, "--e2e", missing], f"--e2e {missing!r}"),
        (["--shard", shard, "--e2e", str(garbage)], f"--e2e {str(garbage)!r}"),
        (["--shard", shard, "--e2e", shard], "no settings, results field"),
        (["--shard", e2e, "--e2e", e2e], "no rows field"),
    ):
        with pytest.raises(SystemExit) as raised:
            main([*argv, "--out", str(tmp_path / "out")])
        assert raised.value.code == 2
        assert message in capsys.readouterr().err
