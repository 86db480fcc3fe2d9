"""One compiled decode step: draft -> tree -> target verify -> verification -> commit -> emitted tokens.

The data flow of shared/spec/pipeline.md. All shapes are static (budget, block size, batch); no host
round trip. Methods share every stage after drafting:
  "ddtree"  build_tree(draft_logits, budget)       N = budget + 1 slots
  "chain"   build_chain(draft_logits)             N = block_size slots (linear DFlash)
  "ar"      no draft: the root alone               N = 1 (plain autoregressive decoding)

The stages are functions of their own (append_stage, draft_stage, tree_stage, verify_forward,
verification_stage, commit_stage, emit_stage): `decode_step` composes them, `engine.profile` times
each alone on the inputs of a real step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.models import target_module
from ddtree_jax.models.cache import KVCache, commit, gather_accepted
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams
from ddtree_jax.tree import DraftTree, ancestor_mask, build_chain, build_tree
from ddtree_jax.verify import VerifyResult, verify_step

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


def append_stage(drafter, draft_state, features: jax.Array, count: jax.Array, *, method: str):
    """The drafter's context append of the tapped features committed last step (none for AR)."""
    if method == "ar":
        return draft_state
    return drafter.append(draft_state, features, count)


def draft_stage(drafter, draft_state, bonus: jax.Array, *, method: str, block_size: int) -> jax.Array | None:
    """The drafter's forward: draft logits [B, block_size - 1, V] after the bonus tokens (None for AR)."""
    if method == "ar":
        return None
    return drafter.draft(draft_state, bonus, block_size)


def tree_stage(draft_logits: jax.Array | None, bonus: jax.Array, *, method: str, budget: int) -> DraftTree:
    """The draft tree: build_tree (DDTree), build_chain (DFlash) or the root alone (AR)."""
    if method == "ar":
        return root_only_tree(bonus)
    if method == "ddtree":
        return build_tree(draft_logits, budget, bonus, check_finite=False)
    return build_chain(draft_logits, bonus, check_finite=False)


def target_impls(target_config, *, attn_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto",
                 layer_loop: str = "auto") -> dict:
    """The implementation keywords of the target's prefill / verify: attention and matmul for every family,
    the MoE dispatch (`models.moe.MOE_IMPLS`, e.g. "ep" on an expert-parallel mesh) for DeepSeek-V3 / K2,
    and the layer loop ("scan" or "unrolled"; "auto": the model's default)."""
    impls = {"attn_impl": attn_impl, "matmul_impl": matmul_impl}
    if layer_loop != "auto":
        impls["layer_loop"] = layer_loop
    if isinstance(target_config, DeepSeekV3Config):
        impls["moe_impl"] = moe_impl
    elif moe_impl != "auto":
        raise ValueError(f"moe_impl={moe_impl!r} needs an MoE target; {type(target_config).__name__} has no experts")
    return impls


def verify_forward(target_config, target_params, cache: KVCache, tree: DraftTree, *, attn_impl: str = "auto",
                   matmul_impl: str = "auto", moe_impl: str = "auto", layer_loop: str = "auto"):
    """The target's tree-verify pass: (logits [B, N, V], tapped [B, N, F*D], cache with the tree K/V written)."""
    impls = target_impls(target_config, attn_impl=attn_impl, matmul_impl=matmul_impl, moe_impl=moe_impl,
                         layer_loop=layer_loop)
    return target_module(target_config).verify(target_config, target_params, cache, tree.tokens, tree.depths,
                                               ancestor_mask(tree), **impls)


def verification_stage(tree: DraftTree, logits: jax.Array, sampling: SamplingParams, keys: jax.Array, step: jax.Array, *,
                       order: str = "draft", verify_method: str = "sampling", sampling_impl: str = "auto") -> VerifyResult:
    """Tree rejection sampling with this step's keys (the request keys with the step folded in).
    sampling_impl: `verify_step`'s impl ("auto": the fused Pallas kernel on GPU, XLA elsewhere); the
    paper's sample-then-walk verifier has no kernel and always runs in XLA."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
    impl = sampling_impl if verify_method == "sampling" else "xla"
    return verify_step(tree, logits, sampling, step_keys, order=order, method=verify_method, impl=impl)


def commit_stage(cache: KVCache, tapped: jax.Array, result: VerifyResult, active: jax.Array):
    """Commits the accepted slots of active rows (inactive rows: nothing, lengths unchanged); returns
    (cache, the accepted slots' tapped features [B, S, F*D], their count [B]: next step's drafter append)."""
    n_commit = jnp.where(active, result.num_accepted, -1)  # -1: commit nothing, lengths unchanged
    cache = commit(cache, result.accept_index, n_commit)
    ctx_features = gather_accepted(tapped, result.accept_index, n_commit)
    return cache, ctx_features, jnp.maximum(n_commit + 1, 0)


def emit_stage(state: DecodeState, result: VerifyResult, stop_tokens: jax.Array, max_new: jax.Array):
    """The emitted tokens, truncated at the row's first stop token and at its max_new_tokens: returns
    (output, num_generated, steps, accepted, done, bonus) of the next state."""
    active = ~state.done
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
    steps = state.steps + active
    accepted = state.accepted + jnp.where(active, result.num_accepted, 0)
    return output, num_generated, steps, accepted, done, jnp.where(active, final, state.bonus)


def decode_step(target_config, target_params, drafter, state: DecodeState, sampling: SamplingParams, keys: jax.Array,
                stop_tokens: jax.Array, max_new: jax.Array, *, method: str, budget: int, block_size: int,
                order: str = "draft", verify_method: str = "sampling", attn_impl: str = "auto",
                sampling_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto",
                layer_loop: str = "auto") -> DecodeState:
    """Advances every active row by one speculative step (see the module docstring): the stages above,
    in order (`engine.profile` times each of them alone)."""
    active = ~state.done
    draft_state = append_stage(drafter, state.draft_state, state.ctx_features, state.ctx_count, method=method)
    draft_logits = draft_stage(drafter, draft_state, state.bonus, method=method, block_size=block_size)
    tree = tree_stage(draft_logits, state.bonus, method=method, budget=budget)
    logits, tapped, cache = verify_forward(target_config, target_params, state.target_cache, tree, attn_impl=attn_impl,
                                           matmul_impl=matmul_impl, moe_impl=moe_impl, layer_loop=layer_loop)
    result = verification_stage(tree, logits, sampling, keys, state.step, order=order, verify_method=verify_method,
                                sampling_impl=sampling_impl)
    cache, ctx_features, ctx_count = commit_stage(cache, tapped, result, active)
    output, num_generated, steps, accepted, done, bonus = emit_stage(state, result, stop_tokens, max_new)
    return DecodeState(
        target_cache=cache,
        draft_state=draft_state,
        bonus=bonus,
        ctx_features=ctx_features.astype(state.ctx_features.dtype),
        ctx_count=ctx_count,
        output=output,
        num_generated=num_generated,
        steps=steps,
        accepted=accepted,
        done=done,
        step=state.step + 1,
    )
