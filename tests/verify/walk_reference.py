"""The spec's walk transcribed line by line into plain Python (float32 arithmetic): the twin of verify_sampling."""

import numpy as np


def walk_reference(
    candidates, next_token, next_sibling, probs, coins, final_coin, max_accept, threshold_single=1.0, threshold_acc=1.0
):
    """One row. Returns (accept list, n_acc, tokens list of length S with -1 padding)."""
    f32 = np.float32
    steps = max_accept + 1
    vocab = probs.shape[-1]
    prob_acc = f32(0)
    row = 0
    coin = coins[0]
    accept = [0]
    n_acc = 0
    cur = 0
    last_rejected = -1
    excluded = set()
    for _ in range(1, steps):
        cur = next_token[cur]
        while cur != -1:
            tok = candidates[cur]
            p = probs[row, tok]
            prob_acc = f32(prob_acc + p)
            if p > 0 and (coin < f32(prob_acc / max(threshold_acc, 1e-9)) or p >= threshold_single):
                prob_acc = f32(0)
                last_rejected = -1
                excluded = set()
                row = cur
                coin = coins[cur]
                n_acc += 1
                accept.append(int(cur))
                break
            if p > 0:
                last_rejected = int(tok)
            excluded.add(int(tok))
            cur = next_sibling[cur]
        if cur == -1:
            break
    residual = probs[row].astype(np.float32).copy()
    if n_acc != steps - 1:
        for tok in excluded:
            residual[tok] = 0
    cdf = np.cumsum(residual, dtype=np.float32)
    u = f32(final_coin * cdf[-1])
    hits = np.nonzero((residual > 0) & (cdf > u))[0]
    positive = np.nonzero(residual > 0)[0]
    if len(hits):
        final = int(hits[0])
    elif len(positive):
        final = int(positive[-1])
    elif last_rejected >= 0:
        final = last_rejected
    else:
        final = vocab - 1
    tokens = [int(candidates[i]) for i in accept[1:]] + [final]
    return accept + [-1] * (steps - len(accept)), n_acc, tokens + [-1] * (steps - len(tokens)), (u, cdf)
