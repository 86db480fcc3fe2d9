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

from ddtree_jax.sampling.probs import valid_rows
from ddtree_jax.verify.result import VerifyResult, invalid_rows_masked
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
    one-hot targets. target_logits: [B, N, V] (any float dtype).

    Invalid logits (NaN, +inf, all -inf: `valid_rows`) at a slot the walk reads (the root or an accepted node)
    make the row invalid (num_accepted 0, tokens INVALID_TOKEN: argmax would take a NaN for the largest value and
    give a plausible token); `verify_step` judges every real slot instead, this walk only the slots it reads. Eagerly, with `check`, such a slot raises ValueError;
    so does a target_logits shape other than [B, N, V]."""
    _check_common(candidates, next_token, next_sibling, max_accept, check)
    target_logits = jnp.asarray(target_logits)
    if target_logits.ndim != 3 or target_logits.shape[:2] != jnp.shape(candidates):
        raise ValueError(
            f"target_logits must be [B, N, V] with [B, N] = {tuple(jnp.shape(candidates))}, got "
            f"{tuple(target_logits.shape)}"
        )
    chosen = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    result = _follow(
        jnp.asarray(candidates, jnp.int32),
        jnp.asarray(next_token, jnp.int32),
        jnp.asarray(next_sibling, jnp.int32),
        chosen,
        max_accept=int(max_accept),
    )
    read_ok = _read_slots_valid(result.accept_index, valid_rows(target_logits))
    if check and not isinstance(read_ok, jax.core.Tracer) and not bool(np.asarray(read_ok).all()):
        row = int(np.argmin(np.asarray(read_ok)))
        raise ValueError(f"target_logits row {row}: a slot the walk reads holds NaN or +inf, or is entirely -inf")
    return invalid_rows_masked(result, read_ok)


def _read_slots_valid(accept_index: jax.Array, slot_valid: jax.Array) -> jax.Array:
    """bool [B]: every slot the walk read (accept_index's entries >= 0: the root and the accepted nodes, whose
    rows chose the next token) is valid in slot_valid bool [B, N]."""
    read = jnp.take_along_axis(slot_valid, jnp.maximum(accept_index, 0), axis=1)
    return (read | (accept_index < 0)).all(axis=1)


def verify_sample_then_walk(
    candidates, next_token, next_sibling, target_probs, coins, *, max_accept: int, check: bool = True
) -> VerifyResult:
    """The DDTree paper's verifier: sample every slot's row independently (coin i at slot i, the
    inverse-CDF rule), then follow the samples down the tree. Exact; same output law as
    `verify_sampling`, different coin-to-token map. target_probs [B, N, V], coins [B, N] (ValueError
    otherwise). The probabilities are taken as given (`processed_probs`' rows): `verify_step` is what marks rows
    of invalid logits or settings invalid."""
    _check_common(candidates, next_token, next_sibling, max_accept, check)
    probs = jnp.asarray(target_probs, jnp.float32)
    shape = tuple(jnp.shape(candidates))
    if probs.ndim != 3 or probs.shape[:2] != shape or tuple(jnp.shape(coins)) != shape:
        raise ValueError(
            f"target_probs must be [B, N, V] and coins [B, N] with [B, N] = {shape}, got {tuple(probs.shape)} and "
            f"{tuple(jnp.shape(coins))}"
        )
    chosen, has_mass = inverse_cdf(probs, jnp.asarray(coins, jnp.float32))
    chosen = jnp.where(has_mass, chosen, probs.shape[-1] - 1)
    return _follow(
        jnp.asarray(candidates, jnp.int32),
        jnp.asarray(next_token, jnp.int32),
        jnp.asarray(next_sibling, jnp.int32),
        chosen,
        max_accept=int(max_accept),
    )
