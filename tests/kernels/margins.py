"""A float64 oracle for explaining kernel/reference disagreements.

The Pallas kernels and the XLA reference reduce in different orders, so a decision whose two sides
differ by less than float32 rounding can go either way. For one batch row, `row_margin` replays the
spec's walk in float64 and returns the smallest distance, over every decision the walk makes, between
a quantity and the boundary it is compared with:

  - each acceptance test: |coin - prob_acc| (probabilities sum to 1, so absolute distances);
  - each filter of a row the walk reads: top-p |mass strictly above a token - top_p| over the row's
    tokens, min-p |p - min_p * max p| over the row's tokens;
  - the final sample: |u - cdf[j]| over the row's tokens.

A disagreement is explained when this margin is below a tolerance (float32 sums over V values).
"""

import numpy as np


def processed_f64(logits, temperature, top_k, top_p, min_p):
    """One row [V] -> (float64 probabilities [V], filter margin)."""
    x = np.asarray(logits, np.float64)
    vocab = x.shape[0]
    if temperature == 0:
        p = np.zeros(vocab)
        p[int(np.argmax(x))] = 1.0
        return p, np.inf
    e = np.exp((x - x.max()) / temperature)
    p = e / e.sum()
    margin = np.inf
    if 0 < top_k < vocab:
        kth = np.sort(p)[::-1][top_k - 1]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        s = p[order]
        csum = np.cumsum(s)
        # mass strictly above each sorted value (ties share the mass above their group)
        above_sorted = np.empty_like(s)
        start = 0
        for i in range(1, vocab + 1):
            if i == vocab or s[i] != s[start]:
                above_sorted[start:i] = csum[start] - s[start]
                start = i
        above = np.empty_like(p)
        above[order] = above_sorted
        live = p > 0
        margin = min(margin, float(np.min(np.abs(above[live] - top_p))))
        p = np.where(above < top_p, p, 0.0)
        p /= p.sum()
    if min_p > 0:
        cut = min_p * p.max()
        live = p > 0
        margin = min(margin, float(np.min(np.abs(p[live] - cut))) / p.max())
        p = np.where(p >= cut, p, 0.0)
        p /= p.sum()
    return p, margin


def row_margin(candidates, next_token, next_sibling, logits, params_row, coins, final_coin, max_accept):
    """The smallest decision margin of one row's float64 walk (see the module docstring).

    logits [N, V] (any float dtype, read as float64); params_row = (T, top_k, top_p, min_p).
    """
    temperature, top_k, top_p, min_p = params_row
    cache = {}

    def row_probs(r):
        if r not in cache:
            cache[r] = processed_f64(np.asarray(logits[r], np.float32), temperature, int(top_k), top_p, min_p)
        return cache[r]

    margin = np.inf
    steps = max_accept + 1
    row, n_acc, cur, prob_acc = 0, 0, 0, 0.0
    excluded = set()
    probs, fm = row_probs(0)
    margin = min(margin, fm)
    for _ in range(1, steps):
        cur = next_token[cur]
        while cur != -1:
            tok = int(candidates[cur])
            p = probs[tok]
            prob_acc += p
            if p > 0:
                margin = min(margin, abs(float(coins[row]) - prob_acc))
            if p > 0 and coins[row] < prob_acc:
                prob_acc, excluded, row = 0.0, set(), int(cur)
                n_acc += 1
                probs, fm = row_probs(row)
                margin = min(margin, fm)
                break
            excluded.add(tok)
            cur = next_sibling[cur]
        if cur == -1:
            break
    residual = probs.copy()
    if n_acc != steps - 1:
        residual[list(excluded)] = 0.0
    cdf = np.cumsum(residual)
    if cdf[-1] > 0:
        margin = min(margin, float(np.min(np.abs(cdf - final_coin * cdf[-1]))))
    return margin
