"""Target-only tree rejection sampling: `verify_sampling`, the walk of `ddtree_kernels.sampling_reference`
(one row at a time under vmap, a bounded loop over the nodes; its module docstring states the rule) with
the eager checks of the tree lists, or the fused Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import dispatch
from ddtree_jax.sharding.regions import rows, shard_call
from ddtree_jax.verify.result import VerifyResult
from ddtree_kernels.sampling_reference import walk_reference
from ddtree_kernels.tree_sampling import tree_sampling_from_probs


def check_tree_lists(candidates, next_token, next_sibling) -> None:
    """Eager checks of the tree lists (numpy; skipped for traced inputs).

    Raises ValueError on shape mismatches, indices out of [-1, N), and duplicate sibling tokens
    (duplicates would double-count target mass: a sibling's token would be tested twice).
    """
    if any(isinstance(a, jax.core.Tracer) for a in (candidates, next_token, next_sibling)):
        return
    cand, first, sib = (np.asarray(a) for a in (candidates, next_token, next_sibling))
    if not (cand.shape == first.shape == sib.shape) or cand.ndim != 2:
        raise ValueError(
            f"candidates, next_token, next_sibling must share one shape [B, N]; got {cand.shape}, {first.shape}, {sib.shape}"
        )
    slots = cand.shape[1]
    for name, arr in (("next_token", first), ("next_sibling", sib)):
        if ((arr < -1) | (arr >= slots)).any():
            b, i = np.argwhere((arr < -1) | (arr >= slots))[0]
            raise ValueError(f"{name}[{b}, {i}] = {arr[b, i]} is not a slot index in [-1, {slots})")
    for b in range(cand.shape[0]):
        for parent in range(slots):
            seen: dict[int, int] = {}
            cur, steps = first[b, parent], 0
            while cur != -1 and steps <= slots:
                tok = int(cand[b, cur])
                if tok in seen:
                    raise ValueError(
                        f"row {b}: slots {seen[tok]} and {cur} are siblings (children of slot {parent}) "
                        f"with the same token {tok}"
                    )
                seen[tok] = int(cur)
                cur, steps = sib[b, cur], steps + 1


def _result(arrays) -> VerifyResult:
    accept_index, num_accepted, tokens = arrays
    return VerifyResult(accept_index=accept_index, num_accepted=num_accepted, tokens=tokens)


def verify_sampling(
    candidates: jax.Array,
    next_token: jax.Array,
    next_sibling: jax.Array,
    target_probs: jax.Array,
    coins: jax.Array,
    final_coins: jax.Array,
    *,
    max_accept: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    check: bool = True,
    impl: str = "xla",
) -> VerifyResult:
    """Target-only tree rejection sampling, exactly `walk_reference`'s walk (coin for coin).

    Args:
      candidates: int32 [B, N] token of each slot (slot 0 = root, its value unused).
      next_token, next_sibling: int32 [B, N] first child / next sibling in verification order, -1 = none.
      target_probs: float32 [B, N, V] processed target distribution at each slot (`processed_probs`).
      coins: float32 [B, N] in [tiny, 1 - 2^-24]; coin i decides among slot i's children.
      final_coins: float32 [B], the coin of the final (correction or bonus) sample.
      max_accept: static; at most this many draft tokens are accepted (the engine passes L).
      threshold_single, threshold_acc: 1.0 / 1.0 is exact; lower values are a LOSSY mode (biased,
        sibling-order dependent) kept for ablations.
      check: when inputs are concrete, validate the lists and reject duplicate sibling tokens
        (ValueError). Traced inputs skip the check: trees from `build_tree` have distinct siblings by
        construction (distinct top-K tokens).
      impl: "xla" (`ddtree_kernels.sampling_reference.walk_reference`), "pallas"
        (`ddtree_kernels.tree_sampling.tree_sampling_from_probs`, interpret mode off GPU) or "auto"
        (`dispatch.verify_impl`: pallas on GPU, else xla).

    Returns:
      VerifyResult with S = max_accept + 1.
    """
    if isinstance(max_accept, bool) or not isinstance(max_accept, (int, np.integer)) or max_accept < 0:
        raise ValueError(f"max_accept must be an integer >= 0, got {max_accept!r}")
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if target_probs.ndim != 3 or target_probs.shape[:2] != candidates.shape:
        raise ValueError(
            f"target_probs must have shape [B, N, V] with [B, N] = {tuple(candidates.shape)}, got {tuple(target_probs.shape)}"
        )
    if coins.shape != candidates.shape or final_coins.shape != candidates.shape[:1]:
        raise ValueError(
            f"coins must be [B, N] and final_coins [B]; got {tuple(coins.shape)}, {tuple(final_coins.shape)}"
        )
    if check:
        check_tree_lists(candidates, next_token, next_sibling)
    if dispatch.verify_impl(impl) == "pallas":
        kernel = functools.partial(
            tree_sampling_from_probs,
            max_accept=max_accept,
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
        )
        args = (candidates, next_token, next_sibling, target_probs, coins, final_coins)
        return _result(shard_call(kernel, args, (rows(2), rows(2), rows(2), rows(3), rows(2), rows(1)), rows(1)))
    return _result(
        walk_reference(
            jnp.asarray(candidates, jnp.int32),
            jnp.asarray(next_token, jnp.int32),
            jnp.asarray(next_sibling, jnp.int32),
            jnp.asarray(target_probs, jnp.float32),
            jnp.asarray(coins, jnp.float32),
            jnp.asarray(final_coins, jnp.float32),
            max_accept=int(max_accept),
            threshold_single=float(threshold_single),
            threshold_acc=float(threshold_acc),
        )
    )
