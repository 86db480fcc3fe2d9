"""Token data: encode the split's files, pack them into fixed-length sequences, seeded batches.

Files are encoded one by one, each followed by the end-of-text token, concatenated in path order and
cut into sequences of `seq_len` tokens (the tail that does not fill one is dropped). Batches are
a pure function of (seed, step): epoch e visits the sequences in the permutation drawn from
`default_rng([seed, e])`, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ddtree_jax.train.corpus import read_texts


def encode_texts(tok, texts: list[str]) -> list[np.ndarray]:
    """int32 token ids of each text (no special tokens added)."""
    return [np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts, add_special_tokens=False)]


def pack(docs: list[np.ndarray], eos_id: int, seq_len: int) -> np.ndarray:
    """int32 [N, seq_len]: the docs, each followed by eos, concatenated and cut (remainder dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    pieces = []
    for doc in docs:
        pieces += [doc, np.array([eos_id], np.int32)]
    stream = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
    count = len(stream) // seq_len
    return stream[: count * seq_len].reshape(count, seq_len).astype(np.int32)


def stream_length(docs: list[np.ndarray]) -> int:
    return int(sum(len(d) + 1 for d in docs))


class Batches:
    """Seeded batches of packed sequences: `batch(step)` is deterministic in (seed, step)."""

    def __init__(self, sequences: np.ndarray, batch_size: int, seed: int):
        if len(sequences) < batch_size:
            raise ValueError(f"{len(sequences)} sequences cannot fill one batch of {batch_size}")
        self.sequences = sequences
        self.batch_size = batch_size
        self.seed = seed
        self.per_epoch = len(sequences) // batch_size
        self._epoch, self._order = None, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))
        return self._order

    def batch(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.per_epoch)
        order = self._permutation(epoch)
        return self.sequences[order[index * self.batch_size : (index + 1) * self.batch_size]]

    def epochs(self, steps: int) -> float:
        return steps / self.per_epoch


def eval_batches(sequences: np.ndarray, batch_size: int, max_batches: int | None = None) -> list[np.ndarray]:
    """The first held-out sequences in order, as full batches (one smaller batch if fewer than batch_size)."""
    if len(sequences) == 0:
        raise ValueError("no held-out sequences (the held-out split is shorter than one sequence)")
    if len(sequences) < batch_size:
        return [sequences]
    count = len(sequences) // batch_size
    if max_batches is not None:
        count = min(count, max_batches)
    return [sequences[i * batch_size : (i + 1) * batch_size] for i in range(count)]


def load_or_build(
    work: str, split: str, tok, tok_hash: str, manifest: dict, eos_id: int, seq_len: int
) -> tuple[np.ndarray, int]:
    """(packed sequences, tokens in the split) for one split, cached under work/data keyed by the
    tokenizer file hash, the corpus content hash and seq_len."""
    directory = os.path.join(work, "data")
    key = {"tokenizer": tok_hash, "content_hash": manifest["content_hash"], "seq_len": seq_len, "split": split}
    arr_path, meta_path = os.path.join(directory, f"{split}.npy"), os.path.join(directory, f"{split}.json")
    if os.path.exists(arr_path) and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("key") == key:
            return np.load(arr_path), int(meta["tokens"])
    docs = encode_texts(tok, read_texts(manifest, split))
    sequences = pack(docs, eos_id, seq_len)
    os.makedirs(directory, exist_ok=True)
    np.save(arr_path, sequences)
    with open(meta_path, "w") as f:
        json.dump({"key": key, "tokens": stream_length(docs), "sequences": len(sequences)}, f)
    return sequences, stream_length(docs)
