"""One compiled decode step: draft -> tree -> the target's tree forward -> the rejection walk -> commit ->
emitted tokens.

All shapes are static (budget, block size, batch); no host round trip. Methods share every stage after
drafting:
  "ddtree"  build_tree(draft_logits, budget)       N = budget + 1 slots (with a drafter's child head:
            the path-conditioned tree, `conditional_tree_stage`)
  "chain"   build_chain(draft_logits)             N = block_size slots (linear DFlash)
  "ar"      no draft: the root alone               N = 1 (plain autoregressive decoding)

The stages are functions of their own (append_stage, draft_stage, tree_stage, tree_forward_stage,
walk_stage, commit_stage, emit_stage): `traced_decode_step` composes them and also returns a `StepTrace`
(the tree, the target's logits, the walk's result) for observers such as the studies; `decode_step` is
its state alone; `engine.profile` times each stage alone on the inputs of a real step. How each stage
runs (kernels, layer loop, verifier, sibling order) is one `DecodeOptions`.

The cost-aware budget (`DecodeOptions.budget_policy`, a `BudgetPolicy`): the tree is built at the policy's
largest budget, each budget's sub-tree (its first b + 1 slots, `tree.budget`) gets a predicted tokens per ms
from its surrogate and the budget's measured step time, and a `lax.switch` runs the tree forward, walk and
commit of the chosen sub-tree only: one compiled branch per budget, no host round trip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ddtree_jax.models import target_module
from ddtree_jax.models.cache import KVCache, commit, gather_accepted
from ddtree_jax.options import METHODS, DecodeOptions
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams
from ddtree_jax.tree import DraftTree, ancestor_mask, build_chain, build_conditional_tree, build_tree
from ddtree_jax.tree.budget import choose_budget_index, mask_tree, prefix_surrogates, truncate_tree
from ddtree_jax.verify import VerifyResult, verify_step

__all__ = [
    "METHODS",
    "DecodeOptions",
    "DecodeState",
    "StepTrace",
    "decode_step",
    "traced_decode_step",
    "root_only_tree",
    "steps_per_token",
    "append_stage",
    "draft_stage",
    "tree_stage",
    "tree_forward_stage",
    "walk_stage",
    "commit_stage",
    "emit_stage",
]


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
    data_fields=[
        "target_cache",
        "draft_state",
        "bonus",
        "ctx_features",
        "ctx_count",
        "output",
        "num_generated",
        "steps",
        "accepted",
        "done",
        "step",
    ],
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


def tree_stage(
    draft_logits: jax.Array | None,
    bonus: jax.Array,
    *,
    method: str,
    budget: int,
    topk_impl: str = "auto",
    tree_impl: str = "auto",
) -> DraftTree:
    """The draft tree: build_tree (DDTree; `tree_impl` picks the kernels or XLA), build_chain (DFlash) or
    the root alone (AR)."""
    if method == "ar":
        return root_only_tree(bonus)
    if method == "ddtree":
        return build_tree(draft_logits, budget, bonus, topk_impl=topk_impl, impl=tree_impl, check_finite=False)
    return build_chain(draft_logits, bonus, check_finite=False)


def conditional_tree_stage(
    draft_logits, child_logits_fn, inputs, bonus: jax.Array, *, budget: int, tree_impl: str = "auto"
) -> DraftTree:
    """The path-conditioned DDTree tree (`tree.conditional.build_conditional_tree`; `tree_impl` picks the top-K
    kernels or XLA for each level's two top-Ks): the root's children from the draft pass's depth-1 logits, every
    deeper node's from the child head; the depth limit is the draft's."""
    return build_conditional_tree(
        draft_logits[:, 0], child_logits_fn, inputs, budget, draft_logits.shape[1], bonus, impl=tree_impl
    )


def tree_forward_stage(
    target_config, target_params, cache: KVCache, tree: DraftTree, options: DecodeOptions = DecodeOptions()
):
    """The target's forward over the tree's slots: (logits [B, N, V], tapped [B, N, F*D], cache with the
    tree's K/V written)."""
    return target_module(target_config).tree_forward(
        target_config,
        target_params,
        cache,
        tree.tokens,
        tree.depths,
        ancestor_mask(tree),
        **options.target_impls(target_config),
    )


def walk_stage(
    tree: DraftTree,
    logits: jax.Array,
    sampling: SamplingParams,
    keys: jax.Array,
    step: jax.Array,
    options: DecodeOptions = DecodeOptions(),
) -> VerifyResult:
    """The tree rejection walk (`verify_step`) with this step's keys (the request keys with the step folded
    in), in `options.order`, by `options.verifier` at `options.verify_impl` (the sample-then-walk verifier
    has no kernel and always runs in XLA), with the options' acceptance thresholds (1.0: exact)."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
    impl = options.verify_impl if options.verifier == "sampling" else "xla"
    return verify_step(
        tree,
        logits,
        sampling,
        step_keys,
        order=options.order,
        verifier=options.verifier,
        impl=impl,
        threshold_single=options.threshold_single,
        threshold_acc=options.threshold_acc,
    )


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


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What one decode step computed, for observers (the studies): the tree verified [B, N], the target's logits
    at its slots [B, N, V], the walk's result, which rows were active (bool [B]) and the budget verified (int32
    scalar: N - 1, or under a `BudgetPolicy` the step's choice, the tree's later slots then padding and their
    logits 0)."""

    tree: DraftTree
    target_logits: jax.Array
    result: VerifyResult
    active: jax.Array
    budget: jax.Array


jax.tree_util.register_dataclass(
    StepTrace, data_fields=["tree", "target_logits", "result", "active", "budget"], meta_fields=[]
)


def traced_decode_step(
    target_config,
    target_params,
    drafter,
    state: DecodeState,
    sampling: SamplingParams,
    keys: jax.Array,
    stop_tokens: jax.Array,
    max_new: jax.Array,
    *,
    method: str,
    budget: int,
    block_size: int,
    options: DecodeOptions = DecodeOptions(),
) -> tuple[DecodeState, StepTrace]:
    """Advances every active row by one speculative step (see the module docstring): the stages above, in
    order. Returns (the next state, the step's trace)."""
    active = ~state.done
    # each stage under a named scope ("ddtree_<stage>"): a profile's ops map back to their stage through the
    # optimized HLO's op_name metadata (benchmarks/step_ops.py)
    with jax.named_scope("ddtree_append"):
        draft_state = append_stage(drafter, state.draft_state, state.ctx_features, state.ctx_count, method=method)
    conditional = method == "ddtree" and getattr(drafter, "conditional", False)
    with jax.named_scope("ddtree_draft"):
        if conditional:  # a child head: the draft pass also gives what the head conditions on
            draft_logits, child_fn, child_inputs = drafter.draft_children(draft_state, state.bonus, block_size)
        else:
            draft_logits = draft_stage(drafter, draft_state, state.bonus, method=method, block_size=block_size)
    with jax.named_scope("ddtree_tree"):
        if conditional:
            tree = conditional_tree_stage(
                draft_logits, child_fn, child_inputs, state.bonus, budget=budget, tree_impl=options.tree_impl
            )
        else:
            tree = tree_stage(
                draft_logits,
                state.bonus,
                method=method,
                budget=budget,
                topk_impl=options.topk_impl,
                tree_impl=options.tree_impl,
            )

    def verify_stages(sub_tree: DraftTree, cache):
        with jax.named_scope("ddtree_tree_forward"):
            logits, tapped, cache = tree_forward_stage(target_config, target_params, cache, sub_tree, options)
        with jax.named_scope("ddtree_walk"):
            result = walk_stage(sub_tree, logits, sampling, keys, state.step, options)
        with jax.named_scope("ddtree_commit"):
            cache, ctx_features, ctx_count = commit_stage(cache, tapped, result, active)
        return logits, result, cache, ctx_features, ctx_count

    policy = options.budget_policy
    if policy is None:
        logits, result, cache, ctx_features, ctx_count = verify_stages(tree, state.target_cache)
        verified_budget = jnp.int32(tree.num_slots - 1)
    else:  # the cost-aware budget: verify the sub-tree of the budget with the most predicted tokens per ms
        if method != "ddtree" or budget != policy.max_budget:
            raise ValueError(
                f"a budget policy needs method 'ddtree' at its largest budget {policy.max_budget}; "
                f"got method {method!r}, budget {budget}"
            )
        with jax.named_scope("ddtree_budget"):
            surrogates = prefix_surrogates(tree, policy.budgets)
            index = choose_budget_index(surrogates, active, policy.scale, policy.step_ms)

        def branch(sub_budget: int):
            def run(cache):
                logits, *rest = verify_stages(truncate_tree(tree, sub_budget), cache)
                pad = tree.num_slots - logits.shape[1]  # the trace's logits keep the full tree's shape
                return (jnp.pad(logits, ((0, 0), (0, pad), (0, 0))), *rest)

            return run

        logits, result, cache, ctx_features, ctx_count = lax.switch(
            index, [branch(b) for b in policy.budgets], state.target_cache
        )
        verified_budget = jnp.asarray(policy.budgets, jnp.int32)[index]
        tree = mask_tree(tree, verified_budget)
    with jax.named_scope("ddtree_emit"):
        output, num_generated, steps, accepted, done, bonus = emit_stage(state, result, stop_tokens, max_new)
    new_state = DecodeState(
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
    trace = StepTrace(tree=tree, target_logits=logits, result=result, active=active, budget=verified_budget)
    return new_state, trace


def decode_step(
    target_config,
    target_params,
    drafter,
    state: DecodeState,
    sampling: SamplingParams,
    keys: jax.Array,
    stop_tokens: jax.Array,
    max_new: jax.Array,
    *,
    method: str,
    budget: int,
    block_size: int,
    options: DecodeOptions = DecodeOptions(),
) -> DecodeState:
    """`traced_decode_step`'s next state (the trace is dead code: XLA drops it)."""
    return traced_decode_step(
        target_config,
        target_params,
        drafter,
        state,
        sampling,
        keys,
        stop_tokens,
        max_new,
        method=method,
        budget=budget,
        block_size=block_size,
        options=options,
    )[0]
