"""processed_probs against the float64 twin of the definitions; ties, boundaries, greedy, invalid rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import SamplingParams, check_logits, processed_probs, valid_rows
from tests.sampling.probs_reference import processed_probs_row

SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.5, 20, 0.9, 0.05),
    (0.0, 0, 1.0, 0.0),
    (2.0, 3, 0.5, 0.2),
    (1.0, 1, 1.0, 0.0),
]


def _params(rows):
    t, k, p, m = zip(*rows)
    return SamplingParams.create(len(rows), temperature=t, top_k=k, top_p=p, min_p=m)


@pytest.mark.parametrize("tied", [False, True])
def test_matches_float64_definitions(tied):
    rng = np.random.default_rng(0 + tied)
    rows = SETTINGS * 4
    vocab = 257
    logits = rng.standard_normal((len(rows), vocab)) * 2.5
    if tied:  # bf16-like logits: many exact ties, incl. at the top-k cut
        logits = np.round(logits * 2) / 2
    probs = np.asarray(processed_probs(jnp.asarray(logits, jnp.float32), _params(rows)))
    for b, (t, k, p, m) in enumerate(rows):
        expected, above = processed_probs_row(logits[b].astype(np.float32), t, k, p, m)
        got_set, exp_set = probs[b] > 0, expected > 0
        if above is not None:  # a float32 cumsum may flip a token whose mass-above sits on top_p
            boundary = np.abs(above - p) < 1e-5
            assert (got_set == exp_set)[~boundary].all(), f"row {b}: kept set differs away from the top-p boundary"
            if (got_set != exp_set).any():
                continue
        np.testing.assert_array_equal(got_set, exp_set, err_msg=f"row {b} kept set")
        np.testing.assert_allclose(probs[b], expected, rtol=2e-5, atol=1e-7, err_msg=f"row {b}")


def test_top_k_keeps_ties_at_the_cut_and_greedy_picks_lowest_id():
    logits = jnp.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0], [1.0, 5.0, 5.0, 0.0, 5.0, 0.0]])
    params = SamplingParams.create(2, temperature=[1.0, 0.0], top_k=[2, 0])
    probs = np.asarray(processed_probs(logits, params))
    assert (probs[0] > 0).tolist() == [True, False, True, True, True, False]  # 3 tied at the 2nd place
    assert probs[1].tolist() == [0, 1, 0, 0, 0, 0]


def test_top_p_uses_mass_of_strictly_more_probable_tokens():
    probs_in = np.array([0.4, 0.3, 0.3, 0.0 + 1e-12])
    logits = jnp.asarray(np.log(probs_in)[None], jnp.float32)
    # token 1 and 2 (0.3 each) have 0.4 strictly above them: kept iff 0.4 < top_p
    kept = lambda top_p: (np.asarray(processed_probs(logits, SamplingParams.create(1, top_p=top_p)))[0] > 0).tolist()  # noqa: E731
    assert kept(0.41) == [True, True, True, False]
    assert kept(0.40) == [True, False, False, False]


def test_low_temperature_is_finite_and_mixes_with_greedy_rows():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 1000)) * 30, jnp.bfloat16)
    params = SamplingParams.create(3, temperature=[1e-4, 0.0, 1e-30], top_p=[0.9, 1.0, 1.0])
    probs = np.asarray(processed_probs(logits, params))
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    top = np.asarray(jnp.argmax(logits, -1))
    assert (probs[np.arange(3), top] > 0.99).all()


def test_tree_shaped_logits_use_per_row_params():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((2, 5, 50)), jnp.float32)
    params = SamplingParams.create(2, temperature=[0.0, 1.0], top_k=[0, 3])
    probs = np.asarray(processed_probs(logits, params))
    assert ((probs[0] > 0).sum(-1) == 1).all() and ((probs[1] > 0).sum(-1) == 3).all()


def test_invalid_rows_are_zero_and_flagged():
    logits = np.zeros((4, 8), np.float32)
    logits[1, 3] = np.nan
    logits[2, 0] = np.inf
    logits[3] = -np.inf
    probs = np.asarray(processed_probs(jnp.asarray(logits), SamplingParams.create(4)))
    assert probs[0].sum() == pytest.approx(1.0) and (probs[1:] == 0).all()
    assert np.asarray(valid_rows(jnp.asarray(logits))).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match=r"logits row \(1,\)"):
        check_logits(jnp.asarray(logits))
    masked = logits[:1].copy()
    masked[0, :4] = -np.inf  # -inf entries are masked tokens, not an error
    probs = np.asarray(processed_probs(jnp.asarray(masked), SamplingParams.create(1)))
    assert (probs[0, :4] == 0).all() and probs[0, 4:] == pytest.approx(0.25)


def test_under_jit_and_vocab_sizes_not_powers_of_two():
    for vocab in (8193, 151936, 163840):
        logits = jax.random.normal(jax.random.key(vocab), (2, vocab)) * 3
        params = SamplingParams.create(2, temperature=[0.8, 1.2], top_k=[50, 0], top_p=[1.0, 0.95], min_p=[0.0, 0.01])
        probs = jax.jit(processed_probs)(logits, params)
        np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, rtol=1e-5)
        assert int((probs[0] > 0).sum()) == 50


def test_a_float64_temperature_below_float32s_range_is_greedy():
    """np.float64 settings (SamplingParams takes numpy arrays): 1e-50 > 0 passed the greedy test in float64 but
    divided as float32 0, so the row became all zeros and a verifier emitted the last token id. Computed at float32
    it is greedy, as in the fused kernels."""
    logits = jnp.array([[3.0, 1.0, 0.5, -2.0], [0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(
        temperature=np.array([1e-50, 1.0]),
        top_k=np.array([0, 0]),
        top_p=np.array([1.0, 1.0]),
        min_p=np.array([0.0, 0.0]),
    )
    probs = np.asarray(processed_probs(logits, params))
    np.testing.assert_array_equal(probs[0], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(probs[1], np.asarray(jax.nn.softmax(logits[1])), rtol=1e-6)


def test_a_float_top_k_is_named():
    with pytest.raises(ValueError, match="top_k must hold integers, got dtype float64"):
        SamplingParams(temperature=np.array([1.0]), top_k=np.array([2.5]), top_p=np.array([1.0]), min_p=np.array([0.0]))
