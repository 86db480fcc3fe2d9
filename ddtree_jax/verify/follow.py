"""The verifiers that follow one chosen token per row down the tree: the argmax walk (`verify_greedy`)
and the DDTree paper's sample-then-walk verifier (`verify_sample_then_walk`).

Both follow one chosen token per row down the tree: the argmax of the row (greedy), or an
independent sample from the row's processed distribution (sample-then-walk: exact, since each row's
token is a draw from that row's conditional; it uses one coin per node instead of coin buckets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax.verify.result import VerifyResult
from ddtree_jax.verify.sampling import check_tree_lists
from ddtree_kernels.sampling_reference import emitted_tokens, inverse_cdf


def _follow_row(candidates, next_token, next_sibling, chosen, *, max_accept):
    """One row: descend while some child's token equals the chosen token of the current row.
    candidates/next_token/next_sibling/chosen: int32 [N]."""
    slots = candidates.shape[0]
    steps = max_accept + 1

    def body(_, state):
        cur, row, n_acc, done, accept = state
        active = ~done & (cur >= 0)
        node = jnp.maximum(cur, 0)
        match = active & (candidates[node] == chosen[row])
        n_acc = n_acc + match
        accept = jnp.where(match, accept.at[n_acc].set(node), accept)
        done = done | (~done & (cur < 0)) | (match & (n_acc == steps - 1))
        cur = jnp.where(match, next_token[node], jnp.where(active, next_sibling[node], cur))
        return cur, jnp.where(match, node, row), n_acc, done, accept

    init = (
        next_token[0],
        jnp.int32(0),
        jnp.int32(0),
        jnp.bool_(steps == 1),
        jnp.full((steps,), -1, jnp.int32).at[0].set(0),
    )
    _, row, n_acc, _, accept = lax.fori_loop(0, slots + 1, body, init)
    return accept, n_acc, emitted_tokens(candidates, accept, n_acc, chosen[row])


@functools.partial(jax.jit, static_argnames=("max_accept",))
def _follow(candidates, next_token, next_sibling, chosen, *, max_accept):
    accept, n_acc, tokens = jax.vmap(functools.partial(_follow_row, max_accept=max_accept))(
        candidates, next_token, next_sibling, chosen
    )
    return VerifyResult(accept_index=accept, num_accepted=n_acc, tokens=tokens)


def _check_common(candidates, next_token, next_sibling, max_accept, check):
    if isinstance(max_accept, bool) or not isinstance(max_accept, (int, np.integer)) or max_accept < 0:
        raise ValueError(f"max_accept must be an integer >= 0, got {max_accept!r}")
    if check:
        check_tree_lists(candidates, next_token, next_sibling)


def verify_greedy(
    candidates, next_token, next_sibling, target_logits, *, max_accept: int, check: bool = True
) -> VerifyResult:
    """Greedy (T = 0) verification: follow the child whose token is the argmax of the row (ties to the
    lowest id), emit the argmax at the first row without such a child. Equals `verify_sampling` on
    one-hot targets. target_logits: [B, N, V] (any float dtype)."""
    _check_common(candidates, next_token, next_sibling, max_accept, check)
    chosen = jnp.argmax(jnp.asarray(target_logits), axis=-1).astype(jnp.int32)
    return _follow(
        jnp.asarray(candidates, jnp.int32),
        jnp.asarray(next_token, jnp.int32),
        jnp.asarray(next_sibling, jnp.int32),
        chosen,
        max_accept=int(max_accept),
    )


def verify_sample_then_walk(
    candidates, next_token, next_sibling, target_probs, coins, *, max_accept: int, check: bool = True
) -> VerifyResult:
    """The DDTree paper's verifier: sample every slot's row independently (coin i at slot i, the
    inverse-CDF rule), then follow the samples down the tree. Exact; same output law as
    `verify_sampling`, different coin-to-token map. target_probs [B, N, V], coins [B, N]."""
    _check_common(candidates, next_token, next_sibling, max_accept, check)
    probs = jnp.asarray(target_probs, jnp.float32)
    chosen, has_mass = inverse_cdf(probs, jnp.asarray(coins, jnp.float32))
    chosen = jnp.where(has_mass, chosen, probs.shape[-1] - 1)
    return _follow(
        jnp.asarray(candidates, jnp.int32),
        jnp.asarray(next_token, jnp.int32),
        jnp.asarray(next_sibling, jnp.int32),
        chosen,
        max_accept=int(max_accept),
    )
