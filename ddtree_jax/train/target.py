"""Training the Qwen3-architecture target LM: next-token cross-entropy, AdamW with warm-up + cosine.

Parameters stay float32 (the master copy the optimizer updates); `dtype: bfloat16` runs the forward
and backward in bfloat16 (logits and the loss in float32). Held-out evaluation (always float32, as
the exported weights run) reports the mean token cross-entropy and its perplexity. Orbax checkpoints
of (params, optimizer state, step) every `checkpoint_every` steps allow `resume`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.config import Qwen3Config
from ddtree_jax.models import qwen3
from ddtree_jax.train.common import (
    DTYPES,
    apply_gradients,
    cast,
    new_train_state,
    on_device,
    optimizer,
    run_training,
)
from ddtree_jax.train.data import Batches, eval_batches

MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "max_position_embeddings",
)


def model_config(model_cfg: dict, vocab_size: int) -> Qwen3Config:
    unknown = set(model_cfg) - set(MODEL_KEYS)
    if unknown:
        raise ValueError(f"unknown target model settings {sorted(unknown)}")
    return Qwen3Config(vocab_size=vocab_size, **model_cfg)


def token_nll(config: Qwen3Config, params: dict, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
    """float32 [B, T - 1]: -log p(tokens[:, t + 1] | tokens[:, :t + 1])."""
    logits = qwen3.forward_logits(config, cast(params, dtype), tokens, attn_impl="xla")  # differentiable reference
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def lm_loss(config: Qwen3Config, params: dict, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
    return token_nll(config, params, tokens, dtype).mean()


def make_step(config: Qwen3Config, settings: dict, dtype):
    """The jitted train step(state, tokens) -> (state, metrics); cached per (config, settings, dtype)."""
    return _make_step(config, tuple(sorted(settings.items())), dtype)


@functools.lru_cache(maxsize=8)
def _make_step(config: Qwen3Config, settings_items: tuple, dtype):
    tx = optimizer(dict(settings_items))

    def step(state, tokens):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(config, p, tokens, dtype))(state["params"])
        return apply_gradients(tx, state, grads), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0,))


def evaluate(config: Qwen3Config, params: dict, batches: list[np.ndarray], dtype=jnp.float32) -> float:
    """Mean token cross-entropy (nats) over the batches."""
    fn = _eval_fn(config, dtype)
    total, count = 0.0, 0
    for batch in batches:
        total += float(fn(params, jnp.asarray(batch)))
        count += batch.shape[0] * (batch.shape[1] - 1)
    return total / count


@functools.lru_cache(maxsize=8)
def _eval_fn(config, dtype):
    return jax.jit(lambda params, tokens: token_nll(config, params, tokens, dtype).sum())


def init_state(config: Qwen3Config, settings: dict, seed: int) -> dict:
    """Random float32 parameters (key(seed)), the optimizer state, step 0 (one compiled program, cached)."""
    return on_device(_init_fn(config, tuple(sorted(settings.items())))(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _init_fn(config: Qwen3Config, settings_items: tuple):
    tx = optimizer(dict(settings_items))

    def init(key):
        return new_train_state(tx, qwen3.init_params(config, key, jnp.float32))

    return jax.jit(init)


def train(
    config: Qwen3Config,
    settings: dict,
    train_seqs: np.ndarray,
    heldout_seqs: np.ndarray,
    *,
    seed: int,
    checkpoint_dir: str | None = None,
    log_path: str | None = None,
    resume: bool = False,
    show_progress: bool = True,
) -> tuple[dict, dict]:
    """Trains the target; returns (float32 params, results for the provenance file)."""
    dtype = DTYPES[settings["dtype"]]
    steps, batch_size = settings["steps"], settings["batch_size"]
    batches = Batches(train_seqs, batch_size, seed)
    heldout = eval_batches(heldout_seqs, batch_size, settings["eval_batches"])
    train_eval = eval_batches(train_seqs, batch_size, settings["eval_batches"])
    step_fn = make_step(config, settings, dtype)

    def periodic_eval(state):
        held = evaluate(config, state["params"], heldout)
        return (
            {"heldout_loss": held, "heldout_ppl": math.exp(held)},
            {"heldout_loss": held},
            f"held-out loss {held:.4f} (ppl {math.exp(held):.2f})",
        )

    run = run_training(
        "target",
        init_state(config, settings, seed),
        lambda s, i: step_fn(s, jnp.asarray(batches.batch(i))),
        settings=settings,
        evaluate=periodic_eval,
        checkpoint_dir=checkpoint_dir,
        log_path=log_path,
        resume=resume,
        show_progress=show_progress,
        resumed_entry=_resumed_entry,
    )
    params = run.state["params"]
    held = evaluate(config, params, heldout)
    train_eval_loss = evaluate(config, params, train_eval)
    last_train = next((h["train_loss"] for h in reversed(run.history) if "train_loss" in h), None)
    if run.log:
        run.log.write(step=steps, heldout_loss=held, heldout_ppl=math.exp(held), train_eval_loss=train_eval_loss)
    results = run.results(
        settings,
        seq_len=int(train_seqs.shape[1]),
        tokens_seen=steps * batch_size * int(train_seqs.shape[1]),
        epochs=round(batches.epochs(steps), 3),
        settings=settings,
        final_train_loss=last_train,
        train_eval_loss=train_eval_loss,
        heldout_loss=held,
        heldout_ppl=math.exp(held),
        heldout_eval_tokens=int(sum(b.shape[0] * (b.shape[1] - 1) for b in heldout)),
    )
    return params, results


def _resumed_entry(record: dict) -> dict | None:
    """The history entry of a log record of the steps a resumed run skips: train loss or held-out loss (not the
    final evaluation's record)."""
    if "loss" in record:
        return {"step": record["step"], "train_loss": record["loss"]}
    if "heldout_loss" in record and "train_eval_loss" not in record:
        return {"step": record["step"], "heldout_loss": record["heldout_loss"]}
    return None


def with_tapped(config: Qwen3Config, layers) -> Qwen3Config:
    return dataclasses.replace(config, tapped_layers=tuple(sorted(layers)))
