"""The pure-jnp definitions the tree-sampling kernels compute (their reference twins), on plain arrays:

  processed_probs_reference   logits -> the distribution a row samples from (temperature, top-k with
                              ties kept, top-p by the mass of strictly more probable tokens, min-p)
  walk_reference              target-only tree rejection sampling over processed probabilities, one
                              node test per iteration, coin for coin (vmapped over rows)
  inverse_cdf                 the final-sample rule every sampler shares
  walk_array_arguments,       the walk's arguments as arrays and static Python scalars (conversions,
  walk_static_arguments       no checks; the kernels of `tree_sampling` convert theirs with these)

Definitions, in threshold form (the sort-based reference and the threshold-search kernel select the
same sets):

  p = softmax(logits / T); T == 0: one-hot on the argmax, ties to the lowest token id
  top-k (0 or >= V: off):  keep i iff p_i >= the k-th largest p (ties at the cut kept); renormalise
  top-p (1: off):          keep i iff sum of p_j over p_j > p_i is < top_p; renormalise
  min-p (0: off):          keep i iff p_i >= min_p * max_j p_j; renormalise

Invalid rows (a NaN or +inf logit, or every logit -inf; or settings out of range, `valid_params`, which
only a traced caller can pass) have no distribution: they come out all zero, `valid_rows` / `valid_params`
flag them, and callers emit an invalid token for them. -inf logits are otherwise fine.

The walk (one row; the library's `ddtree_jax.verify.verify_sampling` is this under vmap, plus checks):
starting at the root, the children of the current node are tested in verification order; child c is
accepted when coin[node] < (running mass of the tested children's target probability) / threshold_acc,
or when its probability >= threshold_single (1.0 / 1.0: exact); a rejected child's token is excluded
from the final sample; an accepted child becomes the current node and resets the running mass. After
max_accept acceptances, or when no child is accepted, one final token is drawn from the current node's
distribution with the rejected tokens removed (`inverse_cdf` with the final coin).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def valid_rows(logits: jax.Array) -> jax.Array:
    """bool [...]: no NaN / +inf entry and at least one finite entry along the last axis."""
    x = logits.astype(jnp.float32)
    return (~jnp.isnan(x) & (x != jnp.inf)).all(axis=-1) & (x > -jnp.inf).any(axis=-1)


def valid_params(temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """bool [B]: the row's settings are in range: temperature finite and >= 0, top_k >= 0, top_p in (0, 1],
    min_p in [0, 1) (the library's `SamplingParams.validate` raises on the others when it can read them; under
    jit, where nothing can raise, such rows are invalid rows, like rows of invalid logits)."""
    temperature, top_p, min_p = (jnp.asarray(v, jnp.float32) for v in (temperature, top_p, min_p))
    finite = jnp.isfinite(temperature) & jnp.isfinite(top_p) & jnp.isfinite(min_p)
    in_range = (temperature >= 0) & (jnp.asarray(top_k) >= 0) & (top_p > 0) & (top_p <= 1) & (min_p >= 0) & (min_p < 1)
    return finite & in_range


def _per_row(values: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] broadcastable against logits [B, ..., V]."""
    return values.reshape(values.shape + (1,) * (ndim - 1))


def _renormalise(p: jax.Array) -> jax.Array:
    total = p.sum(axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def processed_probs_reference(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """float32 [B, ..., V] probabilities from logits [B, ..., V] (float32 or bfloat16) and per-row settings
    temperature f32 [B] (0: greedy), top_k int32 [B] (0: off), top_p f32 [B] (1: off), min_p f32 [B]
    (0: off): the module docstring's definitions, with a sort. Numerically safe at any temperature > 0
    (the max is subtracted before dividing by T). Rows of invalid logits (`valid_rows`) or out-of-range settings
    (`valid_params`) are all zeros."""
    x = logits.astype(jnp.float32)
    ndim, vocab = x.ndim, x.shape[-1]
    # the settings at the precision of the arithmetic below (as the fused kernels' `as_rows`): a float64
    # temperature of 1e-50 is > 0 but divides as float32 zero, which made the row all NaN, then all zeros
    temperature, top_p, min_p = (jnp.asarray(v, jnp.float32) for v in (temperature, top_p, min_p))
    top_k = jnp.asarray(top_k).astype(jnp.int32)
    params_ok = _per_row(valid_params(temperature, top_k, top_p, min_p), ndim - 1)
    temperature = _per_row(temperature, ndim)
    top_k = _per_row(top_k, ndim)
    top_p = _per_row(top_p, ndim)
    min_p = _per_row(min_p, ndim)
    valid = (valid_rows(x) & params_ok)[..., None]
    x = jnp.where(valid, x, 0.0)  # keep the arithmetic finite; invalid rows are zeroed at the end

    greedy = temperature == 0
    shifted = x - x.max(axis=-1, keepdims=True)  # <= 0, max exactly 0 (-inf stays -inf)
    p = _renormalise(jnp.exp(shifted / jnp.where(greedy, 1.0, temperature)))

    top_k_on = (top_k > 0) & (top_k < vocab)
    top_p_on = top_p < 1.0

    def filter_by_rank(p):
        s = -jnp.sort(-p, axis=-1)  # descending
        kth = jnp.take_along_axis(s, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)
        keep_k = ~top_k_on | (p >= kth)
        total_k = jnp.where(keep_k, p, 0.0).sum(axis=-1, keepdims=True)
        p = jnp.where(keep_k, p, 0.0) / total_k
        # the same renormalised values, still in descending order
        s = jnp.where(~top_k_on | (s >= kth), s, 0.0) / total_k
        # mass strictly above each value: the exclusive cumsum at the first element of its tie group
        before = jnp.cumsum(s, axis=-1) - s
        group_start = jnp.concatenate([jnp.ones_like(s[..., :1], bool), s[..., 1:] != s[..., :-1]], axis=-1)
        above = lax.cummax(jnp.where(group_start, before, 0.0), axis=s.ndim - 1)
        kept = (above < top_p).sum(axis=-1, keepdims=True)  # a prefix of the sorted order, >= 1
        cut = jnp.take_along_axis(s, jnp.clip(kept - 1, 0, vocab - 1), axis=-1)
        keep_p = ~top_p_on | (p >= cut)
        return _renormalise(jnp.where(keep_p, p, 0.0))

    # the sort is only paid when some row of the batch uses top-k or top-p
    p = lax.cond(jnp.any(top_k_on | top_p_on), filter_by_rank, lambda p: p, p)
    p = _renormalise(jnp.where(p >= min_p * p.max(axis=-1, keepdims=True), p, 0.0))

    one_hot = jax.nn.one_hot(jnp.argmax(x, axis=-1), vocab, dtype=jnp.float32)  # ties -> lowest id
    p = jnp.where(greedy, one_hot, p)
    return jnp.where(valid, p, 0.0)


def inverse_cdf(weights: jax.Array, coin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The spec's final-sample rule over unnormalised weights [..., V] (>= 0) and coins [...].

    u = coin * sum(weights); token = the first i (vocab order) with weights[i] > 0 and
    cumsum(weights)[i] > u; if none, the last i with weights[i] > 0.
    Returns (token int32 [...], has_mass bool [...]); where has_mass is False the caller applies its
    own fallback (the verifier: last rejected token, else V - 1).
    """
    vocab = weights.shape[-1]
    cdf = jnp.cumsum(weights, axis=-1)
    u = coin[..., None] * cdf[..., -1:]
    positive = weights > 0
    hit = positive & (cdf > u)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    first_hit = jnp.min(jnp.where(hit, ids, vocab), axis=-1)
    last_positive = jnp.max(jnp.where(positive, ids, -1), axis=-1)
    token = jnp.where(first_hit < vocab, first_hit, last_positive)
    return token.astype(jnp.int32), last_positive >= 0


def emitted_tokens(candidates: jax.Array, accept: jax.Array, num_accepted: jax.Array, final: jax.Array) -> jax.Array:
    """One row's `tokens` [S]: candidates of accept[1..n], then `final`, then -1.

    candidates [N]; accept [S] (accept[0] = 0, -1 after the end); num_accepted and final: scalars.
    """
    steps = accept.shape[0]
    positions = jnp.arange(steps)
    accepted_tokens = candidates[jnp.maximum(accept, 0)]
    tokens = jnp.where(positions < num_accepted, accepted_tokens[jnp.minimum(positions + 1, steps - 1)], -1)
    return jnp.where(positions == num_accepted, final, tokens).astype(jnp.int32)


def _walk_row(
    candidates, next_token, next_sibling, probs, coins, final_coin, *, max_accept, threshold_single, threshold_acc
):
    """One row. candidates/next_token/next_sibling/coins [N], probs [N, V], final_coin []."""
    slots, vocab = probs.shape
    steps = max_accept + 1

    def body(_, state):
        cur, row, prob_acc, n_acc, done, accept, excluded, last_rejected = state
        active = ~done & (cur >= 0)
        node = jnp.maximum(cur, 0)
        tok = candidates[node]
        p = probs[row, tok]
        acc = prob_acc + p
        take = active & (p > 0) & ((coins[row] < acc / max(threshold_acc, 1e-9)) | (p >= threshold_single))
        reject = active & ~take
        n_acc = n_acc + take
        accept = jnp.where(take, accept.at[n_acc].set(node), accept)
        excluded = jnp.where(reject, excluded.at[node].set(True), jnp.where(take, False, excluded))
        last_rejected = jnp.where(take, -1, jnp.where(reject & (p > 0), tok, last_rejected))
        prob_acc = jnp.where(take, 0.0, jnp.where(reject, acc, prob_acc))
        new_row = jnp.where(take, node, row)
        done = done | (~done & (cur < 0)) | (take & (n_acc == steps - 1))
        cur = jnp.where(take, next_token[node], jnp.where(reject, next_sibling[node], cur))
        return cur, new_row, prob_acc, n_acc, done, accept, excluded, last_rejected

    init = (
        next_token[0],
        jnp.int32(0),
        jnp.float32(0.0),
        jnp.int32(0),
        jnp.bool_(steps == 1),
        jnp.full((steps,), -1, jnp.int32).at[0].set(0),
        jnp.zeros((slots,), bool),
        jnp.int32(-1),
    )
    # every iteration tests one node or ends the walk: N + 1 iterations always suffice
    _, row, _, n_acc, _, accept, excluded, last_rejected = lax.fori_loop(0, slots + 1, body, init)

    residual = probs[row]
    if steps > 1:  # a bonus sample (all steps accepted) excludes nothing
        drop = jnp.where(excluded & (n_acc < steps - 1), candidates, vocab)
        residual = residual.at[drop].set(0.0, mode="drop")
    final, has_mass = inverse_cdf(residual, final_coin)
    final = jnp.where(has_mass, final, jnp.where(last_rejected >= 0, last_rejected, vocab - 1))

    return accept, n_acc, emitted_tokens(candidates, accept, n_acc, final)


def walk_array_arguments(candidates, next_token, next_sibling, coins, final_coins):
    """The walk's arrays as `walk_reference` and the kernels take them (a conversion, no checks): ((candidates,
    next_token, next_sibling) int32 [B, N], coins f32 [B, N], final_coins f32 [B])."""
    lists = tuple(jnp.asarray(a, jnp.int32) for a in (candidates, next_token, next_sibling))
    return lists, jnp.asarray(coins, jnp.float32), jnp.asarray(final_coins, jnp.float32)


def walk_static_arguments(max_accept, threshold_single, threshold_acc) -> dict:
    """The walk's static keywords as Python scalars (jit cache keys; no checks): {max_accept: int,
    threshold_single: float, threshold_acc: float}."""
    return dict(
        max_accept=int(max_accept), threshold_single=float(threshold_single), threshold_acc=float(threshold_acc)
    )


def walk_reference(
    candidates,
    next_token,
    next_sibling,
    target_probs,
    coins,
    final_coins,
    *,
    max_accept: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
):
    """The walk over every row (module docstring).

    candidates / next_token / next_sibling int32 [B, N] (slot 0 = root; first child / next sibling in
    verification order, -1 = none); target_probs f32 [B, N, V]; coins f32 [B, N]; final_coins f32 [B];
    max_accept and thresholds (static). Array-likes of other dtypes are converted (`walk_array_arguments`).
    Returns (accept_index int32 [B, S], num_accepted int32 [B], tokens int32 [B, S]) with S = max_accept + 1.
    """
    lists, coins, final_coins = walk_array_arguments(candidates, next_token, next_sibling, coins, final_coins)
    statics = walk_static_arguments(max_accept, threshold_single, threshold_acc)
    return _walk_rows(*lists, jnp.asarray(target_probs, jnp.float32), coins, final_coins, **statics)


@functools.partial(jax.jit, static_argnames=("max_accept", "threshold_single", "threshold_acc"))
def _walk_rows(candidates, next_token, next_sibling, target_probs, coins, final_coins, **walk_statics):
    """`walk_reference` on converted arrays: `_walk_row` vmapped over the rows; walk_statics: max_accept (int),
    threshold_single and threshold_acc (float)."""
    return jax.vmap(functools.partial(_walk_row, **walk_statics))(
        candidates, next_token, next_sibling, target_probs, coins, final_coins
    )
