"""The generation loop driven from the host: compiled decode steps dispatched asynchronously.

`generate` runs every decode step inside one compiled `lax.while_loop`, so the host never waits between
steps. The alternative is a Python loop that calls one compiled `decode_step` per step. The state is
donated, so the cache is updated in place. JAX dispatches asynchronously: the host queues step i + 1
while the device still runs step i, and it syncs only every `sync_every` steps, to read whether every
row is done.

Both loops run the same steps on the same keys, so their tokens are identical. Steps queued after every
row is done leave the output unchanged: inactive rows neither emit nor count steps. What differs is
the cost:
- the while_loop pays for its condition on the device;
- the host loop pays a dispatch per step and a host sync every `sync_every` steps, and can overlap the
  host's work (streaming, scheduling) with the device's.

`benchmarks/bench_loop.py` measures the two side by side.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ddtree_jax.engine.generate import (
    GenerationResult,
    check_generate_inputs,
    generation_result,
    layers_sliced_once,
    start_state,
)
from ddtree_jax.engine.step import decode_step
from ddtree_jax.options import DecodeOptions, check_options

_START_STATIC = ("target_config", "max_new_tokens", "method", "budget", "block_size", "cache_dtype", "options")
_start = jax.jit(start_state, static_argnames=_START_STATIC)
_STEP_STATIC = ("target_config", "method", "budget", "block_size", "options")
# the state (argument 3) is donated: the cache and buffers are reused in place from step to step
_step = jax.jit(decode_step, static_argnames=_STEP_STATIC, donate_argnums=(3,))


def generate_host_loop(
    target_config,
    target_params,
    drafter,
    prompts,
    prompt_lengths,
    sampling,
    keys,
    stop_tokens,
    max_new,
    *,
    max_new_tokens: int,
    method: str = "ddtree",
    budget: int = 32,
    block_size: int = 8,
    cache_dtype=jnp.float32,
    options: DecodeOptions = DecodeOptions(),
    sync_every: int = 8,
) -> GenerationResult:
    """`generate` (same arguments, same tokens), with the step loop on the host. sync_every: steps queued
    between reads of the rows' done flags (>= 1). Each read is one host sync."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    check_options(
        method,
        budget=budget,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        drafter=drafter,
        target_config=target_config,
    )
    check_generate_inputs(target_config, prompts, prompt_lengths, max_new, max_new_tokens=max_new_tokens)
    target_params, drafter = layers_sliced_once(target_config, target_params, drafter, options)  # once, eagerly
    state = _start(
        target_config,
        target_params,
        drafter,
        prompts,
        prompt_lengths,
        sampling,
        keys,
        stop_tokens,
        max_new,
        max_new_tokens=max_new_tokens,
        method=method,
        budget=budget,
        block_size=block_size,
        cache_dtype=cache_dtype,
        options=options,
    )
    step = functools.partial(_step, target_config, method=method, budget=budget, block_size=block_size, options=options)
    for index in range(max_new_tokens):  # the while_loop's bound: at most max_new_tokens steps
        if index % sync_every == 0 and bool(jnp.all(state.done)):
            break
        state = step(target_params, drafter, state, sampling, keys, stop_tokens, max_new)
    return generation_result(state)
