"""Exactness of tree verification at temperature T on a Markov-chain target (V = 6, L = 3).

The joint law of the first three emitted tokens over many independent chains (each running three
DDTree steps) is compared with the exact law by enumeration; chi-square at ALPHA = 1e-3 (see
tests/stats_helpers.py). Fixed seeds make every verdict deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams, row_keys
from ddtree_jax.tree import build_tree
from ddtree_jax.verify import verify_step
from ddtree_jax.verify.markov import exact_law, expected_accepted, simulate, transition_probs
from tests.stats_helpers import ALPHA, chi_square_pvalue

VOCAB, DEPTH, BUDGET, ROOT, SAMPLES = 6, 3, 10, 2, 100_000
_rng = np.random.default_rng(0)
TRANSITION = jnp.asarray(_rng.standard_normal((VOCAB, VOCAB)) * 1.5, jnp.float32)
# a drafter correlated with the target, so that trees are accepted often and deep
DRAFT = jnp.asarray(np.asarray(TRANSITION)[:, None, :] * 0.7 + _rng.standard_normal((VOCAB, DEPTH, VOCAB)), jnp.float32)

SETTINGS = {
    "T1": dict(temperature=1.0),
    "T0.7-topk3": dict(temperature=0.7, top_k=3),
    "T1.5-topp0.8-minp0.05": dict(temperature=1.5, top_p=0.8, min_p=0.05),
}


def _run(setting, order="draft", verifier="sampling", seed=1, **thresholds):
    params = SamplingParams.create(SAMPLES, **SETTINGS[setting])
    emitted, accepted = simulate(
        TRANSITION,
        DRAFT,
        params,
        jnp.full((SAMPLES,), ROOT, jnp.int32),
        jax.random.key(seed),
        budget=BUDGET,
        num_steps=3,
        order=order,
        verifier=verifier,
        **thresholds,
    )
    probs = transition_probs(TRANSITION, SamplingParams.create(1, **SETTINGS[setting]))
    return np.asarray(emitted), np.asarray(accepted), probs


def _law_pvalue(emitted, probs):
    counts = np.zeros((VOCAB,) * 3)
    np.add.at(counts, (emitted[:, 0], emitted[:, 1], emitted[:, 2]), 1)
    return chi_square_pvalue(counts, exact_law(probs, ROOT, 3))


def _first_tree():
    return build_tree(DRAFT[ROOT][None], BUDGET, jnp.array([ROOT], jnp.int32))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_emitted_law_is_the_target_law(setting):
    emitted, accepted, probs = _run(setting)
    assert (emitted[:, :3] >= 0).all()  # three steps always emit at least three tokens
    assert _law_pvalue(emitted, probs) > ALPHA
    assert accepted.mean() > 0.3  # the trees are really used, not rejected at the root


# a path-conditioned drafter for the same target: a depth-d node holding t proposes from its own row, correlated
# with the target's transition out of t (so its trees follow the target more closely than the marginal ones)
CONDITIONAL = jnp.asarray(
    np.asarray(TRANSITION)[None] * 0.9 + _rng.standard_normal((DEPTH - 1, VOCAB, VOCAB)) * 0.5, jnp.float32
)


@pytest.mark.parametrize("setting", ["T1.5-topp0.8-minp0.05"])
def test_emitted_law_on_path_conditioned_trees_is_the_target_law(setting):
    """Verification is tree-agnostic: on path-conditioned trees (`tree.conditional`) the emitted law is the
    target's too (chi-square at ALPHA), and the trees are used."""
    params = SamplingParams.create(SAMPLES, **SETTINGS[setting])
    emitted, accepted = simulate(
        TRANSITION,
        DRAFT,
        params,
        jnp.full((SAMPLES,), ROOT, jnp.int32),
        jax.random.key(7),
        budget=BUDGET,
        num_steps=3,
        conditional_table=CONDITIONAL,
    )
    probs = transition_probs(TRANSITION, SamplingParams.create(1, **SETTINGS[setting]))
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    assert (emitted[:, :3] >= 0).all()
    assert _law_pvalue(emitted, probs) > ALPHA
    assert accepted.mean() > 0.3


@pytest.mark.slow
@pytest.mark.parametrize("order", ["reverse", "random"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_law_is_order_invariant(setting, order):
    emitted, _, probs = _run(setting, order=order, seed=2)
    assert _law_pvalue(emitted, probs) > ALPHA


@pytest.mark.parametrize("order", ["draft", "reverse", "random"])
def test_expected_acceptance_matches_the_analytic_sum_for_every_order(order):
    emitted, accepted, probs = _run("T1", order=order, seed=3)
    analytic = expected_accepted(_first_tree(), 0, probs)
    first = accepted[:, 0]  # every chain's first step verifies the same tree
    stderr = first.std() / np.sqrt(len(first))
    assert abs(first.mean() - analytic) < 4.5 * stderr, (first.mean(), analytic, stderr)  # |z| > 4.5: p ~ 7e-6


def test_sample_then_walk_has_the_same_law():
    emitted, accepted, probs = _run("T0.7-topk3", verifier="sample_then_walk", seed=4)
    assert _law_pvalue(emitted, probs) > ALPHA
    analytic = expected_accepted(_first_tree(), 0, probs)
    assert abs(accepted[:, 0].mean() - analytic) < 4.5 * accepted[:, 0].std() / np.sqrt(SAMPLES)


def test_lossy_thresholds_are_biased_and_order_dependent():
    """The same tests reject the lossy mode: the law moves, and the sibling order now matters."""
    draft_em, draft_acc, probs = _run("T1", order="draft", seed=5, threshold_acc=0.5)
    rev_em, rev_acc, _ = _run("T1", order="reverse", seed=5, threshold_acc=0.5)
    assert _law_pvalue(draft_em, probs) < 1e-6
    gap = draft_acc[:, 0].mean() - rev_acc[:, 0].mean()
    stderr = np.hypot(draft_acc[:, 0].std(), rev_acc[:, 0].std()) / np.sqrt(SAMPLES)
    assert abs(gap) > 6 * stderr, (gap, stderr)


def test_filters_are_never_violated():
    for setting in ("T0.7-topk3", "T1.5-topp0.8-minp0.05"):
        emitted, _, probs = _run(setting, seed=6)
        prev = np.concatenate([np.full((SAMPLES, 1), ROOT), emitted[:, :-1]], axis=1)
        real = emitted >= 0
        assert (probs[prev[real], emitted[real]] > 0).all()


def test_greedy_rows_reproduce_autoregressive_greedy():
    params = SamplingParams.create(64, temperature=0.0)
    roots = jnp.arange(64, dtype=jnp.int32) % VOCAB
    emitted, _ = simulate(TRANSITION, DRAFT, params, roots, jax.random.key(7), budget=BUDGET, num_steps=3)
    emitted = np.asarray(emitted)
    argmax = np.asarray(jnp.argmax(TRANSITION, axis=-1))
    for b in range(64):
        tok = int(roots[b])
        for j in range(3):
            tok = argmax[tok]
            assert emitted[b, j] == tok


def test_verify_step_rows_are_independent_keyed_and_flag_invalid_rows():
    rng = np.random.default_rng(8)
    roots = jnp.asarray(rng.integers(0, VOCAB, 8), jnp.int32)
    tree = build_tree(DRAFT[roots], BUDGET, roots)
    logits = TRANSITION[tree.tokens]
    params = SamplingParams.create(8, temperature=[0.0, 1.0] * 4, top_k=[0, 0, 3, 3] * 2)
    keys = row_keys(jax.random.key(9), jnp.arange(8))
    a = verify_step(tree, logits, params, keys, order="random")
    sub = jax.tree.map(lambda x: x[3:6], tree)
    c = verify_step(sub, logits[3:6], jax.tree.map(lambda x: x[3:6], params), keys[3:6], order="random")
    for name in ("accept_index", "num_accepted", "tokens"):  # a row's result depends on its own inputs only
        np.testing.assert_array_equal(np.asarray(getattr(a, name))[3:6], np.asarray(getattr(c, name)))
    # the keys decide the sampled rows' tokens, never the greedy rows'
    other = verify_step(tree, logits, params, row_keys(jax.random.key(10), jnp.arange(8)), order="random")
    greedy = np.asarray(params.temperature) == 0
    np.testing.assert_array_equal(np.asarray(a.tokens)[greedy], np.asarray(other.tokens)[greedy])
    assert (np.asarray(a.tokens)[~greedy] != np.asarray(other.tokens)[~greedy]).any()
    bad = logits.at[5, 0, 1].set(jnp.nan)
    d = verify_step(tree, bad, params, keys)
    assert (np.asarray(d.tokens[5]) == INVALID_TOKEN).all() and int(d.num_accepted[5]) == 0
    np.testing.assert_array_equal(
        np.asarray(d.tokens[:5]), np.asarray(verify_step(tree, logits, params, keys).tokens[:5])
    )
    with pytest.raises(ValueError, match="verifier must be one of"):
        verify_step(tree, logits, params, keys, verifier="eagle")
    with pytest.raises(ValueError, match="no lossy thresholds"):
        verify_step(tree, logits, params, keys, verifier="sample_then_walk", threshold_acc=0.5)
