"""Training the path-conditioned child head (`models.child_head`, issue #23) against the frozen target and the
frozen DFlash drafter.

The drafter's training blocks (`train.drafter`: random anchors a, block [token a, MASK x (block_size - 1)], the
context strictly before a) give, at block position k, the hidden state h_k whose logits are the depth-k
marginal. The head sees h_k and the data token at a + k - 1 (the parent a path-conditioned tree would hang the
child on, teacher-forced) and predicts the data token at a + k, for k = 2 .. block_size - 1 (depth 1's parent
is the bonus token, which the drafter already sees: the root's children stay the marginal). The loss is the
cross-entropy weighted by the drafter's decay w_k = exp(-(k - 1) / gamma), normalised by the weights; only the
head's parameters are trained (the target, its embedding and LM head, and the drafter get no gradient).

Metrics per depth k = 2 .. block_size - 1: the head's and the marginal's cross-entropy and top-1 accuracy on the
same blocks, so a run shows what conditioning on the parent buys at each depth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.config import ChildHeadConfig, DFlashConfig, Qwen3Config
from ddtree_jax.models import child_head, dflash, qwen3
from ddtree_jax.models.layers import linear
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
from ddtree_jax.train.drafter import (
    anchor_settings,
    block_labels,
    loop_step,
    loss_weights,
    mean_metrics,
    sample_anchors,
    target_features,
)
from ddtree_jax.train.target import with_tapped


def head_loss(
    config: ChildHeadConfig,
    params: dict,
    drafter_config: DFlashConfig,
    drafter_params: dict,
    embed,
    lm_head,
    features,
    tokens,
    anchors,
    weights,
    dtype=jnp.float32,
):
    """(weighted loss, metrics) of the head on the blocks at `anchors`; weights: the drafter's w_k, k = 1 ..
    block_size - 1 (the head uses k >= 2). The drafter's pass is frozen (stop_gradient)."""
    marginal, hidden = dflash.train_logits(
        drafter_config,
        cast(drafter_params, dtype),
        embed.astype(dtype),
        lm_head.astype(dtype),
        features.astype(dtype),
        tokens,
        anchors,
        return_hidden=True,
    )  # [B, N, L, V], [B, N, L, D]
    marginal, hidden = jax.lax.stop_gradient(marginal), jax.lax.stop_gradient(hidden)
    labels = block_labels(tokens, anchors, drafter_config.block_size)  # [B, N, L]: data tokens a + 1 .. a + L
    parents = labels[..., :-1]  # the data token at a + k - 1 for k = 2 .. L
    g = child_head.child_hidden(config, cast(params, dtype), hidden[..., 1:, :], embed.astype(dtype)[parents])
    logits = linear(g, lm_head.astype(dtype)).astype(jnp.float32)  # [B, N, L - 1, V]
    target = labels[..., 1:]

    def nll_of(x):
        return -jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), target[..., None], axis=-1)[..., 0]

    nll, marginal_nll = nll_of(logits), nll_of(marginal[..., 1:, :])
    w = jnp.asarray(weights)[1:]
    loss = jnp.sum(nll * w) / (jnp.sum(w) * nll.shape[0] * nll.shape[1])
    metrics = {
        "loss": loss,
        "marginal_loss": jnp.sum(marginal_nll * w) / (jnp.sum(w) * nll.shape[0] * nll.shape[1]),
        "nll_per_depth": nll.mean(axis=(0, 1)),
        "marginal_nll_per_depth": marginal_nll.mean(axis=(0, 1)),
        "acc_per_depth": (jnp.argmax(logits, axis=-1) == target).mean(axis=(0, 1)),
        "marginal_acc_per_depth": (jnp.argmax(marginal[..., 1:, :], axis=-1) == target).mean(axis=(0, 1)),
    }
    return loss, metrics


def _frozen(target: Qwen3Config, target_params: dict, tokens, dtype):
    features = target_features(target, target_params, tokens, dtype)
    embed = jax.lax.stop_gradient(qwen3.embedding(target_params))
    lm_head = jax.lax.stop_gradient(qwen3.head(target, target_params))
    return features, embed, lm_head


@functools.lru_cache(maxsize=8)
def _make_step(config, drafter_config, target, settings_items, gamma, num_anchors, seed, dtype):
    tx = optimizer(dict(settings_items))
    weights = loss_weights(drafter_config.block_size, gamma)

    def step(state, drafter_params, target_params, tokens):
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        anchors = sample_anchors(key, tokens.shape[0], tokens.shape[1], num_anchors, drafter_config.block_size)
        features, embed, lm_head = _frozen(target, target_params, tokens, dtype)

        def loss_fn(p):
            return head_loss(
                config, p, drafter_config, drafter_params, embed, lm_head, features, tokens, anchors, weights, dtype
            )

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        metrics["grad_norm"] = optax.tree.norm(grads)
        return apply_gradients(tx, state, grads), metrics

    return jax.jit(step, donate_argnums=(0,))


@functools.lru_cache(maxsize=8)
def make_eval(
    config: ChildHeadConfig, drafter_config: DFlashConfig, target: Qwen3Config, gamma: float, num_anchors: int
):
    """A jitted fn(params, drafter_params, target_params, tokens, key) -> metrics of one batch (float32; cached)."""
    weights = loss_weights(drafter_config.block_size, gamma)

    def one(params, drafter_params, target_params, tokens, key):
        anchors = sample_anchors(key, tokens.shape[0], tokens.shape[1], num_anchors, drafter_config.block_size)
        features, embed, lm_head = _frozen(target, target_params, tokens, jnp.float32)
        return head_loss(
            config, params, drafter_config, drafter_params, embed, lm_head, features, tokens, anchors, weights
        )[1]

    return jax.jit(one)


def evaluate(eval_fn, params, drafter_params, target_params, batches, seed: int) -> dict:
    """Held-out metrics with fixed anchors (keys from `seed`), averaged over the batches."""
    mean = mean_metrics(eval_fn, (params, drafter_params, target_params), batches, seed)
    return {
        name: (float(value) if np.ndim(value) == 0 else [round(float(x), 4) for x in value])
        for name, value in mean.items()
    }


def init_state(config: ChildHeadConfig, settings: dict, seed: int) -> dict:
    """The zero-output head (`child_head.init_params`, key(seed + 2)), the optimizer state, step 0."""
    params = child_head.init_params(config, jax.random.key(seed + 2), jnp.float32)
    return on_device(new_train_state(optimizer(settings), params))


def train(
    config: ChildHeadConfig,
    drafter_config: DFlashConfig,
    drafter_params: dict,
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
    """Trains the head against the frozen target and drafter; returns (float32 head params, results)."""
    if config.hidden_size != drafter_config.hidden_size:
        raise ValueError(
            f"the head's hidden_size ({config.hidden_size}) must equal the drafter's ({drafter_config.hidden_size})"
        )
    dtype = DTYPES[settings["dtype"]]
    target = with_tapped(target, drafter_config.target_layers)
    gamma, num_anchors = anchor_settings(settings, drafter_config.block_size)
    steps, batch_size = settings["steps"], settings["batch_size"]
    batches = Batches(train_seqs, batch_size, seed + 2)
    heldout = eval_batches(heldout_seqs, batch_size, settings["eval_batches"])
    step_fn = _make_step(
        config, drafter_config, target, tuple(sorted(settings.items())), gamma, num_anchors, seed, dtype
    )
    eval_fn = make_eval(config, drafter_config, target, gamma, num_anchors)

    def periodic_eval(state):
        held = evaluate(eval_fn, state["params"], drafter_params, target_params, heldout, seed)
        return (
            {"heldout": held},
            {"heldout_loss": held["loss"], "heldout_marginal_loss": held["marginal_loss"]},
            f"held-out loss {held['loss']:.4f} (marginal {held['marginal_loss']:.4f})",
        )

    run = run_training(
        "child_head",
        init_state(config, settings, seed),
        loop_step(step_fn, (drafter_params, target_params), batches, ("loss", "marginal_loss", "grad_norm")),
        settings=settings,
        evaluate=periodic_eval,
        checkpoint_dir=checkpoint_dir,
        log_path=log_path,
        resume=resume,
        show_progress=show_progress,
    )
    params = run.state["params"]
    held = evaluate(eval_fn, params, drafter_params, target_params, heldout, seed)
    if run.log:
        run.log.write(step=steps, heldout=held)
    results = run.results(
        settings,
        num_anchors=num_anchors,
        gamma=gamma,
        inner_size=config.inner_size,
        settings=settings,
        heldout_loss=held["loss"],
        heldout_marginal_loss=held["marginal_loss"],
        heldout_nll_per_depth=held["nll_per_depth"],
        heldout_marginal_nll_per_depth=held["marginal_nll_per_depth"],
        heldout_acc_per_depth=held["acc_per_depth"],
        heldout_marginal_acc_per_depth=held["marginal_acc_per_depth"],
    )
    return params, results
