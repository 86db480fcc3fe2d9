"""`verify_step`: processed_probs + verification order + coins + verification, for one DraftTree."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import dispatch
from ddtree_jax.options import VERIFIERS
from ddtree_jax.sampling.coins import draw_coins
from ddtree_jax.sampling.params import SamplingParams
from ddtree_jax.sampling.probs import processed_probs, valid_rows
from ddtree_jax.sharding.regions import rows, shard_call
from ddtree_jax.tree.draft_tree import DraftTree
from ddtree_jax.tree.structure import verification_order
from ddtree_jax.verify.follow import verify_sample_then_walk
from ddtree_jax.verify.result import VerifyResult, invalid_rows_masked
from ddtree_jax.verify.sampling import check_tree_lists, verify_sampling
from ddtree_kernels.tree_sampling import tree_sampling_from_logits


def verify_step(
    tree: DraftTree,
    target_logits: jax.Array,
    params: SamplingParams,
    keys: jax.Array,
    *,
    order: str = "draft",
    verifier: str = "sampling",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    impl: str = "xla",
) -> VerifyResult:
    """Verifies a batch of trees against the target's logits at their slots.

    Args:
      tree: DraftTree [B, N] (max_accept = tree.max_depth, so results are [B, L + 1]).
      target_logits: [B, N, V] float32/bfloat16, the target's logits at every slot.
      params: per-row SamplingParams [B]; greedy rows (T = 0) get one-hot targets, which makes the
        walk the argmax walk (equal to `verify_greedy`), so one batch mixes greedy and sampled rows.
      keys: typed PRNG keys [B], one per row and step (fold the request id and step in upstream);
        split into (sibling order, node coins, final coin).
      order: sibling order policy ("draft", "reverse", "random").
      verifier: "sampling" (coin buckets: `verify_sampling`) or "sample_then_walk" (the DDTree paper's
        verifier: `verify_sample_then_walk`; same law, another coin map); `options.VERIFIERS`.
      impl: "xla" (processed_probs + verify_sampling), "pallas" (the fused kernel of
        `ddtree_kernels.tree_sampling`: no [B, N, V] probabilities in HBM; interpret mode off GPU), or
        "auto" (`dispatch.verify_impl`). Same coins, same law; see the kernel's module docstring on
        rounding.

    Rows whose logits are invalid at a real slot (NaN, +inf, all -inf), whose settings are out of range
    (`SamplingParams.in_range`: only traced params can be), or whose draft tokens at real slots lie outside
    [0, V), return num_accepted 0 and tokens INVALID_TOKEN (-1) under tracing; when
    `tree.tokens` is concrete an out-of-vocabulary draft token raises ValueError instead. The root's
    token (slot 0) is never judged nor emitted and is not checked; padding slots are not checked.

    Raises:
      ValueError: on shape mismatches, target_logits not float32/bfloat16/float16, or (eagerly) a real
        draft slot's token outside [0, V) or two siblings with the same token (`check_tree_lists`).
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier must be one of {VERIFIERS}, got {verifier!r}")
    batch, slots = tree.tokens.shape
    if target_logits.shape[:2] != (batch, slots):
        raise ValueError(
            f"target_logits must be [B, N, V] with [B, N] = ({batch}, {slots}), got {tuple(target_logits.shape)}"
        )
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits must be [B, N, V], got shape {tuple(target_logits.shape)}")
    if jnp.dtype(target_logits.dtype) not in LOGIT_DTYPES:
        raise ValueError(f"target_logits must be float32, bfloat16 or float16, got dtype {target_logits.dtype}")
    vocab = target_logits.shape[2]
    check_tree_tokens(tree, vocab)
    if keys.shape != (batch,):
        raise ValueError(f"keys must be one typed PRNG key per row, shape ({batch},), got {keys.shape}")
    if verifier == "sample_then_walk" and (threshold_single, threshold_acc) != (1.0, 1.0):
        raise ValueError(
            f"the sample-then-walk verifier has no lossy thresholds, got threshold_single={threshold_single}, "
            f"threshold_acc={threshold_acc}"
        )
    impl = dispatch.verify_impl(impl)
    if impl == "pallas" and verifier != "sampling":
        raise ValueError(f"impl='pallas' implements verifier='sampling' only, got verifier={verifier!r}")
    split = jax.vmap(lambda k: jax.random.split(k, 3))(keys)  # [B, 3]
    next_token, next_sibling = verification_order(tree, order, split[:, 0])
    # eagerly (skipped when traced): duplicate sibling tokens would have a token's target mass tested twice
    check_tree_lists(tree.tokens, next_token, next_sibling)
    coins = draw_coins(split[:, 1], (slots,))
    if impl == "pallas":
        # per shard on a mesh: rows over "data"; vocab-split logits are gathered over "model" on the way in
        kernel = functools.partial(
            tree_sampling_from_logits,
            max_accept=tree.max_depth,
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
        )
        if target_logits.dtype == jnp.float16:  # the kernel reads float32 or bfloat16 rows; float16 widens exactly
            target_logits = target_logits.astype(jnp.float32)
        args = (
            tree.tokens,
            next_token,
            next_sibling,
            target_logits,
            params.as_rows(),
            coins,
            draw_coins(split[:, 2], ()),
        )
        accept_index, num_accepted, tokens, slot_valid = shard_call(
            kernel, args, (rows(2), rows(2), rows(2), rows(3), rows(2), rows(2), rows(1)), rows(1)
        )
        slot_valid = slot_valid & tokens_in_vocab(tree, vocab)
        return mask_invalid_rows(VerifyResult(accept_index, num_accepted, tokens), slot_valid, tree)
    probs = processed_probs(target_logits, params)
    if verifier == "sampling":
        final_coins = draw_coins(split[:, 2], ())
        result = verify_sampling(
            tree.tokens,
            next_token,
            next_sibling,
            probs,
            coins,
            final_coins,
            max_accept=tree.max_depth,
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
            check=False,
        )
    else:
        result = verify_sample_then_walk(
            tree.tokens, next_token, next_sibling, probs, coins, max_accept=tree.max_depth, check=False
        )
    slot_valid = valid_rows(target_logits) & params.in_range()[:, None] & tokens_in_vocab(tree, vocab)
    return mask_invalid_rows(result, slot_valid, tree)


LOGIT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def tokens_in_vocab(tree: DraftTree, vocab: int) -> jax.Array:
    """bool [B, N]: the slot's token lies in [0, vocab), or the slot is the root (slot 0, never judged)."""
    root = jnp.arange(tree.num_slots)[None, :] == 0
    return root | ((tree.tokens >= 0) & (tree.tokens < vocab))


def check_tree_tokens(tree: DraftTree, vocab: int) -> None:
    """Eager check (skipped for traced trees): every real draft slot's token lies in [0, vocab).

    Out-of-range tokens would otherwise be judged by a clamped gather (p of another token)."""
    if any(isinstance(a, jax.core.Tracer) for a in (tree.tokens, tree.num_nodes)):
        return
    # in numpy: under a jit that closes over a concrete tree, jnp ops would still give tracers
    tokens, num_nodes = np.asarray(tree.tokens), np.asarray(tree.num_nodes)
    slot = np.arange(tokens.shape[1])[None, :]
    real = slot < num_nodes[:, None]
    bad = real & (slot > 0) & ((tokens < 0) | (tokens >= vocab))
    if bad.any():
        row, slot = (int(i) for i in np.argwhere(bad)[0])
        token = int(tokens[row, slot])
        raise ValueError(
            f"tree row {row}, slot {slot}: token {token} is outside the target's vocabulary [0, V={vocab})"
        )


def mask_invalid_rows(result: VerifyResult, slot_valid: jax.Array, tree: DraftTree) -> VerifyResult:
    """Rows with invalid logits at a real slot (slot_valid bool [B, N] False where `tree.is_real`):
    num_accepted 0, accept_index [0, -1, ...], tokens INVALID_TOKEN; other rows of `result` as they are."""
    return invalid_rows_masked(result, (slot_valid | ~tree.is_real).all(axis=1))
