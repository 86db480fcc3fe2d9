"""DFlash drafter training: the anchor / mask construction, the loss, and a few steps against a frozen target."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import DFlashConfig, Qwen3Config
from ddtree_jax.models import dflash, qwen3
from ddtree_jax.train import drafter as drafter_mod
from ddtree_jax.train.common import Checkpoints, train_settings

V, D, BLOCK = 97, 32, 16
TARGET = Qwen3Config(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    tapped_layers=(0, 1),
)
DRAFTER = DFlashConfig(
    hidden_size=D,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    block_size=BLOCK,
    mask_token_id=V - 1,
    target_layers=(0, 1),
    rope_theta=10_000.0,
)


def _models(seed=0):
    keys = jax.random.split(jax.random.key(seed))
    return (
        qwen3.init_params(TARGET, keys[0], norm_jitter=0.1),
        dflash.init_params(DRAFTER, D, keys[1], norm_jitter=0.1),
    )


_features = jax.jit(lambda tparams, tokens: qwen3.forward_features(TARGET, tparams, tokens)[1])
_train_logits = jax.jit(
    lambda tparams, dparams, features, tokens, anchors: dflash.train_logits(
        DRAFTER, dparams, tparams["embed"], tparams["embed"], features, tokens, anchors
    )
)


def _drafter_logits(tparams, dparams, tokens, anchors, features=None):
    features = _features(tparams, tokens) if features is None else features
    return np.asarray(_train_logits(tparams, dparams, features, tokens, anchors))


def test_loss_weights_and_anchor_sampling():
    w = drafter_mod.loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w, np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    assert drafter_mod.PAPER_GAMMA[16] == 7.0
    anchors = np.asarray(drafter_mod.sample_anchors(jax.random.key(0), 5, 64, 48, 16))
    assert anchors.shape == (5, 48) and anchors.min() >= 1 and anchors.max() <= 64 - 16
    assert all(len(set(row)) == 48 and list(row) == sorted(row) for row in anchors.tolist())
    again = np.asarray(drafter_mod.sample_anchors(jax.random.key(0), 5, 64, 48, 16))
    np.testing.assert_array_equal(anchors, again)
    with pytest.raises(ValueError, match="num_anchors"):
        drafter_mod.sample_anchors(jax.random.key(0), 1, 20, 5, 16)
    tokens = jnp.arange(40)[None] * 3
    labels = np.asarray(drafter_mod.block_labels(tokens, jnp.array([[1, 20]]), 16))
    np.testing.assert_array_equal(labels[0, 0], np.arange(2, 17) * 3)
    np.testing.assert_array_equal(labels[0, 1], np.arange(21, 36) * 3)


def test_drafter_never_sees_tokens_at_or_after_its_anchor():
    """Perturbing the tokens after an anchor (hence the target's features from the anchor on) leaves
    that block's logits unchanged; blocks with later anchors do change, and so does a block whose
    anchor token or context changes (the test is not vacuous)."""
    tparams, dparams = _models(1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V - 1, (2, 56)), jnp.int32)
    anchors = jnp.array([[5, 20, 33], [1, 20, 40]], jnp.int32)
    base = _drafter_logits(tparams, dparams, tokens, anchors)
    after = tokens.at[:, 21:].set(jnp.asarray(rng.integers(0, V - 1, (2, 35)), jnp.int32))
    moved = _drafter_logits(tparams, dparams, after, anchors)
    np.testing.assert_allclose(moved[:, :2], base[:, :2], rtol=0, atol=1e-6)  # anchors 5 / 1 and 20
    assert np.abs(moved[:, 2] - base[:, 2]).max() > 1e-3  # anchors 33 / 40 see the changed context
    # the target's features at and after the anchor are never read: replace them directly
    features = _features(tparams, tokens)
    noisy = features.at[:, 20:].set(jnp.asarray(rng.standard_normal(features[:, 20:].shape), features.dtype))
    direct = _drafter_logits(tparams, dparams, tokens, anchors, noisy)
    np.testing.assert_allclose(direct[:, :2], base[:, :2], rtol=0, atol=1e-6)
    # the anchor token itself and the context just before it are seen
    for position in (20, 19):
        changed = tokens.at[:, position].set((tokens[:, position] + 1) % (V - 1))
        assert np.abs(_drafter_logits(tparams, dparams, changed, anchors)[:, 1] - base[:, 1]).max() > 1e-3


def _sequences(count, length, seed):
    """Learnable synthetic text: a period-3 motif of tokens 0 .. 11 per sequence (random phase)."""
    rng = np.random.default_rng(seed)
    motifs = rng.integers(0, 12, (count, 3))
    phase = rng.integers(0, 3, (count, 1))
    return np.take_along_axis(motifs, (phase + np.arange(length)[None]) % 3, axis=1).astype(np.int32)


def test_drafter_training_reduces_the_loss_with_frozen_embedding_and_head(tmp_path):
    tparams, _ = _models(2)
    tparams["embed"] = tparams["embed"] * 50.0  # unit-scale logits through the frozen tied head (as after training)
    frozen = jax.tree.map(lambda x: np.array(x, copy=True), tparams)
    settings = train_settings(
        {
            "steps": 12,
            "batch_size": 4,
            "lr": 1e-2,
            "warmup_frac": 0.1,
            "num_anchors": 8,
            "gamma": 7.0,
            "log_every": 4,
            "eval_batches": 1,
            "dtype": "bfloat16",
            "checkpoint_every": 6,
        }
    )
    train_seqs, held_seqs = _sequences(32, 48, 0), _sequences(4, 48, 1)
    init = drafter_mod.init_state(DRAFTER, settings, 0)["params"]  # what train() starts from
    eval_fn = drafter_mod.make_eval(DRAFTER, TARGET, 7.0, 8)  # the loop's own (cached) float32 evaluation

    def loss_of(p):
        return float(eval_fn(p, tparams, jnp.asarray(held_seqs), jax.random.key(9))["loss"])

    ckpt = str(tmp_path / "orbax")
    params, results = drafter_mod.train(
        DRAFTER, TARGET, tparams, settings, train_seqs, held_seqs, seed=0, checkpoint_dir=ckpt, show_progress=False
    )
    assert set(params) == {"fc", "hidden_norm", "layers", "final_norm"}  # no embedding or head of its own
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # float32 master weights, bfloat16 compute
    before, after = loss_of(init), loss_of(params)
    assert np.isfinite(after) and after < before - 0.5, (before, after)
    losses = [h["train_loss"] for h in results["history"] if "train_loss" in h]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.isfinite(results["heldout_loss"]) and results["heldout_accept_length"] >= 1.0
    assert len(results["heldout_acc_per_position"]) == BLOCK - 1 and results["gamma"] == 7.0
    # the target (its embedding, which is also the tied head, and everything else) is bit-identical
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(tparams)):
        assert a.dtype == np.asarray(b).dtype and np.array_equal(a, np.asarray(b))
    # resuming from the step-6 checkpoint redraws the same batches and anchors: the same parameters
    checkpoints = Checkpoints(ckpt)
    assert checkpoints.steps() == [6, 12]
    shutil.rmtree(checkpoints.path(12))
    resumed, again = drafter_mod.train(
        DRAFTER,
        TARGET,
        tparams,
        settings,
        train_seqs,
        held_seqs,
        seed=0,
        checkpoint_dir=ckpt,
        resume=True,
        show_progress=False,
    )
    assert again["resumed_from"] == 6
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_config_defaults():
    target = Qwen3Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=5000.0,
    )
    cfg = drafter_mod.model_config(
        {"num_layers": 2, "intermediate_size": 48, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 16},
        target,
        mask_token_id=1,
    )
    assert cfg.hidden_size == D and cfg.rope_theta == 5000.0 and cfg.target_layers == (1, 3) and cfg.mask_token_id == 1
    cfg = drafter_mod.model_config(
        {
            "num_layers": 1,
            "intermediate_size": 48,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
            "block_size": 16,
            "target_layers": [5, 1],
        },
        target,
        1,
    )
    assert cfg.target_layers == (1, 5)
    with pytest.raises(ValueError, match="outside"):
        drafter_mod.model_config(
            {
                "num_layers": 1,
                "intermediate_size": 48,
                "num_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 8,
                "block_size": 16,
                "target_layers": [6],
            },
            target,
            1,
        )
