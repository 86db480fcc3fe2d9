"""The studies' generation loop: the engine's output for the same keys and options, and the per-step
surrogate / exact expectation against direct computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.run import request_args
from ddtree_jax.sampling import SamplingParams, processed_probs
from ddtree_jax.tree import build_tree
from ddtree_jax.tree.render import surrogate_tau
from experiments import budget_sweep
from experiments.studies import (
    expected_tau_exact,
    load_study_pair,
    pair_dirs,
    step_records,
    study_generate,
    surrogate_tau_jnp,
)


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_study_pair(*pair_dirs(tiny_pair_dir))


def _tree(seed=0, batch=3, depth=4, vocab=12, budget=9):
    logits = jax.random.normal(jax.random.key(seed), (batch, depth, vocab)) * 2.0
    return build_tree(logits, budget, jnp.arange(batch, dtype=jnp.int32))


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_study_generate_runs_the_engine_with_its_options(pair, order):
    """Another order and lossy thresholds go through DecodeOptions to the engine's own loop: the tokens are
    generate_recorded's (itself generate's loop) for the same options."""
    from ddtree_jax.engine.generate import generate_recorded
    from ddtree_jax.options import DecodeOptions
    from experiments.studies import step_record

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    res = study_generate(
        pair,
        prompts,
        method="ddtree",
        budget=6,
        max_new_tokens=6,
        temperature=1.0,
        seed=1,
        order=order,
        threshold_acc=0.5,
        threshold_single=0.3,
    )
    args = request_args(pair, prompts, temperature=1.0, seed=1, max_new_tokens=6)
    options = DecodeOptions(order=order, threshold_acc=0.5, threshold_single=0.3)
    want, records = generate_recorded(
        *args,
        recorder=step_record,
        max_new_tokens=6,
        method="ddtree",
        budget=6,
        block_size=pair.drafter.max_block_size,
        options=options,
    )
    np.testing.assert_array_equal(res["tokens"], np.asarray(want.tokens))
    plain = generate(
        *args, max_new_tokens=6, method="ddtree", budget=6, block_size=pair.drafter.max_block_size, options=options
    )
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(want.tokens))  # recording changes nothing
    active = np.asarray(records["active"])
    np.testing.assert_array_equal(active.sum(axis=0), np.asarray(want.steps))


def test_surrogate_and_exact_expectation_match_direct_computations():
    tree = _tree(seed=5)
    np.testing.assert_allclose(np.asarray(surrogate_tau_jnp(tree)), surrogate_tau(tree), rtol=1e-5)
    logits = jax.random.normal(jax.random.key(6), (3, tree.num_slots, 12)) * 1.5
    sampling = SamplingParams.create(3, temperature=[0.0, 0.7, 1.0])
    got = np.asarray(expected_tau_exact(tree, logits, sampling))
    probs = np.asarray(processed_probs(logits, sampling), np.float64)
    parents, tokens, n = np.asarray(tree.parents), np.asarray(tree.tokens), np.asarray(tree.num_nodes)
    for b in range(3):
        total = 1.0
        for v in range(1, n[b]):  # the path product, walked up to the root
            prod, node = 1.0, v
            while node > 0:
                prod *= probs[b, parents[b, node], tokens[b, node]]
                node = parents[b, node]
            total += prod
        assert got[b] == pytest.approx(total, rel=1e-5)
    # greedy row: 1 + the length of the greedy path inside the tree
    greedy, node = 1, 0
    while True:
        kids = [v for v in range(1, n[0]) if parents[0, v] == node and tokens[0, v] == probs[0, node].argmax()]
        if not kids:
            break
        node, greedy = kids[0], greedy + 1
    assert got[0] == pytest.approx(greedy)


def test_study_generate_emits_what_the_engine_emits(pair, tiny_pair_dir):
    """Exact thresholds, draft order: the same tokens and tau as engine.generate for the same request keys (in the
    budget sweep's small shapes, so the study program is the one the sweep tests compile)."""
    s = budget_sweep.SMALL
    from experiments.held_out_prompts import load_prompts

    prompts = [
        p["ids"]
        for p in load_prompts(
            tiny_pair_dir, pair.tokenizer, n=s["num_prompts"], length=s["prompt_len"], min_continuation=s["max_new"]
        )
    ] * s["samples"]
    stop = [pair.tokenizer.eos_token_id]
    budget = s["budgets"][0]
    res = study_generate(
        pair,
        prompts,
        method="ddtree",
        budget=budget,
        max_new_tokens=s["max_new"],
        temperature=1.0,
        seed=0,
        stop_tokens=stop,
    )
    args = request_args(pair, prompts, temperature=1.0, seed=0, stop_tokens=stop, max_new_tokens=s["max_new"])
    want = generate(
        *args, max_new_tokens=s["max_new"], method="ddtree", budget=budget, block_size=pair.drafter.max_block_size
    )
    np.testing.assert_array_equal(res["tokens"], np.asarray(want.tokens))
    np.testing.assert_array_equal(res["steps"], np.asarray(want.steps))
    np.testing.assert_allclose(res["tau"], np.asarray(want.tau), rtol=1e-6)
    rec = step_records(res)
    assert len(rec["measured"]) == res["steps"].sum()
    assert (rec["measured"] >= 1).all() and (rec["surrogate"] >= 1).all() and (rec["expected"] >= 1).all()
    assert (rec["surrogate"] <= budget + 1).all() and (rec["measured"] <= pair.drafter.max_block_size).all()


def test_study_generate_checks_its_arguments(pair):
    with pytest.raises(ValueError, match="order"):
        study_generate(pair, [[1, 2, 3]], max_new_tokens=4, temperature=1.0, order="sideways")
    with pytest.raises(ValueError, match="thresholds"):
        study_generate(pair, [[1, 2, 3]], max_new_tokens=4, temperature=1.0, threshold_acc=0.0)
    with pytest.raises(ValueError, match="row_max_new"):
        study_generate(pair, [[1, 2, 3]], max_new_tokens=4, temperature=1.0, row_max_new=5)
    with pytest.raises(ValueError, match="budget"):
        study_generate(pair, [[1, 2, 3]], max_new_tokens=4, temperature=1.0, budget=0)
