"""Training the DFlash drafter against the frozen target (arXiv 2602.06036, Sec. "training"):

- per sequence, `num_anchors` distinct random anchor positions a in [1, T - block_size];
- block = [token a, MASK x (block_size - 1)] at positions a .. a + block_size - 1, bidirectional inside
  the block, blocks independent of each other;
- the drafter sees the target's tapped hidden states of the context strictly before the anchor
  (`dflash.train_logits` builds that mask);
- block position k (1 .. block_size - 1) predicts the true token a + k; the loss is the cross-entropy
  weighted by w_k = exp(-(k - 1) / gamma) (the paper's Eq. 4 decay; gamma = 7 for block 16, 5 for 10,
  4 for 8), normalised by the sum of the weights;
- the target's embedding and LM head are used, frozen (they are not in the trained tree), and the
  target runs without gradients.

Metrics per block position: cross-entropy and top-1 accuracy against the data tokens, and the mean
length of the accepted prefix of the greedy chain (1 + leading correct positions), a proxy for the
acceptance length of linear DFlash when the target's greedy choice is the data token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.config import DFlashConfig, Qwen3Config, default_tapped_layers
from ddtree_jax.models import dflash, qwen3
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
from ddtree_jax.train.target import with_tapped

MODEL_KEYS = (
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "target_layers",
    "rms_norm_eps",
    "rope_theta",
)
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def model_config(model_cfg: dict, target: Qwen3Config, mask_token_id: int) -> DFlashConfig:
    """The drafter config: hidden size and RoPE from the target; target_layers default to DFlash's
    rule (one tapped layer per drafter layer)."""
    unknown = set(model_cfg) - set(MODEL_KEYS)
    if unknown:
        raise ValueError(f"unknown drafter model settings {sorted(unknown)}")
    cfg = dict(model_cfg)
    layers = cfg.pop("target_layers", None) or default_tapped_layers(target.num_layers, cfg["num_layers"])
    layers = tuple(sorted(int(l) for l in layers))  # the target concatenates its tapped layers in layer order
    bad = [l for l in layers if not 0 <= l < target.num_layers]
    if bad:
        raise ValueError(f"drafter target_layers {bad} are outside the target's {target.num_layers} layers")
    cfg.setdefault("rope_theta", target.rope_theta)
    cfg.setdefault("rms_norm_eps", target.rms_norm_eps)
    return DFlashConfig(hidden_size=target.hidden_size, mask_token_id=mask_token_id, target_layers=layers, **cfg)


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """float32 [block_size - 1]: w_k = exp(-(k - 1) / gamma) for block positions k = 1 .. block_size - 1."""
    k = np.arange(1, block_size, dtype=np.float64)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def anchor_settings(settings: dict, block_size: int) -> tuple[float, int]:
    """(gamma, num_anchors) of the training settings: gamma defaults to the paper's for the block size
    (PAPER_GAMMA, else 7.0), num_anchors to 64."""
    return float(settings.get("gamma") or PAPER_GAMMA.get(block_size, 7.0)), int(settings.get("num_anchors", 64))


def sample_anchors(key: jax.Array, batch: int, seq_len: int, num_anchors: int, block_size: int) -> jax.Array:
    """int32 [B, N]: per row N distinct sorted anchors in [1, seq_len - block_size] (every label a + k
    inside the sequence, at least one context token)."""
    count = seq_len - block_size
    if not 1 <= num_anchors <= count:
        raise ValueError(f"num_anchors must be in [1, seq_len - block_size = {count}], got {num_anchors}")

    def row(k):
        return jnp.sort(jax.random.choice(k, count, (num_anchors,), replace=False)) + 1

    return jax.vmap(row)(jax.random.split(key, batch)).astype(jnp.int32)


def block_labels(tokens: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """int [B, N, block_size - 1]: the true tokens a + 1 .. a + block_size - 1 of each block."""
    index = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)
    return jnp.take_along_axis(tokens[:, None, :], index, axis=2)


def block_loss(config: DFlashConfig, params: dict, embed, head, features, tokens, anchors, weights, dtype=jnp.float32):
    """(weighted loss, metrics) of the drafter on the blocks at `anchors` (features: the target's)."""
    logits = dflash.train_logits(
        config, cast(params, dtype), embed.astype(dtype), head.astype(dtype), features.astype(dtype), tokens, anchors
    )
    labels = block_labels(tokens, anchors, config.block_size)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]  # [B, N, L]
    w = jnp.asarray(weights)
    loss = jnp.sum(nll * w) / (jnp.sum(w) * nll.shape[0] * nll.shape[1])
    correct = jnp.argmax(logits, axis=-1) == labels
    metrics = {
        "loss": loss,
        "nll_per_position": nll.mean(axis=(0, 1)),
        "acc_per_position": correct.mean(axis=(0, 1)),
        "accept_length": 1.0 + jnp.cumprod(correct, axis=-1).sum(axis=-1).mean(),
    }
    return loss, metrics


def target_features(target: Qwen3Config, target_params: dict, tokens, dtype):
    """The frozen target's tapped hidden states [B, T, F*D] (no gradient)."""
    _, features = qwen3.forward_features(target, cast(target_params, dtype), tokens, attn_impl="xla")
    return jax.lax.stop_gradient(features)


def make_step(
    config: DFlashConfig, target: Qwen3Config, settings: dict, gamma: float, num_anchors: int, seed: int, dtype
):
    """The jitted train step(state, target_params, tokens) -> (state, metrics); anchors are drawn from
    fold_in(key(seed), step), so a resumed run draws the same ones. Cached per arguments."""
    return _make_step(config, target, tuple(sorted(settings.items())), gamma, num_anchors, seed, dtype)


@functools.lru_cache(maxsize=8)
def _make_step(config, target, settings_items, gamma, num_anchors, seed, dtype):
    tx = optimizer(dict(settings_items))
    weights = loss_weights(config.block_size, gamma)

    def step(state, target_params, tokens):
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        anchors = sample_anchors(key, tokens.shape[0], tokens.shape[1], num_anchors, config.block_size)
        features = target_features(target, target_params, tokens, dtype)
        embed = jax.lax.stop_gradient(qwen3.embedding(target_params))
        head = jax.lax.stop_gradient(qwen3.head(target, target_params))

        def loss_fn(p):
            return block_loss(config, p, embed, head, features, tokens, anchors, weights, dtype)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        metrics["grad_norm"] = optax.tree.norm(grads)
        return apply_gradients(tx, state, grads), metrics

    return jax.jit(step, donate_argnums=(0,))


def make_eval(config: DFlashConfig, target: Qwen3Config, gamma: float, num_anchors: int, dtype=jnp.float32):
    """A jitted fn(params, target_params, tokens, key) -> metrics of one held-out batch (cached)."""
    return _make_eval(config, target, gamma, num_anchors, dtype)


@functools.lru_cache(maxsize=8)
def _make_eval(config, target, gamma, num_anchors, dtype):
    weights = loss_weights(config.block_size, gamma)

    def one(params, target_params, tokens, key):
        anchors = sample_anchors(key, tokens.shape[0], tokens.shape[1], num_anchors, config.block_size)
        features = target_features(target, target_params, tokens, dtype)
        return block_loss(
            config,
            params,
            qwen3.embedding(target_params),
            qwen3.head(target, target_params),
            features,
            tokens,
            anchors,
            weights,
            dtype,
        )[1]

    return jax.jit(one)


def mean_metrics(eval_fn, args: tuple, batches, seed: int) -> dict:
    """The metrics of eval_fn(*args, batch, key) averaged over the batches (numpy arrays), with fixed anchors:
    batch i's key is fold_in(fold_in(key(seed), 2**30), i), the same in every evaluation of a run."""
    base = jax.random.fold_in(jax.random.key(seed), 2**30)
    out = [eval_fn(*args, jnp.asarray(b), jax.random.fold_in(base, i)) for i, b in enumerate(batches)]
    return jax.tree.map(lambda *xs: np.mean(np.stack([np.asarray(x) for x in xs]), axis=0), *out)


def evaluate(eval_fn, params: dict, target_params: dict, batches, seed: int) -> dict:
    """Held-out metrics with fixed anchors (keys derived from `seed`), averaged over the batches."""
    mean = mean_metrics(eval_fn, (params, target_params), batches, seed)
    return {
        "loss": float(mean["loss"]),
        "accept_length": float(mean["accept_length"]),
        "nll_per_position": [round(float(x), 4) for x in mean["nll_per_position"]],
        "acc_per_position": [round(float(x), 4) for x in mean["acc_per_position"]],
    }


def init_state(config: DFlashConfig, settings: dict, seed: int) -> dict:
    """Random float32 drafter parameters (key(seed + 1)), the optimizer state, step 0 (one compiled program, cached)."""
    return on_device(_init_fn(config, tuple(sorted(settings.items())))(jax.random.key(seed + 1)))


@functools.lru_cache(maxsize=8)
def _init_fn(config: DFlashConfig, settings_items: tuple):
    tx = optimizer(dict(settings_items))

    def init(key):
        return new_train_state(tx, dflash.init_params(config, config.hidden_size, key, jnp.float32))

    return jax.jit(init)


def loop_step(step_fn, frozen: tuple, batches: Batches, logged: tuple[str, ...]):
    """The training loop's step(state, i) -> (state, metrics): step_fn(state, *frozen, tokens) on batch i (frozen:
    the frozen models' parameters; tokens int32 [B, T]), keeping the scalar metrics named in `logged` (what the
    loop averages and logs)."""

    def step(state, index):
        state, metrics = step_fn(state, *frozen, jnp.asarray(batches.batch(index)))
        return state, {name: metrics[name] for name in logged}

    return step


def train(
    config: DFlashConfig,
    target: Qwen3Config,
    target_params: dict,
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
    """Trains the drafter against the frozen target; returns (float32 drafter params, results)."""
    dtype = DTYPES[settings["dtype"]]
    target = with_tapped(target, config.target_layers)
    gamma, num_anchors = anchor_settings(settings, config.block_size)
    weights = loss_weights(config.block_size, gamma)
    steps, batch_size = settings["steps"], settings["batch_size"]
    batches = Batches(train_seqs, batch_size, seed + 1)
    heldout = eval_batches(heldout_seqs, batch_size, settings["eval_batches"])
    step_fn = make_step(config, target, settings, gamma, num_anchors, seed, dtype)
    eval_fn = make_eval(config, target, gamma, num_anchors)  # evaluated in float32, as the exported weights run

    def resumed_entry(record):  # the history of the steps a resumed run skips, from its log
        if "loss" in record:
            return {
                "step": record["step"],
                "train_loss": record["loss"],
                "train_accept_length": record["accept_length"],
            }
        if "heldout" in record and record["step"] < steps:
            held = record["heldout"]
            return {
                "step": record["step"],
                "heldout_loss": held["loss"],
                "heldout_accept_length": held["accept_length"],
            }
        return None

    def periodic_eval(state):
        held = evaluate(eval_fn, state["params"], target_params, heldout, seed)
        return (
            {"heldout": held},
            {"heldout_loss": held["loss"], "heldout_accept_length": held["accept_length"]},
            f"held-out loss {held['loss']:.4f}, accept length {held['accept_length']:.3f}",
        )

    run = run_training(
        "drafter",
        init_state(config, settings, seed),
        loop_step(step_fn, (target_params,), batches, ("loss", "accept_length", "grad_norm")),
        settings=settings,
        evaluate=periodic_eval,
        checkpoint_dir=checkpoint_dir,
        log_path=log_path,
        resume=resume,
        show_progress=show_progress,
        resumed_entry=resumed_entry,
    )
    params = run.state["params"]
    held = evaluate(eval_fn, params, target_params, heldout, seed)
    if run.log:
        run.log.write(step=steps, heldout=held)
    last = next((h for h in reversed(run.history) if "train_loss" in h), {})
    results = run.results(
        settings,
        num_anchors=num_anchors,
        gamma=gamma,
        loss_weights=[round(float(w), 4) for w in weights],
        block_size=config.block_size,
        target_layers=list(config.target_layers),
        settings=settings,
        final_train_loss=last.get("train_loss"),
        final_train_accept_length=last.get("train_accept_length"),
        heldout_loss=held["loss"],
        heldout_accept_length=held["accept_length"],
        heldout_acc_per_position=held["acc_per_position"],
        heldout_nll_per_position=held["nll_per_position"],
    )
    return params, results
