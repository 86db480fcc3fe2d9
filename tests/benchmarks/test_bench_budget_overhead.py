"""benchmarks/bench_budget_overhead.py: the forced policies pick their budget whatever the surrogates; the
variants are the docstring's (the timing itself runs on the GPU)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.bench_budget_overhead import forced_policy, variants
from ddtree_jax.tree.budget import choose_budget_index


@pytest.mark.parametrize("budgets, forced", [((16, 64), 64), ((16, 32, 64, 128), 64), ((16, 32, 64, 128), 16)])
def test_a_forced_policy_chooses_its_budget_on_any_surrogates(budgets, forced):
    policy = forced_policy(budgets, forced)
    for seed in range(5):
        # surrogates >= 1 and non-decreasing over budgets (the sub-trees are nested), some rows inactive
        steps = jax.random.uniform(jax.random.key(seed), (3, len(budgets)), maxval=4.0)
        surrogates = 1.0 + jnp.cumsum(steps, axis=1)
        active = jnp.array([True, seed % 2 == 0, True])
        index = choose_budget_index(surrogates, active, policy.scale, policy.step_ms)
        assert budgets[int(index)] == forced


def test_forced_policy_rejects_a_budget_outside_its_set():
    with pytest.raises(ValueError, match="forced budget 32 is not in"):
        forced_policy((16, 64), 32)


def test_variants_of_budget_64():
    found = [(name, budget, opts.budget_policy and opts.budget_policy.budgets) for name, budget, opts in variants(64)]
    assert found == [
        ("fixed", 64, None),
        ("policy 64", 64, (64,)),
        ("policy 16,64", 64, (16, 64)),
        ("policy 16,32,64,128", 128, (16, 32, 64, 128)),
        ("fixed 128", 128, None),
    ]
    with pytest.raises(ValueError, match="multiple of 4"):
        variants(30)
