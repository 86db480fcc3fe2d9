"""Statistics shared by the law tests.

Each chi-square test is run at ALPHA = 1e-3: if the implementation were exact and the draws truly
random, a test would fail with probability 1e-3. Seeds are fixed, so every run gives the same verdict.
"""

import numpy as np
from scipy import stats

ALPHA = 1e-3


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Goodness of fit of `counts` to `probs` (any shape, flattened). Cells with expected counts under
    `min_expected` are pooled into one cell. A count in a zero-probability cell gives p = 0."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
