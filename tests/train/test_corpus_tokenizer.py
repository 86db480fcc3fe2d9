"""Corpus split, tokenizer and data packing of the training recipes (no JAX)."""

import os

import numpy as np
import pytest

from ddtree_jax.train import corpus, data, tokenizer


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_split_is_deterministic_disjoint_and_independent_of_other_files(tmp_path):
    root = str(tmp_path / "lib")
    for i in range(60):
        _write(root, f"pkg{i % 4}/mod_{i}.py", f"x = {i}\n")
    _write(root, "site-packages/foreign.py", "y = 1\n")
    _write(root, "pkg0/__pycache__/cached.py", "z = 1\n")
    _write(root, "pkg0/data.txt", "not python\n")
    with open(os.path.join(root, "pkg1", "latin1.py"), "wb") as f:
        f.write(b"s = '\xe9'\n")  # not UTF-8: skipped and listed
    first = corpus.build_manifest(root, held_out_fraction=0.3)
    again = corpus.build_manifest(root, held_out_fraction=0.3)
    assert first == again
    paths = [f["path"] for f in first["files"]]
    assert paths == sorted(paths) and len(paths) == 60
    assert not any("site-packages" in p or "__pycache__" in p for p in paths)
    assert first["skipped"] == ["pkg1/latin1.py"]
    train = {f["path"] for f in first["files"] if f["split"] == "train"}
    held = {f["path"] for f in first["files"] if f["split"] == "heldout"}
    assert train and held and not train & held and train | held == set(paths)
    # a file present on one machine only does not move any other file across the split
    _write(root, "pkg9/only_here.py", "w = 0\n")
    os.remove(os.path.join(root, "pkg2", "mod_2.py"))
    other = corpus.build_manifest(root, held_out_fraction=0.3)
    common = {f["path"]: f["split"] for f in other["files"]}
    assert all(common[f["path"]] == f["split"] for f in first["files"] if f["path"] in common)
    assert other["file_list_hash"] != first["file_list_hash"]
    # include / exclude prefixes and max_files
    sub = corpus.build_manifest(root, include=("pkg0/", "pkg1/"), exclude=("pkg1/mod_1",), held_out_fraction=0.3)
    assert {p["path"].split("/")[0] for p in sub["files"]} == {"pkg0", "pkg1"}
    assert not any(p["path"].startswith("pkg1/mod_1") for p in sub["files"])
    with pytest.raises(ValueError, match="held_out_fraction"):
        corpus.build_manifest(root, held_out_fraction=1.0)


def test_manifest_round_trip_and_change_detection(tmp_path):
    root = str(tmp_path / "lib")
    for i in range(20):
        _write(root, f"m{i}.py", f"def f{i}():\n    return {i}\n")
    manifest = corpus.build_manifest(root, held_out_fraction=0.4)
    corpus.write_manifest(manifest, str(tmp_path / "work" / "manifest.json"))
    assert corpus.read_manifest(str(tmp_path / "work" / "manifest.json")) == manifest
    texts = corpus.read_texts(manifest, "train")
    assert len(texts) == manifest["num_files"]["train"] and all(t.startswith("def f") for t in texts)
    changed = next(f["path"] for f in manifest["files"] if f["split"] == "train")
    _write(root, changed, "changed\n")
    with pytest.raises(ValueError, match="changed since the manifest"):
        corpus.read_texts(manifest, "train")
    assert "files" not in corpus.summary(manifest)


def test_stdlib_manifest_of_the_interpreter():
    manifest = corpus.build_manifest(include=("json/",), held_out_fraction=0.5)
    assert manifest["root"] == os.path.abspath(corpus.stdlib_root())
    assert {f["path"] for f in manifest["files"]} >= {"json/__init__.py", "json/decoder.py"}
    assert manifest["python_version"].startswith("3.")


def test_tokenizer_round_trips_text_and_names_its_specials(tmp_path):
    from ddtree_jax.checkpoint import load_tokenizer

    manifest = corpus.build_manifest(include=("json/",), held_out_fraction=0.5)
    texts = corpus.read_texts(manifest, "train") + corpus.read_texts(manifest, "heldout")
    tok = tokenizer.train_tokenizer(texts, vocab_size=400)
    assert tok.get_vocab_size() <= 400
    ids = tokenizer.special_ids(tok)
    assert sorted(ids.values()) == [0, 1, 2] and ids["eos"] == 0 and ids["mask"] == 1
    samples = texts[:2] + [
        "def f(x):\n\tif x:  # tabs, trailing spaces   \n        return 'héllo ☃ \\u2603'\n\n\n",
        "   leading\r\nwindows line\x00nul",
        "",
    ]
    for text in samples:
        encoded = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(encoded, skip_special_tokens=False) == text
        assert ids["mask"] not in encoded
    assert len(tok.encode(texts[0]).ids) < 0.7 * len(texts[0].encode())  # merges were learned
    tokenizer.save(tok, str(tmp_path / "tok"))
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.eos_token_id == ids["eos"]
    assert loaded.decode(loaded.encode(samples[2])) == samples[2]
    assert tokenizer.file_hash(str(tmp_path / "tok")) == tokenizer.file_hash(str(tmp_path / "tok"))


def test_pack_and_seeded_batches():
    docs = [np.arange(1, 8, dtype=np.int32), np.arange(10, 13, dtype=np.int32), np.arange(20, 30, dtype=np.int32)]
    packed = data.pack(docs, eos_id=0, seq_len=5)
    stream = np.concatenate([docs[0], [0], docs[1], [0], docs[2], [0]])
    assert packed.shape == (len(stream) // 5, 5) and packed.dtype == np.int32
    np.testing.assert_array_equal(packed.reshape(-1), stream[: packed.size])
    assert data.stream_length(docs) == len(stream)
    seqs = np.arange(40, dtype=np.int32).reshape(10, 4)
    a, b = data.Batches(seqs, 3, seed=7), data.Batches(seqs, 3, seed=7)
    order = [a.batch(s) for s in range(7)]
    for s in (5, 0, 6, 2):  # any order of requests: a pure function of (seed, step)
        np.testing.assert_array_equal(b.batch(s), order[s])
    epoch0 = np.concatenate(order[:3])[:, 0]
    assert len(set(epoch0.tolist())) == 9  # no sequence twice within an epoch
    assert not np.array_equal(data.Batches(seqs, 3, seed=8).batch(0), order[0])
    held = data.eval_batches(seqs, 4, max_batches=1)
    assert len(held) == 1 and held[0].shape == (4, 4)
    assert data.eval_batches(seqs[:2], 4)[0].shape == (2, 4)
    with pytest.raises(ValueError):
        data.Batches(seqs[:2], 3, seed=0)
