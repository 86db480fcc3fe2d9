"""Generation from HF checkpoint directories (or a random tiny pair), with timing: what the
`ddtree-jax generate` command runs. Compilation is timed apart from generation, and compiled
programs persist across runs in a JAX compilation cache."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checkpoint import Tokenizer, load_hf, load_tokenizer
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.generate import generate
from ddtree_jax.models import dflash, qwen3, target_module
from ddtree_jax.sampling import SamplingParams, row_keys

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


def load_pair(target_dir: str, drafter_dir: str | None, dtype=jnp.float32) -> Pair:
    """Target + DFlash drafter from HF directories; the target's tapped layers come from the drafter. The
    tokenizer is the target directory's (tokenizer.json or tiktoken.model; None without either)."""
    tokenizer = load_tokenizer(target_dir)  # first: a malformed tokenizer fails before the weights load
    target_config, target_params = load_hf(target_dir, dtype)
    if isinstance(target_config, DFlashConfig):
        raise ValueError(f"{target_dir} holds a drafter config, not a target")
    target = target_module(target_config)
    drafter = None
    if drafter_dir:
        drafter_config, drafter_params = load_hf(drafter_dir, dtype)
        if not isinstance(drafter_config, DFlashConfig):
            raise ValueError(f"{drafter_dir} is not a DFlash drafter (no dflash_config)")
        target_config = dataclasses.replace(target_config, tapped_layers=drafter_config.target_layers)
        drafter = DFlashDrafter(drafter_config, drafter_params, target.embedding(target_params), target.head(target_config, target_params))
    return Pair(target_config, target_params, drafter, tokenizer)


def random_tiny_pair(seed: int = 0, vocab: int = 512) -> Pair:
    """A random tiny target + drafter (no checkpoint): for smoke runs of the machinery, not acceptance."""
    target_config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                                num_kv_heads=2, head_dim=16, tapped_layers=(1, 2))
    drafter_config = DFlashConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                                  head_dim=16, block_size=8, mask_token_id=vocab - 1, target_layers=(1, 2))
    keys = jax.random.split(jax.random.key(seed))
    target_params = qwen3.init_params(target_config, keys[0])
    drafter = DFlashDrafter(drafter_config, dflash.init_params(drafter_config, 64, keys[1]), qwen3.embedding(target_params),
                            qwen3.head(target_config, target_params))
    return Pair(target_config, target_params, drafter)


def run(pair: Pair, prompt_ids: list[list[int]], *, method: str, budget: int, block_size: int | None, max_new_tokens: int,
        temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, order: str = "draft",
        stop_tokens: list[int] = (), repeats: int = 1) -> dict:
    """Compiles once, then generates `repeats` times; returns tokens, tau and timings (seconds)."""
    if method != "ar" and pair.drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    block = block_size or (pair.drafter.config.block_size if pair.drafter else 2)
    batch = len(prompt_ids)
    width = max(len(p) for p in prompt_ids)
    prompts = np.zeros((batch, width), np.int32)
    for b, p in enumerate(prompt_ids):
        prompts[b, : len(p)] = p
    args = (
        pair.target_config, pair.target_params, pair.drafter, jnp.asarray(prompts),
        jnp.asarray([len(p) for p in prompt_ids], jnp.int32),
        SamplingParams.create(batch, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        row_keys(jax.random.key(seed), jnp.arange(batch)),
        jnp.asarray([list(stop_tokens) or [-1]] * batch, jnp.int32),
        jnp.full((batch,), max_new_tokens, jnp.int32),
    )
    static = dict(max_new_tokens=max_new_tokens, method=method, budget=budget, block_size=block, order=order)
    start = time.perf_counter()
    compiled = generate.lower(*args, **static).compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args[1:]))  # the static target_config is baked in
        times.append(time.perf_counter() - start)
    tokens = np.asarray(result.tokens)
    n = np.asarray(result.num_generated)
    run_s = float(np.median(times))
    return {
        "method": method, "budget": budget if method == "ddtree" else None, "block_size": block,
        "tokens": [tokens[b, : n[b]].tolist() for b in range(batch)],
        "tau": float(np.asarray(result.tau).mean()), "steps": int(np.asarray(result.steps).max()),
        "compile_s": compile_s, "run_s": run_s, "tokens_per_s": float(n.sum() / run_s),
    }
