"""A Markov-chain target for law tests and the sampling-correctness experiment.

The target's next-token distribution depends only on the last token: row t of `transition_logits`
[V, V]. So the exact law of the next tokens is a product of processed rows, computable by
enumeration for small V, and a tree slot's target logits are the row of the slot's token. The
drafter is a fixed table `draft_table` [V, L, V]: the per-depth draft logits given the root token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.sampling.coins import row_keys
from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import processed_probs
from ddtree_jax.tree.build import build_tree
from ddtree_jax.tree.conditional import build_conditional_tree, table_child_logits
from ddtree_jax.tree.draft_tree import DraftTree
from ddtree_jax.verify.step import verify_step


def transition_probs(transition_logits, params_row: SamplingParams) -> np.ndarray:
    """float64 [V, V]: the processed next-token distribution after each token, for one params row."""
    vocab = transition_logits.shape[0]
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (vocab,)), params_row)
    return np.asarray(processed_probs(jnp.asarray(transition_logits, jnp.float32), params), np.float64)


def exact_law(probs: np.ndarray, root: int, length: int) -> np.ndarray:
    """float64 [V] * length: P(y_1..y_length | root) under the chain `probs` [V, V]."""
    law = probs[root]
    for _ in range(length - 1):
        law = law[..., None] * probs[np.arange(probs.shape[0])].reshape((1,) * (law.ndim - 1) + probs.shape)
    return law


def expected_accepted(tree: DraftTree, b: int, probs: np.ndarray) -> float:
    """Analytic E[num_accepted] of exact verification: sum over non-root nodes v of the product over
    the path of q(token_u | parent's token) (the probability of a node's token under its parent's target distribution). Requires max_accept >= the tree depth."""
    tokens, parents = np.asarray(tree.tokens[b]), np.asarray(tree.parents[b])
    reach = np.zeros(len(tokens))
    reach[0] = 1.0
    for i in range(1, int(tree.num_nodes[b])):
        p = parents[i]
        reach[i] = reach[p] * probs[tokens[p], tokens[i]]
    return float(reach[1:].sum())


@functools.partial(
    jax.jit, static_argnames=("budget", "num_steps", "order", "verifier", "threshold_single", "threshold_acc", "impl")
)
def simulate(
    transition_logits: jax.Array,
    draft_table: jax.Array,
    params: SamplingParams,
    roots: jax.Array,
    key: jax.Array,
    *,
    budget: int,
    num_steps: int,
    order: str = "draft",
    verifier: str = "sampling",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    impl: str = "xla",
    conditional_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs `num_steps` DDTree steps for every row (one independent chain per row).

    Args:
      transition_logits: [V, V]; draft_table: [V, L, V]; params: [S]; roots: int32 [S]; key: typed key.
      impl: verification implementation, passed to `verify_step` ("xla", "pallas", "auto").
      conditional_table: None (DDTree's marginal trees: depth d's children from draft_table[root, d - 1]), or
        float [L - 1, V, V] for path-conditioned trees (`tree.conditional`): the root's children from
        draft_table[root, 0], a depth-d node holding t gets its children from conditional_table[d - 1, t].
    Returns:
      (emitted int32 [S, num_steps * (L + 1)]: each row's tokens in order, -1-padded at the end;
       num_accepted int32 [S, num_steps]).
    """
    samples = roots.shape[0]
    depth = draft_table.shape[1]
    width = depth + 1
    emitted = jnp.full((samples, num_steps * width), -1, jnp.int32)
    written = jnp.zeros((samples,), jnp.int32)
    accepted = []
    cursor = jnp.arange(width)[None, :]
    for step in range(num_steps):
        if conditional_table is None:
            tree = build_tree(draft_table[roots], budget, roots, check_finite=False)
        else:
            tree = build_conditional_tree(
                draft_table[roots, 0], table_child_logits, conditional_table, budget, depth, roots
            )
        keys = row_keys(jax.random.fold_in(key, step), jnp.arange(samples))
        result = verify_step(
            tree,
            transition_logits[tree.tokens],
            params,
            keys,
            order=order,
            verifier=verifier,
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
            impl=impl,
        )
        n_out = result.num_accepted + 1
        target = jnp.where(cursor < n_out[:, None], written[:, None] + cursor, emitted.shape[1])
        emitted = emitted.at[jnp.arange(samples)[:, None], target].set(result.tokens, mode="drop")
        written = written + n_out
        roots = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
        accepted.append(result.num_accepted)
    return emitted, jnp.stack(accepted, axis=1)


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Goodness of fit of `counts` to `probs` (any shape, flattened; needs scipy, a dev dependency).

    Cells with expected counts under `min_expected` are pooled into one cell; a count in a
    zero-probability cell gives p = 0.
    """
    from scipy import stats

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
