"""Generation from HF checkpoint directories (or a random tiny pair), with timing: what the
`ddtree-jax generate` and `bench` commands run. Compilation is timed apart from generation, and
compiled programs persist across runs in a JAX compilation cache. Requests are checked first
(`check_request`: budget, block size, prompts, lengths; `check_pair`: target / drafter shapes), so
bad input raises a ValueError naming the value, from Python as from the CLI."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import dispatch
from ddtree_jax.checkpoint import Tokenizer, load_tokenizer
from ddtree_jax.checkpoint.child_head import load_child_head
from ddtree_jax.checkpoint.hf_config import parse_config, read_config
from ddtree_jax.checkpoint.hf_weights import load_weights
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.progress import progress_bar
from ddtree_jax.models import dflash, qwen3, target_module
from ddtree_jax.options import METHODS, DecodeOptions, check_options
from ddtree_jax.presets import preset_pair
from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams, row_keys

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ddtree_jax", "xla")


def enable_compilation_cache(path: str | None = DEFAULT_CACHE_DIR) -> None:
    if path:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class Pair:
    target_config: Qwen3Config | DeepSeekV3Config
    target_params: dict
    drafter: DFlashDrafter | None
    tokenizer: Tokenizer | None = None


def pair_dtype(pair: Pair):
    """The float dtype the pair's weights were loaded in (its target's embedding): the KV caches' dtype."""
    return target_module(pair.target_config).embedding(pair.target_params).dtype


def generate_static(
    pair: Pair, *, method: str, budget: int, block_size: int, max_new_tokens: int, options: DecodeOptions
) -> dict:
    """`generate`'s static keywords for a request on `pair`: the shape, the options, and KV caches in the
    weights' dtype (`pair_dtype`)."""
    return dict(
        max_new_tokens=max_new_tokens,
        method=method,
        budget=budget,
        block_size=block_size,
        cache_dtype=pair_dtype(pair),
        options=options,
    )


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_CHOICES = dispatch.WEIGHT_DTYPES  # the --dtype choices of the CLI and benchmarks: "auto" or a DTYPES name


def load_dtype(name: str):
    """The `load_pair` dtype for a --dtype choice (`dispatch.weights_dtype`): a DTYPES value, or "auto"
    (each checkpoint's stored dtype, `checkpoint.hf_weights.resolve_dtype`)."""
    choice = dispatch.weights_dtype(name)
    return "auto" if choice == "checkpoint" else DTYPES[choice]


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>", "<|end|>")


def _check_directory(path: str, role: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"{role} directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{role} path {path!r} is not a directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{role} directory {path!r} has no config.json")


def check_configs(target_config, drafter_config: DFlashConfig, drafter_vocab: int | None = None) -> None:
    """What a DFlash drafter needs from its target: the same hidden size (it runs on the target's
    embedding and LM head, [V, D]), tapped layers the target has, its mask token inside the target's
    vocabulary, and the same vocabulary size when its config.json states one. ValueError otherwise."""
    if drafter_config.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"drafter hidden_size {drafter_config.hidden_size} != target hidden_size "
            f"{target_config.hidden_size} (the drafter runs on the target's embedding and LM head)"
        )
    if drafter_vocab is not None and drafter_vocab != target_config.vocab_size:
        raise ValueError(f"drafter vocab_size {drafter_vocab} != target vocab_size {target_config.vocab_size}")
    if not 0 <= drafter_config.mask_token_id < target_config.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {drafter_config.mask_token_id} is outside the target vocabulary "
            f"[0, {target_config.vocab_size})"
        )
    bad = [l for l in drafter_config.target_layers if not 0 <= l < target_config.num_layers]
    if bad:
        raise ValueError(f"drafter target_layers {bad} are outside the target's {target_config.num_layers} layers")


def check_pair(pair: Pair) -> None:
    """`check_configs` for a built pair, plus the shapes a DFlashDrafter holds: embedding and LM head
    [target vocab_size, hidden_size], fc [hidden_size, F * target hidden_size]. Other drafters (e.g. an
    oracle) bring their own contract and are not checked."""
    drafter, config = pair.drafter, pair.target_config
    if not isinstance(drafter, DFlashDrafter):
        return
    check_configs(config, drafter.config)
    expected = (config.vocab_size, config.hidden_size)
    for name in ("embed", "lm_head"):
        shape = tuple(getattr(drafter, name).shape)
        if shape != expected:
            raise ValueError(
                f"drafter {name} has shape {shape}, expected [target vocab_size, hidden_size] = {expected}"
            )
    fc = tuple(drafter.params["fc"].shape)
    want = (drafter.config.hidden_size, len(drafter.config.target_layers) * config.hidden_size)
    if fc != want:
        raise ValueError(
            f"drafter fc has shape {fc}, expected {want} ({len(drafter.config.target_layers)} tapped "
            f"layers of hidden size {config.hidden_size})"
        )


def check_request(
    pair: Pair,
    prompt_ids,
    *,
    method: str,
    budget: int | None = None,
    block_size: int | None = None,
    max_new_tokens: int = 1,
) -> None:
    """Pair-level checks of a generation request (`run`, `benchmark` and the profiler call it):
    `check_options`, non-empty prompts of ids inside the target vocabulary, prompt + max_new_tokens
    within the target's max_position_embeddings (when its config has one), and `check_pair`.
    ValueError naming the bad value."""
    check_options(
        method,
        budget=budget,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        drafter=pair.drafter,
        target_config=pair.target_config,
    )
    if not prompt_ids:
        raise ValueError("no prompts given")
    config = pair.target_config
    limit = getattr(config, "max_position_embeddings", None)
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [int(t) for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the target vocabulary [0, {config.vocab_size})")
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens) + max_new_tokens {max_new_tokens} = "
                f"{len(prompt) + max_new_tokens} exceeds the target's max_position_embeddings {limit}"
            )
    check_pair(pair)


def load_pair(
    target_dir: str,
    drafter_dir: str | None,
    dtype=jnp.float32,
    *,
    check_finite: bool = False,
    child_head_dir: str | None = None,
) -> Pair:
    """Target + DFlash drafter from HF directories; the target's tapped layers come from the drafter. The
    tokenizer is the target directory's (tokenizer.json or tiktoken.model; None without either).
    Both configs are read and checked against each other (`check_configs`) before any weight loads.
    check_finite: `load_weights`' check that every floating-point tensor of both checkpoints (and of the child
    head) is finite
    (CheckpointError naming the tensor and file otherwise; the CLI turns it on). dtype "auto": the target
    checkpoint's stored dtype, for both (`load_dtype`). child_head_dir: a path-conditioned child head
    (`checkpoint.child_head`, the `child_head` training stage) attached to the drafter: DDTree steps then build
    path-conditioned trees."""
    _check_directory(target_dir, "target")
    if drafter_dir:
        _check_directory(drafter_dir, "drafter")
    tokenizer = load_tokenizer(target_dir)  # first: a malformed tokenizer fails before the weights load
    target_config = parse_config(read_config(target_dir))
    if isinstance(target_config, DFlashConfig):
        raise ValueError(f"{target_dir} holds a drafter config, not a target")
    drafter_config = None
    if drafter_dir:
        raw = read_config(drafter_dir)
        drafter_config = parse_config(raw)
        if not isinstance(drafter_config, DFlashConfig):
            raise ValueError(f"{drafter_dir} is not a DFlash drafter (no dflash_config)")
        check_configs(target_config, drafter_config, raw.get("vocab_size"))
        target_config = dataclasses.replace(target_config, tapped_layers=drafter_config.target_layers)
    target_params = load_weights(target_dir, target_config, dtype, check_finite=check_finite)
    target = target_module(target_config)
    drafter = None
    if drafter_config is not None:
        dtype = target.embedding(target_params).dtype  # "auto" resolved by the target: one dtype for the pair
        drafter_params = load_weights(drafter_dir, drafter_config, dtype, check_finite=check_finite)
        drafter = DFlashDrafter(
            drafter_config, drafter_params, target.embedding(target_params), target.head(target_config, target_params)
        )
        if child_head_dir:
            head_config, head_params = load_child_head(child_head_dir, dtype, check_finite=check_finite)
            drafter = drafter.with_head(head_config, head_params)
    elif child_head_dir:
        raise ValueError("a child head needs a drafter (drafter_dir)")
    pair = Pair(target_config, target_params, drafter, tokenizer)
    check_pair(pair)
    return pair


def random_tiny_pair(seed: int = 0, vocab: int = 512) -> Pair:
    """A random tiny target + drafter (no checkpoint): for smoke runs of the machinery, not acceptance."""
    target_config, drafter_config = preset_pair("qwen3-tiny")
    target_config = dataclasses.replace(target_config, vocab_size=vocab)
    drafter_config = dataclasses.replace(drafter_config, mask_token_id=vocab - 1)
    keys = jax.random.split(jax.random.key(seed))
    target_params = qwen3.init_params(target_config, keys[0])
    drafter = DFlashDrafter(
        drafter_config,
        dflash.init_params(drafter_config, target_config.hidden_size, keys[1]),
        qwen3.embedding(target_params),
        qwen3.head(target_config, target_params),
    )
    return Pair(target_config, target_params, drafter)


def chat_stop_tokens(tokenizer: Tokenizer | None) -> list[int]:
    """Where a chat answer ends: the tokenizer's eos ids (`Tokenizer.eos_token_ids`: its eos token and every
    `eos_token_id` of config.json / generation_config.json, as HF `generate` stops) and the end-of-turn special
    tokens it has (`<|im_end|>` and kin, END_OF_TURN_TOKENS), deduplicated, in that order."""
    if tokenizer is None:
        return []
    eos = list(tokenizer.eos_token_ids) or [tokenizer.eos_token_id]
    found = eos + [tokenizer.special_tokens.get(name) for name in END_OF_TURN_TOKENS]
    return list(dict.fromkeys(t for t in found if t is not None))


def resolve_block_size(pair: Pair, method: str, block_size: int | None) -> int:
    """The block size a method runs with: the given one, else the drafter's (2 for AR, unused)."""
    if method == "ar":
        return block_size or (pair.drafter.max_block_size if pair.drafter else 2)
    return block_size or pair.drafter.max_block_size


def check_seed(seed) -> int:
    """A seed must be an integer in [0, 2^32): JAX's key takes it modulo 2^32, so 2^32 + 1 would silently
    give seed 1's keys. Raises ValueError naming the value."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2^32), got {seed!r}")
    return int(seed)


def check_repeats(repeats) -> int:
    """Timed runs after compilation: an integer >= 1 (0 or a negative count would time nothing). Raises
    ValueError naming the value."""
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    return int(repeats)


def request_args(
    pair: Pair,
    prompt_ids: list[list[int]],
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    stop_tokens=(),
    max_new_tokens: int,
    width: int | None = None,
    request_ids=None,
) -> tuple:
    """`generate`'s positional arguments for a batch of prompts (right-padded to `width`, default the
    longest), with one key per request (`request_ids`, default 0 .. B - 1) folded from `seed` (an integer in
    [0, 2^32): a larger one would wrap onto another seed's keys without a word, so it is refused)."""
    check_seed(seed)
    batch = len(prompt_ids)
    width = width or max(len(p) for p in prompt_ids)
    prompts = np.zeros((batch, width), np.int32)
    for b, p in enumerate(prompt_ids):
        prompts[b, : len(p)] = p
    request_ids = jnp.arange(batch) if request_ids is None else jnp.asarray(request_ids)
    return (
        pair.target_config,
        pair.target_params,
        pair.drafter,
        jnp.asarray(prompts),
        jnp.asarray([len(p) for p in prompt_ids], jnp.int32),
        SamplingParams.create(batch, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        row_keys(jax.random.key(seed), request_ids),
        jnp.asarray([list(stop_tokens) or [-1]] * batch, jnp.int32),
        jnp.full((batch,), max_new_tokens, jnp.int32),
    )


def checked_request_args(
    pair: Pair, prompt_ids, *, method: str, budget: int | None, block_size: int | None, max_new_tokens: int, **sampling
) -> tuple[int, tuple]:
    """Checks a generation request (`check_request`), then returns (the block size it runs with,
    `resolve_block_size`; `generate`'s positional arguments, `request_args`). sampling: `request_args`' other
    keywords (temperature, top_k, top_p, min_p, seed, stop_tokens, width, request_ids)."""
    check_request(pair, prompt_ids, method=method, budget=budget, block_size=block_size, max_new_tokens=max_new_tokens)
    block = resolve_block_size(pair, method, block_size)
    return block, request_args(pair, prompt_ids, max_new_tokens=max_new_tokens, **sampling)


def _compile(args: tuple, static: dict):
    start = time.perf_counter()
    compiled = generate.lower(*args, **static).compile()
    seconds = time.perf_counter() - start
    check_fits(compiled, prompt_tokens=int(args[3].shape[1]), batch=int(args[3].shape[0]), static=static)
    return compiled, seconds


def check_fits(compiled, *, prompt_tokens: int, batch: int, static: dict, free_bytes: int | None = None) -> None:
    """ValueError, before anything runs, when a compiled generation needs more device memory than is free:
    its temporary and output buffers (`memory_analysis`; the weights, already on the device, are counted as
    in use) against the device's bytes_limit - bytes_in_use (`free_bytes` overrides; devices without
    memory stats, e.g. the CPU, are not checked)."""
    if free_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return
        free_bytes = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    need = analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    if need > free_bytes:
        raise ValueError(
            f"the generation ({batch} row(s) x {prompt_tokens} prompt tokens + max_new_tokens "
            f"{static['max_new_tokens']}, {_column_name(static['method'], static.get('budget') if static['method'] == 'ddtree' else None)}) needs {need / 1e9:.2f} GB of device memory beyond "
            f"the weights, and {free_bytes / 1e9:.2f} GB is free: use a shorter prompt, fewer new tokens or "
            "rows, or a smaller --prefill-chunk"
        )


def _timed(compiled, args: tuple, repeats: int):
    """Runs a compiled generation `repeats` (>= 1, `check_repeats`) times: (last result, median seconds)."""
    times = []
    for _ in range(check_repeats(repeats)):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args[1:]))  # the static target_config is baked in
        times.append(time.perf_counter() - start)
    return result, float(np.median(times))


def run(
    pair: Pair,
    prompt_ids: list[list[int]],
    *,
    method: str,
    budget: int,
    block_size: int | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    stop_tokens: list[int] = (),
    repeats: int = 1,
    options: DecodeOptions = DecodeOptions(),
) -> dict:
    """Compiles once, then generates `repeats` times; returns tokens, tau, timings (seconds) and invalid_rows (the
    rows whose tokens hold INVALID_TOKEN: the run marked them invalid, e.g. for non-finite logits).
    Checks the request first (`check_request`, `check_repeats`); options: how the step runs (`DecodeOptions`)."""
    check_repeats(repeats)
    block, args = checked_request_args(
        pair,
        prompt_ids,
        method=method,
        budget=budget,
        block_size=block_size,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        stop_tokens=stop_tokens,
        max_new_tokens=max_new_tokens,
    )
    batch = len(prompt_ids)
    static = generate_static(
        pair, method=method, budget=budget, block_size=block, max_new_tokens=max_new_tokens, options=options
    )
    compiled, compile_s = _compile(args, static)
    result, run_s = _timed(compiled, args, repeats)
    tokens = np.asarray(result.tokens)
    n = np.asarray(result.num_generated)
    rows = [tokens[b, : n[b]].tolist() for b in range(batch)]
    return {
        "method": method,
        "budget": budget if method == "ddtree" else None,
        "block_size": block,
        "tokens": rows,
        # rows the run marked invalid (their tokens INVALID_TOKEN: e.g. non-finite logits), not text to decode
        "invalid_rows": [b for b, row in enumerate(rows) if INVALID_TOKEN in row],
        "tau": float(np.asarray(result.tau).mean()),
        "steps": int(np.asarray(result.steps).max()),
        "compile_s": compile_s,
        "run_s": run_s,
        "tokens_per_s": float(n.sum() / run_s),
    }


def _column_name(method: str, budget: int | None) -> str:
    return method + ("" if budget is None else f" {budget}")


def bench_columns(budgets, methods=METHODS) -> list[tuple[str, int | None]]:
    """The benchmark's columns: AR, the DFlash chain, then one DDTree column per budget."""
    columns = [(m, None) for m in ("ar", "chain") if m in methods]
    if "ddtree" in methods:
        columns += [("ddtree", int(b)) for b in budgets]
    return columns


def benchmark(
    pair: Pair,
    prompt_ids: list[list[int]],
    *,
    budgets=(32,),
    block_size: int | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    stop_tokens=(),
    repeats: int = 1,
    methods=METHODS,
    progress: bool = False,
    options: DecodeOptions = DecodeOptions(),
) -> list[dict]:
    """AR vs DFlash chain vs DDTree (one column per budget) on the same prompts, one prompt at a time.

    Every prompt is padded to the longest, so each column compiles once (compile_s); prompt i runs with
    request key i of `seed` in every column (so greedy columns emit the same text). Per column:
    tokens_per_s (all generated tokens / the summed median run times), mean_tau (over prompts),
    speedup (tokens_per_s over AR's; None without an AR column), and per_prompt details.
    """
    check_repeats(repeats)
    columns = bench_columns(budgets, methods)
    for method, budget in columns:  # every request is checked before anything compiles
        check_request(
            pair, prompt_ids, method=method, budget=budget, block_size=block_size, max_new_tokens=max_new_tokens
        )
    width = max(len(p) for p in prompt_ids)
    common = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        stop_tokens=stop_tokens,
        max_new_tokens=max_new_tokens,
        width=width,
    )
    # every column compiled (and checked to fit the device's free memory, `check_fits`) before any is timed: a
    # column that does not fit fails at once, not after the others' timings
    bar = progress_bar(len(columns) * (len(prompt_ids) + 1), "bench", progress)
    compiled_columns = []
    try:
        for method, budget in columns:
            block = resolve_block_size(pair, method, block_size)
            static = generate_static(
                pair,
                method=method,
                budget=budget or 1,
                block_size=block,
                max_new_tokens=max_new_tokens,
                options=options,
            )
            bar.set_description(f"{_column_name(method, budget)}: compile")
            compiled_columns.append(
                (
                    method,
                    budget,
                    block,
                    *_compile(request_args(pair, prompt_ids[:1], request_ids=[0], **common), static),
                )
            )
            bar.update(1)
    except BaseException:
        bar.close()
        raise
    rows = []
    try:
        for method, budget, block, compiled, compile_s in compiled_columns:
            per_prompt = []
            for i, prompt in enumerate(prompt_ids):
                bar.set_description(f"{_column_name(method, budget)}: prompt {i}")
                result, run_s = _timed(compiled, request_args(pair, [prompt], request_ids=[i], **common), repeats)
                n = int(np.asarray(result.num_generated)[0])
                tokens = np.asarray(result.tokens)[0, :n].tolist()
                per_prompt.append(
                    {
                        "prompt": i,
                        "prompt_tokens": len(prompt),
                        "num_tokens": n,
                        "run_s": run_s,
                        "tokens_per_s": n / run_s,
                        "tau": float(np.asarray(result.tau)[0]),
                        "steps": int(np.asarray(result.steps)[0]),
                        "tokens": tokens,
                        "invalid": INVALID_TOKEN in tokens,  # the run marked the row invalid (e.g. non-finite logits)
                    }
                )
                bar.update(1)
            run_s = sum(p["run_s"] for p in per_prompt)
            num_tokens = sum(p["num_tokens"] for p in per_prompt)
            rows.append(
                {
                    "method": method,
                    "budget": budget,
                    "block_size": None if method == "ar" else block,
                    "tokens_per_s": num_tokens / run_s,
                    "mean_tau": float(np.mean([p["tau"] for p in per_prompt])),
                    "speedup": None,
                    "compile_s": compile_s,
                    "run_s": run_s,
                    "num_tokens": num_tokens,
                    "per_prompt": per_prompt,
                }
            )
    finally:
        bar.close()
    ar = next((r for r in rows if r["method"] == "ar"), None)
    for row in rows:
        if ar is not None:
            row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"]
            row["same_text_as_ar"] = all(
                p["tokens"] == q["tokens"] for p, q in zip(row["per_prompt"], ar["per_prompt"])
            )
    return rows
