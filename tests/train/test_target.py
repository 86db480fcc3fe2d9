"""Target LM training: a few steps reduce the loss; Orbax checkpoints resume to the same parameters."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.train import target as target_mod
from ddtree_jax.train.common import Checkpoints, train_settings

V = 61
CONFIG = target_mod.model_config(
    {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": True,
    },
    V,
)


def _sequences(count, length, seed):
    """Learnable synthetic text: a period-4 motif of tokens 0 .. 15 per sequence."""
    rng = np.random.default_rng(seed)
    motifs = rng.integers(0, 16, (count, 4))
    return np.take_along_axis(motifs, np.arange(length)[None].repeat(count, 0) % 4, axis=1).astype(np.int32)


SETTINGS = train_settings(
    {
        "steps": 8,
        "batch_size": 4,
        "lr": 1e-2,
        "warmup_frac": 0.1,
        "log_every": 2,
        "eval_batches": 1,
        "checkpoint_every": 4,
        "keep_checkpoints": 2,
    }
)


def test_a_few_steps_reduce_the_loss_and_resume_is_exact(tmp_path):
    train_seqs, held_seqs = _sequences(16, 24, 0), _sequences(4, 24, 1)
    fixed = [train_seqs[:4]]  # evaluated with the loop's own (cached) held-out evaluation

    def loss(p):
        return target_mod.evaluate(CONFIG, p, fixed)

    init = target_mod.init_state(CONFIG, SETTINGS, 0)["params"]  # what train() starts from (seed 0)
    ckpt = str(tmp_path / "ckpt")
    params, results = target_mod.train(
        CONFIG,
        SETTINGS,
        train_seqs,
        held_seqs,
        seed=0,
        checkpoint_dir=ckpt,
        log_path=str(tmp_path / "log.jsonl"),
        show_progress=False,
    )
    before, after = loss(init), loss(params)
    assert np.isfinite(after) and after < before - 0.5, (before, after)
    assert results["heldout_ppl"] == pytest.approx(np.exp(results["heldout_loss"]))
    assert results["params"] == sum(x.size for x in jax.tree.leaves(params))
    assert "lm_head" not in params and all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert os.path.getsize(tmp_path / "log.jsonl") > 0
    checkpoints = Checkpoints(ckpt)
    assert checkpoints.steps() == [4, 8]
    # interrupted after step 4: resuming from the Orbax checkpoint reproduces the uninterrupted run
    shutil.rmtree(checkpoints.path(8))
    resumed, results2 = target_mod.train(
        CONFIG,
        SETTINGS,
        train_seqs,
        held_seqs,
        seed=0,
        checkpoint_dir=ckpt,
        log_path=str(tmp_path / "log.jsonl"),
        resume=True,
        show_progress=False,
    )
    assert results2["resumed_from"] == 4
    assert results2["history"] == results["history"]  # the steps before the checkpoint come from the log
    assert results2["final_train_loss"] == results["final_train_loss"]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_settings_and_model_configs_are_checked():
    with pytest.raises(ValueError, match="unknown target model settings"):
        target_mod.model_config({"hidden": 3}, V)
    with pytest.raises(ValueError, match="unknown training settings"):
        train_settings({"stepz": 3})
    with pytest.raises(ValueError, match="dtype"):
        train_settings({"dtype": "float16"})
    assert CONFIG.vocab_size == V and CONFIG.tie_word_embeddings
