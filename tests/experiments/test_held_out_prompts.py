"""Held-out prompts: deterministic, from held-out files only, exactly P tokens, also without the run's manifest."""

import json
import os
import shutil

import pytest

from ddtree_jax.checkpoint import load_tokenizer
from ddtree_jax.train.corpus import read_manifest, split_of
from experiments.held_out_prompts import find_manifest, held_out_files, load_prompts, main


@pytest.fixture(scope="module")
def tokenizer(tiny_pair_dir):
    return load_tokenizer(os.path.join(tiny_pair_dir, "target"))


def test_prompts_are_deterministic_held_out_and_exactly_p_tokens(tiny_pair_dir, tokenizer):
    prompts = load_prompts(tiny_pair_dir, tokenizer, n=6, length=20, seed=3, min_continuation=10)
    again = load_prompts(tiny_pair_dir, tokenizer, n=6, length=20, seed=3, min_continuation=10)
    assert prompts == again
    assert [p["ids"] for p in load_prompts(tiny_pair_dir, tokenizer, n=6, length=20, seed=4)] != [
        p["ids"] for p in prompts
    ]
    manifest = read_manifest(os.path.join(tiny_pair_dir, "work", "corpus", "manifest.json"))
    held = set(held_out_files(manifest))
    fraction = manifest["held_out_fraction"]
    for p in prompts:
        assert len(p["ids"]) == 20 and all(0 <= t < tokenizer.vocab_size for t in p["ids"])
        assert p["path"] in held and split_of(p["path"], fraction) == "heldout"
        with open(os.path.join(manifest["root"], p["path"])) as f:
            text = f.read()
        assert text[p["char"] :].startswith(p["text"])  # a prefix of the file from a line start on
        assert p["char"] == 0 or text[p["char"] - 1] == "\n"
    # distinct files first: as many different files as there are held-out files (or prompts)
    assert len({p["path"] for p in prompts}) == min(6, len(held))


def test_without_the_work_manifest_the_split_is_rebuilt_from_provenance(tiny_pair_dir, tokenizer, tmp_path):
    shipped = tmp_path / "pair"  # what checkpoints/embedded holds: no work/ directory
    for part in ("target", "drafter"):
        shutil.copytree(os.path.join(tiny_pair_dir, part), shipped / part)
    shutil.copy(os.path.join(tiny_pair_dir, "provenance.json"), shipped / "provenance.json")
    rebuilt = find_manifest(str(shipped))
    original = read_manifest(os.path.join(tiny_pair_dir, "work", "corpus", "manifest.json"))
    assert held_out_files(rebuilt) == held_out_files(original)
    assert rebuilt["file_list_hash"] == original["file_list_hash"]
    assert load_prompts(str(shipped), tokenizer, n=3, length=16) == load_prompts(
        tiny_pair_dir, tokenizer, n=3, length=16
    )
    os.remove(shipped / "provenance.json")
    with pytest.raises(FileNotFoundError, match="manifest"):
        find_manifest(str(shipped))


def test_too_many_prompts_is_a_clear_error(tiny_pair_dir, tokenizer):
    with pytest.raises(ValueError, match="held-out files give only"):
        load_prompts(tiny_pair_dir, tokenizer, n=4, length=10**6)


def test_cli_writes_the_prompts(tiny_pair_dir, tmp_path, capsys):
    out = tmp_path / "prompts.json"
    assert main(["--pair", tiny_pair_dir, "--n", "2", "--length", "12", "--json", str(out)]) == 0
    prompts = json.loads(out.read_text())
    assert len(prompts) == 2 and all(len(p["ids"]) == 12 for p in prompts)
    assert prompts[0]["path"] in capsys.readouterr().out


def test_an_explicit_pair_wins_over_the_environment(tiny_pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_PAIR_DIR", str(tmp_path / "no_pair_here"))
    out = tmp_path / "prompts.json"
    assert main(["--pair", tiny_pair_dir, "--n", "1", "--length", "8", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 1
