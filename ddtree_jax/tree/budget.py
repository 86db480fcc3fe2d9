"""Sub-budget trees of one best-first tree, for the cost-aware budget (issue #23).

The best-first builders (`build_tree`, `build_conditional_tree`) emit slots in pop order, and the heap's pop
order does not depend on the budget (the key (-logw, ranks tuple) is; a budget only stops the pops). So the
tree of budget b is the first b + 1 slots of the tree of any budget B >= b (tests/tree/test_budget.py checks
it for both builders). One tree at the largest budget of a compiled set therefore gives, per row and for
every budget b of the set:

  prefix_surrogates   the drafter's surrogate acceptance of the budget-b tree, 1 + sum over its non-root
                      slots of exp(logw): what a cost-aware choice compares against each budget's step time
  truncate_tree       the budget-b tree itself (a static slice: N = b + 1 slots, the shapes of a b build)
  prefix_accepted     the draft tokens a verification of the budget-b tree accepts, coupled to the walk on the
                      larger tree: in draft order, the sub-tree's children of a node are a prefix of the larger
                      tree's, so with the same coins the sub-tree's walk makes the same decisions until the
                      path leaves the sub-tree; at T = 0 it is exact, at T > 0 a coupled sample with the right
                      law (the calibration of the surrogate uses it)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.options import check_budgets
from ddtree_jax.tree.draft_tree import DraftTree


def prefix_surrogates(tree: DraftTree, budgets) -> jax.Array:
    """float32 [B, K]: for each budget b of `budgets` (K of them, each <= tree.num_slots - 1), 1 + sum over
    slots 1 .. b of exp(logw) (padding slots have logw = -inf and add 0)."""
    budgets = check_budgets(budgets)
    if budgets[-1] > tree.num_slots - 1:
        raise ValueError(f"budget {budgets[-1]} exceeds the tree's {tree.num_slots - 1} draft slots")
    mass = jnp.cumsum(jnp.exp(tree.logw[:, 1:].astype(jnp.float32)), axis=1)  # [B, N - 1]
    return 1.0 + mass[:, jnp.asarray(budgets) - 1]


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The budget-`budget` tree: the first budget + 1 slots (parents precede children in pop order, so the
    slice is a tree); num_nodes clipped."""
    if not 1 <= budget <= tree.num_slots - 1:
        raise ValueError(f"budget must be in [1, {tree.num_slots - 1}], got {budget}")
    n = budget + 1
    return DraftTree(
        tokens=tree.tokens[:, :n],
        parents=tree.parents[:, :n],
        depths=tree.depths[:, :n],
        ranks=tree.ranks[:, :n],
        logw=tree.logw[:, :n],
        num_nodes=jnp.minimum(tree.num_nodes, n),
        max_depth=tree.max_depth,
    )


def mask_tree(tree: DraftTree, budget: jax.Array) -> DraftTree:
    """The budget-`budget` tree at the full shape: slots past budget (a traced int32 scalar or [B]) become
    padding. What a trace records when the step's budget was chosen on device."""
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), tree.num_nodes.shape)
    keep = jnp.arange(tree.num_slots)[None, :] <= budget[:, None]
    return DraftTree(
        tokens=jnp.where(keep, tree.tokens, 0),
        parents=jnp.where(keep, tree.parents, -1),
        depths=jnp.where(keep, tree.depths, 0),
        ranks=jnp.where(keep, tree.ranks, -1),
        logw=jnp.where(keep, tree.logw, -jnp.inf),
        num_nodes=jnp.minimum(tree.num_nodes, budget + 1),
        max_depth=tree.max_depth,
    )


def prefix_accepted(accept_index: jax.Array, num_accepted: jax.Array, budgets) -> jax.Array:
    """int32 [B, K]: draft tokens accepted on the budget-b sub-tree for each b (module docstring), from the
    walk on the larger tree: accept_index int32 [B, S] (slot 0 first, -1 after the end), num_accepted [B]."""
    budgets = jnp.asarray(check_budgets(budgets), jnp.int32)
    steps = jnp.arange(accept_index.shape[1])[None, :]
    on_path = (steps >= 1) & (steps <= num_accepted[:, None])  # [B, S]: the accepted draft slots
    # the path's slots increase along it (parents precede children), so "within budget b" is a prefix
    inside = on_path[:, :, None] & (accept_index[:, :, None] <= budgets[None, None, :])  # [B, S, K]
    return inside.sum(axis=1).astype(jnp.int32)


def choose_budget_index(surrogates: jax.Array, active: jax.Array, scale, step_ms) -> jax.Array:
    """int32 scalar: the index k of the budget with the most predicted tokens per second for the batch,
    argmax_k sum over active rows of (1 + scale[k] * (surrogates[:, k] - 1)) / step_ms[k].

    surrogates float32 [B, K] (`prefix_surrogates`); active bool [B]; scale, step_ms: K floats (the
    calibration of the surrogate's excess over 1 per budget, and the measured step time per budget). The
    batch shares one budget (one compiled branch per budget). Ties: the smaller budget. With no active row,
    every score is 0 and the smallest budget is chosen."""
    scale = jnp.asarray(scale, jnp.float32)
    step_ms = jnp.asarray(step_ms, jnp.float32)
    predicted = 1.0 + scale[None, :] * (surrogates - 1.0)  # [B, K] predicted tokens per step
    tokens = jnp.where(active[:, None], predicted, 0.0).sum(axis=0)  # [K]
    return jnp.argmax(tokens / step_ms).astype(jnp.int32)
