"""Sub-budget trees (`tree.budget`): the budget-b tree is the first b + 1 slots of a larger budget's tree (both
builders), its surrogate is the prefix sum, its walk is the larger walk's prefix (coupled, T = 0 and T = 1), and
the budget choice maximises predicted tokens per ms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.options import BudgetPolicy, DecodeOptions, check_budgets
from ddtree_jax.sampling import SamplingParams, row_keys
from ddtree_jax.tree import build_conditional_tree, build_tree, table_child_logits
from ddtree_jax.tree.budget import (
    choose_budget_index,
    mask_tree,
    prefix_accepted,
    prefix_surrogates,
    truncate_tree,
)
from ddtree_jax.verify import verify_step

FIELDS = ("tokens", "parents", "depths", "ranks", "num_nodes")


def _assert_prefix(small, big, budget):
    for name in FIELDS:
        want = np.asarray(getattr(small, name))
        got = np.asarray(getattr(truncate_tree(big, budget), name))
        np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_allclose(np.asarray(truncate_tree(big, budget).logw), np.asarray(small.logw), rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_smaller_budget_tree_is_a_prefix_of_the_larger_one(impl):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 7, 60)) * 2.5, jnp.float32)
    roots = jnp.asarray([1, 2, 3], jnp.int32)
    big = build_tree(logits, 64, roots, impl=impl)
    for budget in (1, 5, 16, 33):
        _assert_prefix(build_tree(logits, budget, roots, impl=impl), big, budget)


def test_a_smaller_budget_conditional_tree_is_a_prefix_of_the_larger_one():
    rng = np.random.default_rng(1)
    depth, vocab = 5, 40
    first = jnp.asarray(rng.standard_normal((2, vocab)) * 2, jnp.float32)
    table = jnp.asarray(rng.standard_normal((depth - 1, 2, vocab, vocab)) * 3, jnp.float32)
    roots = jnp.asarray([4, 9], jnp.int32)
    big = build_conditional_tree(first, table_child_logits, table, 48, depth, roots)
    for budget in (3, 12, 30):
        _assert_prefix(build_conditional_tree(first, table_child_logits, table, budget, depth, roots), big, budget)


def test_prefix_surrogates_are_the_sub_trees_surrogates_and_mask_tree_pads_the_rest():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((2, 6, 30)) * 2, jnp.float32)
    big = build_tree(logits, 40, impl="xla")
    budgets = (4, 10, 40)
    got = np.asarray(prefix_surrogates(big, budgets))
    for k, b in enumerate(budgets):
        want = 1.0 + np.exp(np.asarray(build_tree(logits, b, impl="xla").logw)[:, 1:]).sum(axis=1)
        np.testing.assert_allclose(got[:, k], want, rtol=1e-5)
        masked = mask_tree(big, jnp.int32(b))
        np.testing.assert_array_equal(np.asarray(masked.parents)[:, b + 1 :], -1)
        assert np.isneginf(np.asarray(masked.logw)[:, b + 1 :]).all()
        np.testing.assert_array_equal(np.asarray(masked.tokens)[:, : b + 1], np.asarray(big.tokens)[:, : b + 1])
    with pytest.raises(ValueError, match="exceeds"):
        prefix_surrogates(big, (8, 41))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sub_tree_walk_is_the_prefix_of_the_larger_walk(temperature):
    """prefix_accepted from one walk on the budget-48 tree equals num_accepted of walks on each sub-tree with
    the same keys: exact at T = 0, coupled through the coins at T = 1."""
    rng = np.random.default_rng(3 + int(temperature))
    batch, depth, vocab, budget = 16, 6, 12, 48
    draft = jnp.asarray(rng.standard_normal((batch, depth, vocab)) * 2, jnp.float32)
    big = build_tree(draft, budget, jnp.zeros(batch, jnp.int32), impl="xla")
    target = jnp.asarray(rng.standard_normal((batch, budget + 1, vocab)) * 2, jnp.float32)
    params = SamplingParams.create(batch, temperature=temperature)
    keys = row_keys(jax.random.key(7), jnp.arange(batch))
    full = verify_step(big, target, params, keys)
    budgets = (2, 8, 20, 48)
    got = np.asarray(prefix_accepted(full.accept_index, full.num_accepted, budgets))
    for k, b in enumerate(budgets):
        sub = verify_step(truncate_tree(big, b), target[:, : b + 1], params, keys)
        np.testing.assert_array_equal(got[:, k], np.asarray(sub.num_accepted), err_msg=f"budget {b}")
    assert got[:, -1].max() >= 2  # the trees reach depth: a test that can fail


def test_the_budget_choice_maximises_predicted_tokens_per_ms():
    surrogates = jnp.asarray([[2.0, 3.0, 3.5], [1.5, 2.0, 2.2]], jnp.float32)
    active = jnp.asarray([True, True])
    # predicted tokens: [3.5, 5.0, 5.7] at scale 1; per ms at (1, 1.2, 2.0): 3.5, 4.17, 2.85
    assert int(choose_budget_index(surrogates, active, (1.0, 1.0, 1.0), (1.0, 1.2, 2.0))) == 1
    assert int(choose_budget_index(surrogates, active, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0))) == 2
    # a calibration that halves the excess of the large budgets makes the small one win
    assert int(choose_budget_index(surrogates, active, (1.0, 0.3, 0.3), (1.0, 1.0, 1.0))) == 0
    # inactive rows do not vote
    assert int(choose_budget_index(surrogates, jnp.asarray([False, False]), (1.0,) * 3, (1.0,) * 3)) == 0


def test_budget_sets_and_policies_name_their_bad_values():
    assert check_budgets([4, 8]) == (4, 8)
    for bad, match in (((), "at least one"), ((8, 4), "increasing"), ((0, 4), "ints >= 1"), ((2.0,), "ints")):
        with pytest.raises(ValueError, match=match):
            check_budgets(bad)
    with pytest.raises(ValueError, match="step_ms needs one value per budget"):
        BudgetPolicy((8, 16), (1.0,), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"scale must hold finite numbers > 0, got -1"):
        BudgetPolicy((8, 16), (1.0, 2.0), (1.0, -1))
    with pytest.raises(ValueError, match="budget_policy must be a BudgetPolicy"):
        DecodeOptions(budget_policy=(8, 16))
    assert BudgetPolicy((8, 16), (1, 2), (1, 1)).max_budget == 16
