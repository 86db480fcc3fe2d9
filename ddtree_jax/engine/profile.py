"""Per-stage times of one decode step: where a step's time goes (`ddtree-jax bench --profile`).

`stage_times` prefills the prompts, runs `warmup_steps` real decode steps (so the drafter has
context features to append, as mid-generation), then times each stage of `engine.step.decode_step`
alone, jit-compiled on its own, on the inputs that real step hands it:

  draft           the drafter's forward (`draft_stage`: DFlash draft logits [B, L, V]; 0 for AR)
  tree            `tree_stage`: build_tree (DDTree), build_chain (DFlash chain), the root alone (AR)
  tree_forward    the target's forward over the tree (`tree_forward_stage`)
  walk            the tree rejection walk (`walk_stage`: verify_step)
  commit          target cache commit + accepted features, output / stop bookkeeping (`commit_stage`,
                  `emit_stage`) and the drafter's context append of the accepted features
                  (`append_stage`, which decode_step runs at the top of the next step)

plus `step`, the whole fused decode step (timed whole, apart from the stages), `stages_sum`, the
stages' sum, `<stage>_share` = stage / stages_sum for each stage (they add up to 1), and
`non_forward_share` = (tree + walk + commit) / stages_sum: the share of the stages' sum spent outside
the two models' forwards. Times are medians over `repeats` runs in seconds, each run ended by
`jax.block_until_ready`. The stages compiled alone lose the fusion across stage boundaries, so
`stages_sum` may exceed `step`: the shares are of the stages' sum, never of `step` (a share of `step`
could pass 100%).
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from ddtree_jax import dispatch
from ddtree_jax.engine.generate import layers_sliced_once, prefill
from ddtree_jax.engine.run import Pair, checked_request_args, pair_dtype
from ddtree_jax.engine.step import (
    append_stage,
    commit_stage,
    conditional_tree_stage,
    decode_step,
    draft_stage,
    emit_stage,
    tree_forward_stage,
    tree_stage,
    walk_stage,
)
from ddtree_jax.options import DecodeOptions

STAGES = ("draft", "tree", "tree_forward", "walk", "commit")
NON_FORWARD = ("tree", "walk", "commit")


def _measure(fn, args: tuple, repeats: int):
    """(output, median seconds) of fn(*args) compiled alone (or of a compiled fn); the first (warm-up) run
    is not timed."""
    compiled = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def warm_step(
    pair: Pair,
    prompt_ids,
    *,
    method: str = "ddtree",
    budget: int = 32,
    block_size: int | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    options: DecodeOptions = DecodeOptions(),
    warmup_steps: int = 1,
    **settings,
):
    """The fused decode step, compiled, and its arguments after `warmup_steps` real steps past the prefill:
    (step, (params, drafter, state, sampling, keys, stop, max_new), block size). `step(*args)` is one decode
    step as `generate` runs it (what `stage_times` times as "step" and `benchmarks.step_ops` profiles op by
    op). Arguments as `stage_times`; settings: the other sampling settings and seed (`request_args`' keywords:
    top_k, top_p, min_p, seed)."""
    if len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer)):
        prompt_ids = [prompt_ids]
    block, (config, params, drafter, prompts, lengths, sampling, keys, stop, max_new) = checked_request_args(
        pair,
        prompt_ids,
        method=method,
        budget=budget,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        **settings,
    )
    shape = dict(max_new_tokens=max_new_tokens, method=method, budget=budget, block_size=block)
    params, drafter = layers_sliced_once(config, params, drafter, options)  # as generate does, before its loop

    cache_dtype = pair_dtype(pair)  # the caches hold the weights' dtype, as `run_generate` compiles them
    state = jax.jit(lambda *a: prefill(config, *a, **shape, cache_dtype=cache_dtype, options=options))(
        params, drafter, prompts, lengths, sampling, keys
    )

    step_fn = functools.partial(decode_step, config, method=method, budget=budget, block_size=block, options=options)
    step_args = (params, drafter, state, sampling, keys, stop, max_new)
    # the GEMM options `generate` compiles with (no split-K for small targets), so a step profiled alone runs
    # the kernels the generation loop runs
    gemm_options = dispatch.gemm_compiler_options(hidden_size=config.hidden_size)
    step = jax.jit(step_fn).lower(*step_args).compile(compiler_options=gemm_options or None)
    for _ in range(warmup_steps):
        state = step(params, drafter, state, sampling, keys, stop, max_new)
    return step, (params, drafter, state, sampling, keys, stop, max_new), block


def stage_times(
    pair: Pair,
    prompt_ids,
    *,
    method: str = "ddtree",
    budget: int = 32,
    options: DecodeOptions = DecodeOptions(),
    repeats: int = 5,
    **request,
) -> dict[str, float]:
    """Median seconds of each stage of one decode step, of the fused step, and the stages' shares of their sum.

    prompt_ids: one prompt (a list of ids) or a batch of prompts (rows of one step). request: the rest of
    `warm_step`'s keywords (block_size, max_new_tokens, which sizes the caches as generation would, the
    sampling settings, seed, warmup_steps). Keys: STAGES, "step", "stages_sum", "<stage>_share",
    "non_forward_share" (module docstring, `add_shares`). The request is checked (`check_request`).
    """
    step, step_args, block = warm_step(pair, prompt_ids, method=method, budget=budget, options=options, **request)
    params, drafter, state, sampling, keys, stop, max_new = step_args
    config = pair.target_config
    _, step_s = _measure(step, (params, drafter, state, sampling, keys, stop, max_new), repeats)

    # the stages, in decode_step's order, each fed the previous stage's real output
    draft_state = append_stage(drafter, state.draft_state, state.ctx_features, state.ctx_count, method=method)
    times = {}
    # a child head (`drafter.conditional`): the draft pass also gives what the head conditions on, and the tree is
    # the path-conditioned one, as `decode_step` runs them
    conditional = method == "ddtree" and getattr(drafter, "conditional", False)
    if method == "ar":
        draft_logits, times["draft"] = None, 0.0
    elif conditional:
        child_fn = drafter.draft_children(draft_state, state.bonus, block)[1]  # a static function
        (draft_logits, child_inputs), times["draft"] = _measure(
            lambda d, s, b: (lambda out: (out[0], out[2]))(d.draft_children(s, b, block)),
            (drafter, draft_state, state.bonus),
            repeats,
        )
    else:
        draft_logits, times["draft"] = _measure(
            lambda d, s, b: draft_stage(d, s, b, method=method, block_size=block),
            (drafter, draft_state, state.bonus),
            repeats,
        )
    if conditional:
        tree, times["tree"] = _measure(
            lambda l, i, b: conditional_tree_stage(l, child_fn, i, b, budget=budget, tree_impl=options.tree_impl),
            (draft_logits, child_inputs, state.bonus),
            repeats,
        )
    else:
        tree, times["tree"] = _measure(
            lambda l, b: tree_stage(
                l, b, method=method, budget=budget, topk_impl=options.topk_impl, tree_impl=options.tree_impl
            ),
            (draft_logits, state.bonus),
            repeats,
        )
    (logits, tapped, cache), times["tree_forward"] = _measure(
        lambda p, c, t: tree_forward_stage(config, p, c, t, options), (params, state.target_cache, tree), repeats
    )
    result, times["walk"] = _measure(
        lambda t, l, s, k, i: walk_stage(t, l, s, k, i, options), (tree, logits, sampling, keys, state.step), repeats
    )

    def commit_fn(drafter, draft_state, cache, tapped, result, state, stop, max_new):
        cache, features, count = commit_stage(cache, tapped, result, ~state.done)
        emitted = emit_stage(state, result, stop, max_new)
        features = features.astype(state.ctx_features.dtype)
        return cache, emitted, append_stage(drafter, draft_state, features, count, method=method)

    _, times["commit"] = _measure(
        commit_fn, (drafter, draft_state, cache, tapped, result, state, stop, max_new), repeats
    )
    times["step"] = step_s
    return add_shares(times)


def add_shares(times: dict[str, float]) -> dict[str, float]:
    """`times` (seconds of each of STAGES and "step") with "stages_sum", "<stage>_share" = stage / stages_sum
    per stage (they add up to 1, each in [0, 1]) and "non_forward_share" = (tree + walk + commit) /
    stages_sum; shares are 0 when every stage took 0 s."""
    out = dict(times)
    total = sum(times[s] for s in STAGES)
    out["stages_sum"] = total
    for s in STAGES:
        out[f"{s}_share"] = times[s] / total if total > 0 else 0.0
    out["non_forward_share"] = sum(times[s] for s in NON_FORWARD) / total if total > 0 else 0.0
    return out


def format_stage_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """A text table of `stage_times` results, one (label, times) per line, times in milliseconds."""
    header = (
        f"{'method':<14}{'draft':>9}{'tree':>9}{'target fwd':>12}{'walk':>14}{'commit':>9}"
        f"{'sum':>9}{'step':>9}{'non-fwd':>9}"
    )
    lines = [header, "-" * len(header)]
    for label, t in rows:
        ms = {k: v * 1e3 for k, v in t.items()}
        lines.append(
            f"{label:<14}{ms['draft']:>9.3f}{ms['tree']:>9.3f}{ms['tree_forward']:>12.3f}"
            f"{ms['walk']:>14.3f}{ms['commit']:>9.3f}{ms['stages_sum']:>9.3f}{ms['step']:>9.3f}"
            f"{t['non_forward_share']:>8.1%}"
        )
    footer = (
        "(milliseconds per decode step, median. draft, tree, target fwd, walk, commit: each stage compiled and "
        "timed alone;\n sum: the stages' sum; step: the fused decode step, timed whole (fusion across the stages "
        "can make it shorter than sum);\n non-fwd: (tree + walk + commit) as a share of the stages' sum, "
        "not of step)"
    )
    return "\n".join(lines) + "\n" + footer
