"""Prefill hand-over and the generation loop (an on-device while_loop over decode steps); `generate_recorded`
is the same loop with per-step records taken by an observer of each step's `StepTrace` (the studies)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import dispatch
from ddtree_jax.config import Qwen3Config
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.step import DecodeState, StepTrace, steps_per_token, traced_decode_step
from ddtree_jax.models import target_module
from ddtree_jax.models.layers import unstack_layers
from ddtree_jax.options import DecodeOptions, check_method, check_options
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams, sample

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


jax.tree_util.register_dataclass(
    GenerationResult, data_fields=["tokens", "num_generated", "steps", "accepted"], meta_fields=[]
)


def cache_capacity(prompt_len: int, max_new_tokens: int, method: str, budget: int, block_size: int) -> int:
    """Rows a KV cache needs: prompt + generated tokens + one step's scratch slots, rounded up to a multiple
    of `dispatch.CACHE_ROW_MULTIPLE` (the Mosaic GPU attention kernels read whole key blocks; the extra rows
    are never visible)."""
    slots = {"ddtree": budget + 1, "chain": block_size, "ar": 1}[method]
    rows = prompt_len + max_new_tokens + max(slots, block_size) + 1
    return -(-rows // dispatch.CACHE_ROW_MULTIPLE) * dispatch.CACHE_ROW_MULTIPLE


def prefill(
    target_config,
    target_params,
    drafter,
    prompts,
    prompt_lengths,
    sampling: SamplingParams,
    keys,
    *,
    max_new_tokens: int,
    method: str,
    budget: int,
    block_size: int,
    cache_dtype=jnp.float32,
    options: DecodeOptions = DecodeOptions(),
) -> DecodeState:
    """Target prefill; the first token from the plain sampler; the drafter's context from the prompt's
    tapped hidden states.

    A prompt longer than `dispatch.target_prefill_chunk(target_config, options.prefill_chunk, T, B)` tokens is
    prefilled in chunks of that size (`_chunked_prefill`): the same caches and first token, memory of one chunk."""
    batch, prompt_len = prompts.shape
    chunk = dispatch.target_prefill_chunk(target_config, options.prefill_chunk, prompt_len, batch)
    padded_len = prompt_len if chunk is None else -(-prompt_len // chunk) * chunk
    capacity = cache_capacity(padded_len, max_new_tokens, method, budget, block_size)
    target = target_module(target_config)
    cache = target.create_cache(target_config, batch, capacity, cache_dtype)
    draft_state = None if method == "ar" else drafter.init_state(batch, capacity, cache_dtype)
    if chunk is None:
        logits, features, cache = target.prefill(
            target_config,
            target_params,
            cache,
            prompts,
            prompt_lengths,
            head_rows=prompt_lengths - 1,  # the logits of each row's last prompt token only
            **options.target_impls(target_config),
        )
        last = logits[:, 0]
        if draft_state is not None:
            draft_state = drafter.append(draft_state, features, prompt_lengths)
    else:
        last, cache, draft_state, features = _chunked_prefill(
            target_config, target_params, drafter, cache, draft_state, prompts, prompt_lengths, chunk, options
        )
    first_keys = jax.vmap(lambda k: jax.random.fold_in(k, PREFILL_SALT))(keys)  # steps fold in 0, 1, ...
    bonus = sample(last, sampling, first_keys)
    width = steps_per_token(method, block_size)
    if method == "ar":
        draft_state = jnp.zeros((), jnp.int32)
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


def _chunked_prefill(target_config, target_params, drafter, cache, draft_state, prompts, lengths, chunk, options):
    """The prefill as a `lax.scan` over `chunk`-token slices of the prompts (padded to a multiple of chunk):
    chunk c feeds row b its tokens c * chunk .. min(len_b, (c + 1) * chunk) - 1 (none once the row is
    done), each attending the cache written so far plus itself; the drafter appends each chunk's tapped
    features. Returns (the logits of each row's last prompt token f32 [B, V], the target cache, the
    drafter state (None for AR), the tapped features' abstract shape [B, chunk, F*D] (only the current chunk's
    features are ever alive))."""
    batch, prompt_len = prompts.shape
    chunks = -(-prompt_len // chunk)
    padded = jnp.pad(prompts, ((0, 0), (0, chunks * chunk - prompt_len)))
    target = target_module(target_config)
    impls = options.target_impls(target_config)
    last_index = lengths - 1

    def one_chunk(carry, index):
        cache, draft_state, last = carry
        start = index * chunk
        ids = jax.lax.dynamic_slice_in_dim(padded, start, chunk, axis=1)
        num_new = jnp.clip(lengths - start, 0, chunk)
        offset = last_index - start  # the row's last token, if it is in this chunk
        here = (offset >= 0) & (offset < chunk)
        logits, features, cache = target.prefill(
            target_config, target_params, cache, ids, num_new, head_rows=jnp.clip(offset, 0, chunk - 1), **impls
        )
        last = jnp.where(here[:, None], logits[:, 0], last)
        if draft_state is not None:
            draft_state = drafter.append(draft_state, features, num_new)
        return (cache, draft_state, last), None

    features = jax.eval_shape(
        lambda c, ids: target.prefill(target_config, target_params, c, ids, jnp.clip(lengths, 0, chunk), **impls)[1],
        cache,
        padded[:, :chunk],
    )
    init = (cache, draft_state, jnp.zeros((batch, target_config.vocab_size), jnp.float32))
    (cache, draft_state, last), _ = jax.lax.scan(one_chunk, init, jnp.arange(chunks, dtype=jnp.int32))
    return last, cache, draft_state, features


def start_state(
    target_config,
    target_params,
    drafter,
    prompts,
    prompt_lengths,
    sampling: SamplingParams,
    keys,
    stop_tokens,
    max_new,
    *,
    max_new_tokens: int,
    method: str,
    budget: int,
    block_size: int,
    cache_dtype=jnp.float32,
    options: DecodeOptions = DecodeOptions(),
) -> DecodeState:
    """`prefill`, then rows whose first token is a stop token or whose max_new <= 1 are marked done: the
    state the decode loop starts from (`generate`'s while_loop, `engine.host_loop`). A row whose request
    `check_generate_inputs` would refuse (traced inputs, which it cannot read: `request_rows_valid`) is an
    invalid row: its first token INVALID_TOKEN, done."""
    check_method(method)
    state = prefill(
        target_config,
        target_params,
        drafter,
        prompts,
        prompt_lengths,
        sampling,
        keys,
        max_new_tokens=max_new_tokens,
        method=method,
        budget=budget,
        block_size=block_size,
        cache_dtype=cache_dtype,
        options=options,
    )
    valid = request_rows_valid(target_config, prompts, prompt_lengths, max_new, max_new_tokens=max_new_tokens)
    bonus = jnp.where(valid, state.bonus, INVALID_TOKEN)
    first_stop = (bonus[:, None] == stop_tokens).any(1)
    return dataclasses.replace(
        state,
        bonus=bonus,
        output=state.output.at[:, 0].set(bonus),
        done=state.done | ~valid | first_stop | (max_new <= 1),
    )


def request_rows_valid(target_config, prompts, prompt_lengths, max_new, *, max_new_tokens: int) -> jax.Array:
    """bool [B]: the rows `check_generate_inputs` accepts, traceable: 1 <= prompt_lengths[b] <= T, the real prompt
    ids in [0, vocab), 1 <= max_new[b] <= max_new_tokens."""
    width = prompts.shape[1]
    real = jnp.arange(width)[None, :] < prompt_lengths[:, None]
    ids_ok = ~(real & ((prompts < 0) | (prompts >= target_config.vocab_size))).any(1)
    lengths_ok = (prompt_lengths >= 1) & (prompt_lengths <= width)
    return lengths_ok & ids_ok & (max_new >= 1) & (max_new <= max_new_tokens)


Recorder = Callable[[StepTrace, SamplingParams], dict]


def _decode_loop(
    traced_step, state, sampling, *, max_new_tokens: int, steps_per_iteration: int, recorder: Recorder | None
):
    """The while_loop over decode steps, from `state` until every row is done or max_new_tokens steps have run.

    traced_step(state) -> (the next DecodeState, the step's StepTrace): `traced_decode_step` with all but the
    state bound. Returns (the final state, records: what `recorder(trace, sampling)` returned at each step,
    [max_new_tokens, ...] per name; {} without a recorder)."""
    if recorder is None:
        records = {}
    else:  # the records' shapes from one abstract evaluation of the recorder on a step's trace
        trace_shape = jax.eval_shape(lambda s: traced_step(s)[1], state)
        shapes = jax.eval_shape(recorder, trace_shape, sampling)
        records = {name: jnp.zeros((max_new_tokens,) + sd.shape, sd.dtype) for name, sd in shapes.items()}

    def cond(carry):
        s, _ = carry
        return ~jnp.all(s.done) & (s.step < max_new_tokens)

    def one_step(s, rec):
        new, trace = traced_step(s)
        if recorder is not None:
            # a step after every row is done (steps_per_iteration > 1) records nothing
            live = jnp.any(trace.active)
            rec = {
                name: rec[name].at[s.step].set(jnp.where(live, value, rec[name][s.step]), mode="drop")
                for name, value in recorder(trace, sampling).items()
            }
        return new, rec

    def body(carry):
        # steps_per_iteration steps per host round trip; a finished row is frozen by the step itself
        # (active = ~done), so the steps past the last row's end change no output
        s, rec = carry
        for _ in range(steps_per_iteration):
            s, rec = one_step(s, rec)
        return s, rec

    return jax.lax.while_loop(cond, body, (state, records))


# generate's static keywords after target_config, in signature order
_SHAPE_KEYWORDS = ("max_new_tokens", "method", "budget", "block_size", "cache_dtype", "options")
_STATIC = ("target_config",) + _SHAPE_KEYWORDS


def _concrete(x) -> np.ndarray | None:
    """x as numpy when it is a concrete array (not traced, not an abstract shape), else None."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray, list, tuple)):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def check_generate_inputs(target_config, prompts, prompt_lengths, max_new, *, max_new_tokens: int) -> None:
    """Eager checks of `generate`'s inputs (ValueError naming the row and value); inputs that are traced or
    abstract (jax.ShapeDtypeStruct, e.g. under an outer jit or in `.lower`) are not checked.

    - 1 <= max_new[b] <= max_new_tokens (the static size the KV cache and the output are allocated for);
    - 1 <= prompt_lengths[b] <= T (the prompt's width);
    - the real prompt ids (the first prompt_lengths[b] of row b) lie in [0, target_config.vocab_size).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limits = _concrete(max_new)
    if limits is not None and limits.size and (limits > max_new_tokens).any():
        row = int(np.argmax(limits.reshape(-1) > max_new_tokens))
        raise ValueError(
            f"max_new[{row}] = {int(limits.reshape(-1)[row])} exceeds max_new_tokens = {max_new_tokens} "
            "(the static size of the KV cache and the output)"
        )
    if limits is not None and limits.size and (limits < 1).any():
        row = int(np.argmax(limits.reshape(-1) < 1))
        raise ValueError(f"max_new[{row}] = {int(limits.reshape(-1)[row])} must be >= 1 (the prefill emits one token)")
    ids, lengths = _concrete(prompts), _concrete(prompt_lengths)
    if lengths is None or ids is None or ids.ndim != 2:
        return
    width = ids.shape[1]
    if lengths.shape != (ids.shape[0],):
        raise ValueError(f"prompt_lengths must have shape [B] = ({ids.shape[0]},), got {lengths.shape}")
    bad = (lengths < 1) | (lengths > width)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"prompt_lengths[{row}] = {int(lengths[row])} is outside [1, T = {width}] (the prompt width)")
    vocab = int(target_config.vocab_size)
    real = np.arange(width)[None, :] < lengths[:, None]
    out = real & ((ids < 0) | (ids >= vocab))
    if out.any():
        row, pos = (int(i) for i in np.argwhere(out)[0])
        raise ValueError(f"prompts[{row}, {pos}] = {int(ids[row, pos])} is outside the vocabulary [0, {vocab})")


class _CheckedJit:
    """A jitted generation function behind eager input checks (`check_generate_inputs`, on concrete inputs
    only): calling it and `.lower(...)` take the jit's signature and run the same compiled program; every
    other attribute is the jit's. Top-level calls compile with `dispatch.loop_compiler_options` for the
    target's hidden size (one jit per distinct option set); a call traced inside another jit (or eval_shape)
    goes through the same function jitted without them (JAX takes compiler options on top-level jits only)."""

    def __init__(self, fun, static_argnames: tuple[str, ...]):
        self._fun, self._static_argnames = fun, static_argnames
        self._jitted = jax.jit(fun, static_argnames=static_argnames, compiler_options=dispatch.loop_compiler_options())
        self._by_options: dict = {}
        self._nested = jax.jit(fun, static_argnames=static_argnames)
        self._signature = inspect.signature(fun)
        functools.update_wrapper(self, fun)

    def _check(self, args, kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_options(
            a["method"],
            budget=a["budget"],
            block_size=a["block_size"],
            max_new_tokens=a["max_new_tokens"],
            drafter=a["drafter"],
            target_config=a["target_config"],
        )
        check_generate_inputs(
            a["target_config"], a["prompts"], a["prompt_lengths"], a["max_new"], max_new_tokens=a["max_new_tokens"]
        )
        return a["target_config"]

    def _top_level(self, target_config):
        options = dispatch.loop_compiler_options(hidden_size=getattr(target_config, "hidden_size", None))
        key = tuple(sorted(options.items()))
        if key not in self._by_options:
            self._by_options[key] = jax.jit(self._fun, static_argnames=self._static_argnames, compiler_options=options)
        return self._by_options[key]

    def __call__(self, *args, **kwargs):
        target_config = self._check(args, kwargs)
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs)))
        return (self._nested if traced else self._top_level(target_config))(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._top_level(self._check(args, kwargs)).lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


def layers_sliced_once(target_config, target_params, drafter, options: DecodeOptions):
    """(target_params, drafter) with their stacked layer weights split into per-layer arrays
    (`models.layers.unstack_layers`), for the models that loop over their layers in Python: the Qwen3
    target under the unrolled layer loop, the DFlash drafter. Called before the decode loop, so the
    slices run once per generation instead of as copy kernels in every step; a scanned target (and
    DeepSeek-V3 / K2, whose MoE layers read their stacked experts in place) keeps its stacks."""
    if isinstance(target_config, Qwen3Config) and options.layer_loop in ("auto", "unrolled"):
        layers = unstack_layers(target_params["layers"], target_config.num_layers)
        target_params = {**target_params, "layers": layers}
    if isinstance(drafter, DFlashDrafter):
        layers = unstack_layers(drafter.params["layers"], drafter.config.num_layers)
        drafter = dataclasses.replace(drafter, params={**drafter.params, "layers": layers})
    return target_params, drafter


def generation_result(state: DecodeState) -> GenerationResult:
    """The GenerationResult of a decode loop's final DecodeState (B rows): its output int32 [B, max_new_tokens],
    num_generated, steps, accepted int32 [B]."""
    return GenerationResult(state.output, state.num_generated, state.steps, state.accepted)


def _generate(target_config, target_params, drafter, request: tuple, statics: tuple, *, recorder):
    """The body of `generate` and `generate_recorded`: `start_state`, then the decode loop. request:
    (prompts, prompt_lengths, sampling, keys, stop_tokens, max_new); statics: the static keywords' values in
    `_SHAPE_KEYWORDS` order. Returns (GenerationResult, records)."""
    _, _, sampling, keys, stop_tokens, max_new = request
    shape = dict(zip(_SHAPE_KEYWORDS, statics, strict=True))
    options = shape["options"]
    target_params, drafter = layers_sliced_once(target_config, target_params, drafter, options)
    state = start_state(target_config, target_params, drafter, *request, **shape)
    step_keywords = {k: v for k, v in shape.items() if k not in ("max_new_tokens", "cache_dtype")}

    def traced_step(s: DecodeState) -> tuple[DecodeState, StepTrace]:
        return traced_decode_step(
            target_config, target_params, drafter, s, sampling, keys, stop_tokens, max_new, **step_keywords
        )

    state, records = _decode_loop(
        traced_step,
        state,
        sampling,
        max_new_tokens=shape["max_new_tokens"],
        steps_per_iteration=options.steps_per_iteration,
        recorder=recorder,
    )
    return generation_result(state), records


def _checked(static_argnames: tuple[str, ...]):
    return lambda fun: _CheckedJit(fun, static_argnames)


@_checked(_STATIC)
def generate(
    target_config,
    target_params,
    drafter,
    prompts,
    prompt_lengths,
    sampling: SamplingParams,
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
):
    """Generates up to max_new[b] <= max_new_tokens tokens per row, as one compiled program.

    Args:
      prompts int32 [B, T] (row b's first prompt_lengths[b] real); sampling: SamplingParams [B];
      keys: typed PRNG keys [B], one per request; stop_tokens int32 [B, K] (-1 = unused); max_new int32 [B].
      method / budget / block_size: the decode method (`options.METHODS`), DDTree's node budget, the
        drafter's block size.
      options: how the step runs (`DecodeOptions`: attention, matmul, MoE, verification kernel, layer loop,
        sibling order, verifier); every "auto" is resolved by `ddtree_jax.dispatch` (`decode_plan` lists
        the choices).
    Returns:
      GenerationResult. A row stops at its first stop token (kept) or at max_new[b] tokens.

    Raises:
      ValueError (`check_generate_inputs`, concrete inputs only): max_new[b] outside [1, max_new_tokens],
      prompt_lengths[b] outside [1, T], a real prompt id outside the vocabulary. Under an outer jit, where
      they cannot be read, such a row is an invalid row instead (`request_rows_valid`: tokens INVALID_TOKEN).
    """
    request = (prompts, prompt_lengths, sampling, keys, stop_tokens, max_new)
    statics = (max_new_tokens, method, budget, block_size, cache_dtype, options)
    return _generate(target_config, target_params, drafter, request, statics, recorder=None)[0]


@_checked(_STATIC + ("recorder",))
def generate_recorded(
    target_config,
    target_params,
    drafter,
    prompts,
    prompt_lengths,
    sampling: SamplingParams,
    keys,
    stop_tokens,
    max_new,
    *,
    recorder: Recorder,
    max_new_tokens: int,
    method: str = "ddtree",
    budget: int = 32,
    block_size: int = 8,
    cache_dtype=jnp.float32,
    options: DecodeOptions = DecodeOptions(),
):
    """`generate` (same arguments, same tokens) that also records, at every decode step s, what
    `recorder(trace, sampling)` returns (a dict of arrays, e.g. [B] per row) from the step's `StepTrace`.
    recorder: a static, hashable function (a module-level def). Returns (GenerationResult, records: dict
    name -> [max_new_tokens, ...], zeros after the last step)."""
    request = (prompts, prompt_lengths, sampling, keys, stop_tokens, max_new)
    statics = (max_new_tokens, method, budget, block_size, cache_dtype, options)
    return _generate(target_config, target_params, drafter, request, statics, recorder=recorder)
