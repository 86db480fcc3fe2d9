"""A byte-level BPE tokenizer trained with `tokenizers` on the training split.

Byte-level: every text round-trips (decode(encode(text)) == text). The special tokens come first
(ids 0, 1, 2 ...): end of text (the separator between files and the eos of generation), the drafter's
mask token, padding. `save` writes tokenizer.json plus tokenizer_config.json naming them, which
`ddtree_jax.checkpoint.load_tokenizer` reads.
"""

from __future__ import annotations

import hashlib
import json
import os

DEFAULT_SPECIALS = {"eos": "<|endoftext|>", "mask": "<|mask|>", "pad": "<|pad|>"}


def train_tokenizer(texts, vocab_size: int = 8192, min_frequency: int = 2, specials: dict | None = None):
    """A `tokenizers.Tokenizer` (byte-level BPE, GPT-2 pre-tokenisation) of at most vocab_size ids,
    specials included. Training is deterministic for a fixed input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = dict(DEFAULT_SPECIALS if specials is None else specials)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=list(specials.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    return tok


def special_ids(tok, specials: dict | None = None) -> dict:
    """{"eos": id, "mask": id, "pad": id} of a trained tokenizer."""
    specials = DEFAULT_SPECIALS if specials is None else specials
    ids = {k: tok.token_to_id(v) for k, v in specials.items()}
    missing = [specials[k] for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"tokenizer lacks the special tokens {missing}")
    return ids


def save(tok, directory: str, specials: dict | None = None) -> None:
    """tokenizer.json + tokenizer_config.json (eos / pad / mask token names) in `directory`."""
    specials = DEFAULT_SPECIALS if specials is None else specials
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": specials["eos"],
        "pad_token": specials["pad"],
        "mask_token": specials["mask"],
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load(directory: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


def file_hash(directory: str) -> str:
    """sha256 of tokenizer.json (what the data cache and provenance key on)."""
    with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
