"""Training recipes for the embedded default pair: a Qwen3-architecture target LM on the Python
standard library (byte-level BPE tokenizer) and a DFlash drafter trained against it.

    corpus.py     the stdlib .py files, hashed train / held-out split, manifest
    tokenizer.py  byte-level BPE with `tokenizers` (eos, mask, pad specials)
    data.py       encode, pack into fixed-length sequences, seeded batches
    common.py     AdamW + warm-up / cosine, Orbax checkpoints, logs
    target.py     next-token LM training, held-out perplexity
    drafter.py    DFlash training: random anchors, context strictly before the anchor, gamma-decayed loss
    pipeline.py   the stages behind `python -m ddtree_jax.train`, HF exports and provenance.json
"""
