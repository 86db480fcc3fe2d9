"""Prefill hand-over and the generation loop (an on-device while_loop over decode steps)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.engine.step import METHODS, DecodeState, decode_step, steps_per_token, target_impls
from ddtree_jax.models import target_module
from ddtree_jax.sampling import SamplingParams, sample

PREFILL_SALT = 2**31 - 1  # the first token's coin: a fold-in no decode step uses


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """tokens int32 [B, max_new] (-1 padded); num_generated, steps, accepted int32 [B]
    (steps: decode steps the row was active, excluding the prefill token; accepted: draft tokens accepted)."""

    tokens: jax.Array
    num_generated: jax.Array
    steps: jax.Array
    accepted: jax.Array

    @property
    def tau(self) -> jax.Array:
        """float [B]: mean tokens per decode step (acceptance length; 1.0 for AR)."""
        return (self.accepted + self.steps) / jnp.maximum(self.steps, 1)


jax.tree_util.register_dataclass(GenerationResult, data_fields=["tokens", "num_generated", "steps", "accepted"], meta_fields=[])


def cache_capacity(prompt_len: int, max_new_tokens: int, method: str, budget: int, block_size: int) -> int:
    """Rows a KV cache needs: prompt + generated tokens + one step's scratch slots."""
    slots = {"ddtree": budget + 1, "chain": block_size, "ar": 1}[method]
    return prompt_len + max_new_tokens + max(slots, block_size) + 1


def prefill(target_config, target_params, drafter, prompts, prompt_lengths, sampling: SamplingParams, keys, *,
            max_new_tokens: int, method: str, budget: int, block_size: int, cache_dtype=jnp.float32,
            attn_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto",
            layer_loop: str = "auto") -> DecodeState:
    """Target prefill; the first token from the plain sampler; the drafter's context from the prompt's
    tapped hidden states (shared/spec/pipeline.md step 0)."""
    batch, prompt_len = prompts.shape
    capacity = cache_capacity(prompt_len, max_new_tokens, method, budget, block_size)
    target = target_module(target_config)
    cache = target.create_cache(target_config, batch, capacity, cache_dtype)
    impls = target_impls(target_config, attn_impl=attn_impl, matmul_impl=matmul_impl, moe_impl=moe_impl,
                         layer_loop=layer_loop)
    logits, features, cache = target.prefill(target_config, target_params, cache, prompts, prompt_lengths, **impls)
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    first_keys = jax.vmap(lambda k: jax.random.fold_in(k, PREFILL_SALT))(keys)  # steps fold in 0, 1, ...
    bonus = sample(last, sampling, first_keys)
    width = steps_per_token(method, block_size)
    if method == "ar":
        draft_state = jnp.zeros((), jnp.int32)
    else:
        draft_state = drafter.append(drafter.init_state(batch, capacity, cache_dtype), features, prompt_lengths)
    output = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(bonus)
    return DecodeState(
        target_cache=cache,
        draft_state=draft_state,
        bonus=bonus,
        ctx_features=jnp.zeros((batch, width, features.shape[-1]), features.dtype),
        ctx_count=jnp.zeros((batch,), jnp.int32),
        output=output,
        num_generated=jnp.ones((batch,), jnp.int32),
        steps=jnp.zeros((batch,), jnp.int32),
        accepted=jnp.zeros((batch,), jnp.int32),
        done=bonus < 0,
        step=jnp.zeros((), jnp.int32),
    )


def start_state(target_config, target_params, drafter, prompts, prompt_lengths, sampling: SamplingParams, keys, stop_tokens,
                max_new, **prefill_options) -> DecodeState:
    """`prefill`, then rows whose first token is a stop token or whose max_new <= 1 are marked done: the
    state the decode loop starts from (`generate`'s while_loop, `engine.host_loop`)."""
    method = prefill_options.get("method")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    state = prefill(target_config, target_params, drafter, prompts, prompt_lengths, sampling, keys, **prefill_options)
    first_stop = (state.bonus[:, None] == stop_tokens).any(1)
    return dataclasses.replace(state, done=state.done | first_stop | (max_new <= 1))


@functools.partial(jax.jit, static_argnames=("target_config", "max_new_tokens", "method", "budget", "block_size",
                                             "order", "verify_method", "cache_dtype", "attn_impl",
                                             "sampling_impl", "matmul_impl", "moe_impl", "layer_loop"))
def generate(target_config, target_params, drafter, prompts, prompt_lengths, sampling: SamplingParams, keys, stop_tokens,
             max_new, *, max_new_tokens: int, method: str = "ddtree", budget: int = 32, block_size: int = 8,
             order: str = "draft", verify_method: str = "sampling", cache_dtype=jnp.float32, attn_impl: str = "auto",
             sampling_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto", layer_loop: str = "auto"):
    """Generates up to max_new[b] <= max_new_tokens tokens per row, as one compiled program.

    Args:
      prompts int32 [B, T] (row b's first prompt_lengths[b] real); sampling: SamplingParams [B];
      keys: typed PRNG keys [B], one per request; stop_tokens int32 [B, K] (-1 = unused); max_new int32 [B].
      attn_impl / sampling_impl / matmul_impl: attention, tree-sampling and target-matmul implementations
        ("auto" everywhere = XLA off GPU; on GPU: the fused tree-sampling kernel, the tree-attention
        kernel for GQA tree verify and the weight-streaming matmul for quantised weights at <= 32 rows,
        where the H200 benchmarks measured them faster: `models.attention.resolve_attention_impl`,
        `models.layers.resolve_matmul_impl`).
      moe_impl: the MoE targets' expert dispatch (`models.moe.MOE_IMPLS`; "ep" under an expert-parallel
        mesh set with `jax.set_mesh`).
      layer_loop: the target's layer loop, "scan" (`lax.scan` over the stacked layers: one layer in the
        program) or "unrolled"; "auto": the model's default.
    Returns:
      GenerationResult. A row stops at its first stop token (kept) or at max_new[b] tokens.
    """
    state = start_state(target_config, target_params, drafter, prompts, prompt_lengths, sampling, keys, stop_tokens,
                        max_new, max_new_tokens=max_new_tokens, method=method, budget=budget, block_size=block_size,
                        cache_dtype=cache_dtype, attn_impl=attn_impl, matmul_impl=matmul_impl, moe_impl=moe_impl,
                        layer_loop=layer_loop)

    def cond(s):
        return ~jnp.all(s.done) & (s.step < max_new_tokens)

    def body(s):
        return decode_step(target_config, target_params, drafter, s, sampling, keys, stop_tokens, max_new,
                           method=method, budget=budget, block_size=block_size, order=order,
                           verify_method=verify_method, attn_impl=attn_impl, sampling_impl=sampling_impl,
                           matmul_impl=matmul_impl, moe_impl=moe_impl, layer_loop=layer_loop)

    state = jax.lax.while_loop(cond, body, state)
    return GenerationResult(state.output, state.num_generated, state.steps, state.accepted)
