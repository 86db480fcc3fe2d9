"""One compiled decode step: draft -> tree -> target verify -> verification -> commit -> emitted tokens.

The data flow of shared/spec/pipeline.md. All shapes are static (budget, block size, batch); no host
round trip. Methods share every stage after drafting:
  "ddtree"  build_tree(draft_logits, budget)       N = budget + 1 slots
  "chain"   build_chain(draft_logits)             N = block_size slots (linear DFlash)
  "ar"      no draft: the root alone               N = 1 (plain autoregressive decoding)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.models import target_module
from ddtree_jax.models.cache import KVCache, commit, gather_accepted
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams
from ddtree_jax.tree import DraftTree, ancestor_mask, build_chain, build_tree
from ddtree_jax.verify import verify_step

METHODS = ("ddtree", "chain", "ar")


@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that carries from one step to the next (a pytree).

    target_cache: KVCache (lengths = committed tokens); draft_state: the drafter's state (its context
    cache); bonus int32 [B]: the last emitted token, not yet in the target cache; ctx_features
    [B, S, F*D] / ctx_count int32 [B]: tapped features of the tokens committed last step, still to be
    appended to the drafter; output int32 [B, max_new] (-1 padded); num_generated, steps, accepted
    int32 [B]; done bool [B]; step int32 [].
    """

    target_cache: KVCache
    draft_state: object
    bonus: jax.Array
    ctx_features: jax.Array
    ctx_count: jax.Array
    output: jax.Array
    num_generated: jax.Array
    steps: jax.Array
    accepted: jax.Array
    done: jax.Array
    step: jax.Array


jax.tree_util.register_dataclass(
    DecodeState,
    data_fields=["target_cache", "draft_state", "bonus", "ctx_features", "ctx_count", "output", "num_generated",
                 "steps", "accepted", "done", "step"],
    meta_fields=[],
)


def root_only_tree(bonus: jax.Array) -> DraftTree:
    """The AR "tree": the root alone (max_depth 0, so verification samples the target's next token)."""
    batch = bonus.shape[0]
    return DraftTree(
        tokens=bonus[:, None].astype(jnp.int32),
        parents=jnp.full((batch, 1), -1, jnp.int32),
        depths=jnp.zeros((batch, 1), jnp.int32),
        ranks=jnp.full((batch, 1), -1, jnp.int32),
        logw=jnp.zeros((batch, 1), jnp.float32),
        num_nodes=jnp.ones((batch,), jnp.int32),
        max_depth=0,
    )


def steps_per_token(method: str, block_size: int) -> int:
    """S = max_accept + 1: the most tokens one step can emit."""
    return 1 if method == "ar" else block_size


def decode_step(target_config, target_params, drafter, state: DecodeState, sampling: SamplingParams, keys: jax.Array,
                stop_tokens: jax.Array, max_new: jax.Array, *, method: str, budget: int, block_size: int,
                order: str = "draft", verify_method: str = "sampling", attn_impl: str = "xla") -> DecodeState:
    """Advances every active row by one speculative step (see the module docstring)."""
    active = ~state.done
    if method == "ar":
        tree, draft_state = root_only_tree(state.bonus), state.draft_state
    else:
        draft_state = drafter.append(state.draft_state, state.ctx_features, state.ctx_count)
        draft_logits = drafter.draft(draft_state, state.bonus, block_size)
        if method == "ddtree":
            tree = build_tree(draft_logits, budget, state.bonus, check_finite=False)
        else:
            tree = build_chain(draft_logits, state.bonus, check_finite=False)
    logits, tapped, cache = target_module(target_config).verify(target_config, target_params, state.target_cache, tree.tokens, tree.depths,
                                         ancestor_mask(tree), attn_impl=attn_impl)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, state.step))(keys)
    result = verify_step(tree, logits, sampling, step_keys, order=order, method=verify_method)

    n_commit = jnp.where(active, result.num_accepted, -1)  # -1: commit nothing, lengths unchanged
    cache = commit(cache, result.accept_index, n_commit)
    ctx_features = gather_accepted(tapped, result.accept_index, n_commit)

    # emitted tokens, truncated at the row's first stop token and at its max_new_tokens
    width = result.tokens.shape[1]
    emitted = result.tokens
    count = result.num_accepted + 1
    within = jnp.arange(width)[None, :] < count[:, None]
    is_stop = (emitted[:, :, None] == stop_tokens[:, None, :]).any(-1) & within & (stop_tokens.shape[1] > 0)
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), width)
    take = jnp.minimum(jnp.minimum(count, first_stop + 1), max_new - state.num_generated)
    take = jnp.where(active, take, 0)
    capacity = state.output.shape[1]
    cols = state.num_generated[:, None] + jnp.arange(width)[None, :]
    cols = jnp.where(jnp.arange(width)[None, :] < take[:, None], cols, capacity)  # dropped
    output = state.output.at[jnp.arange(emitted.shape[0])[:, None], cols].set(emitted, mode="drop")
    num_generated = state.num_generated + take
    invalid = (emitted[:, 0] == INVALID_TOKEN) & active
    done = state.done | (active & (is_stop.any(1) | (num_generated >= max_new))) | invalid
    final = jnp.take_along_axis(emitted, result.num_accepted[:, None], axis=1)[:, 0]
    return DecodeState(
        target_cache=cache,
        draft_state=draft_state,
        bonus=jnp.where(active, final, state.bonus),
        ctx_features=ctx_features.astype(state.ctx_features.dtype),
        ctx_count=jnp.maximum(n_commit + 1, 0),
        output=output,
        num_generated=num_generated,
        steps=state.steps + active,
        accepted=state.accepted + jnp.where(active, result.num_accepted, 0),
        done=done,
        step=state.step + 1,
    )
