"""The plain sampler: its law (chi-square), coins, key dependence and row independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import (
    COIN_MAX,
    COIN_MIN,
    INVALID_TOKEN,
    SamplingParams,
    draw_coins,
    inverse_cdf,
    processed_probs,
    row_keys,
    sample,
)
from tests.stats_helpers import ALPHA, chi_square_pvalue


def test_coins_range_and_row_keys():
    coins = np.asarray(draw_coins(jax.random.key(0), (100_000,)))
    assert coins.min() >= COIN_MIN and coins.max() <= COIN_MAX and coins.dtype == np.float32
    keys = row_keys(jax.random.key(1), jnp.arange(4))
    a = np.asarray(draw_coins(keys, (7,)))
    b = np.asarray(draw_coins(keys[2:3], (7,)))
    np.testing.assert_array_equal(a[2], b[0])  # a row's coins depend on its key only
    with pytest.raises(ValueError, match="typed PRNG key"):
        draw_coins(jax.random.PRNGKey(0), (3,))


def test_inverse_cdf_boundaries():
    w = jnp.array([0.0, 0.25, 0.0, 0.75, 0.0])
    pick = lambda c: int(inverse_cdf(w, jnp.float32(c))[0])  # noqa: E731
    assert pick(0.25) == 3  # a coin on an interior CDF boundary goes to the next bucket
    assert pick(COIN_MIN) == 1  # never the zero-probability token 0
    assert pick(COIN_MAX) == 3  # never the zero-probability token 4
    token, has_mass = inverse_cdf(jnp.zeros(5), jnp.float32(0.5))
    assert not bool(has_mass)


def test_sampler_law_matches_processed_probs():
    vocab, draws = 12, 200_000
    logits = jax.random.normal(jax.random.key(3), (1, vocab)) * 1.5
    params_one = SamplingParams.create(1, temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    expected = np.asarray(processed_probs(logits, params_one))[0]
    params = SamplingParams.create(draws, temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    tokens = np.asarray(
        jax.jit(sample)(
            jnp.broadcast_to(logits, (draws, vocab)), params, row_keys(jax.random.key(4), jnp.arange(draws))
        )
    )
    counts = np.bincount(tokens, minlength=vocab)
    assert (counts[expected == 0] == 0).all()  # support
    p_value = chi_square_pvalue(counts, expected)
    assert p_value > ALPHA, f"chi-square p = {p_value}"
    # negative control: the same test rejects a slightly different temperature
    near = np.asarray(
        processed_probs(logits, SamplingParams.create(1, temperature=0.9, top_k=8, top_p=0.95, min_p=0.02))
    )[0]
    assert chi_square_pvalue(counts, near) < ALPHA


def test_sampler_rows_keys_greedy_and_invalid():
    logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [0.0, 1.0, 3.0, 1.0], [0.0, jnp.nan, 1.0, 1.0]])
    params = SamplingParams.create(3, temperature=[0.0, 1.0, 1.0])
    keys = row_keys(jax.random.key(5), jnp.arange(3))
    out = np.asarray(sample(logits, params, keys))
    assert out[0] == 1 and out[2] == INVALID_TOKEN
    # a row's draw depends on its own logits, parameters and key only
    alone = np.asarray(sample(logits[1:2], jax.tree.map(lambda x: x[1:2], params), keys[1:2]))
    assert alone[0] == out[1]
    # the key decides a sampled row's draw (T = 1: many keys give several tokens), never a greedy row's
    many = row_keys(jax.random.key(6), jnp.arange(64))
    rows = lambda i: jnp.broadcast_to(logits[i], (64, 4))  # noqa: E731
    sampled = np.asarray(sample(rows(1), SamplingParams.create(64, temperature=1.0), many))
    assert len(set(sampled.tolist())) > 1 and set(sampled.tolist()) <= {0, 1, 2, 3}
    greedy = np.asarray(sample(rows(0), SamplingParams.create(64, temperature=0.0), many))
    assert (greedy == 1).all()  # argmax, lower id of the tie 1 / 2


def test_sampler_wants_one_key_per_row():
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match=r"one typed PRNG key per row, shape \[B\] = \(3,\), got \(2,\)"):
        sample(jnp.zeros((3, 8)), SamplingParams.create(3), keys)
