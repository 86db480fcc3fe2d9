"""A float64 numpy twin of processed_probs, written straight from the definitions of docs/sampling.md (one row at a time)."""

import numpy as np


def processed_probs_row(logits, temperature, top_k, top_p, min_p):
    """Returns (probs float64 [V], above_mass float64 [V] at the top-p stage, or None if top-p off)."""
    x = np.asarray(logits, np.float64)
    vocab = len(x)
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0  # np.argmax: first maximal index
        return out, None
    z = (x - x.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    if 0 < top_k < vocab:
        kth = np.sort(p)[::-1][top_k - 1]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    above = None
    if top_p < 1.0:
        above = np.array([p[p > v].sum() for v in p])
        p = np.where(above < top_p, p, 0.0)
        p /= p.sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p, above
