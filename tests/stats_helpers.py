"""Statistics shared by the law tests.

Each chi-square test is run at ALPHA = 1e-3: if the implementation were exact and the draws truly
random, a test would fail with probability 1e-3. Seeds are fixed, so every run gives the same verdict.
"""

from ddtree_jax.verify.markov import chi_square_pvalue

ALPHA = 1e-3

__all__ = ["ALPHA", "chi_square_pvalue"]
