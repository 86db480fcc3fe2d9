"""Training the path-conditioned child head (`train.child_head`): the untrained head is the marginal, a few
steps against a frozen target and drafter lower its held-out loss well below the marginal's, and nothing frozen
moves."""

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.train import child_head as head_mod
from ddtree_jax.train.common import train_settings
from tests.train.test_drafter import BLOCK, DRAFTER, TARGET, D, _models, _sequences

HEAD = ChildHeadConfig(hidden_size=D, inner_size=64)


def test_head_training_beats_the_marginal_and_leaves_the_frozen_models_alone():
    tparams, dparams = _models(3)
    tparams["embed"] = tparams["embed"] * 50.0  # unit-scale logits through the frozen tied head
    frozen = jax.tree.map(lambda x: np.array(x, copy=True), (tparams, dparams))
    settings = train_settings(
        {
            "steps": 16,
            "batch_size": 4,
            "lr": 1e-2,
            "warmup_frac": 0.1,
            "num_anchors": 8,
            "gamma": 7.0,
            "log_every": 8,
            "eval_batches": 1,
            "dtype": "bfloat16",
        }
    )
    train_seqs, held_seqs = _sequences(32, 48, 0), _sequences(4, 48, 1)
    eval_fn = head_mod.make_eval(HEAD, DRAFTER, head_mod.with_tapped(TARGET, DRAFTER.target_layers), 7.0, 8)
    init = head_mod.init_state(HEAD, settings, 0)["params"]
    start = eval_fn(init, dparams, tparams, jnp.asarray(held_seqs), jax.random.key(9))
    # the untrained head is the marginal drafter, depth by depth
    np.testing.assert_allclose(
        np.asarray(start["nll_per_depth"]), np.asarray(start["marginal_nll_per_depth"]), rtol=1e-5, atol=1e-5
    )
    params, results = head_mod.train(
        HEAD, DRAFTER, dparams, TARGET, tparams, settings, train_seqs, held_seqs, seed=0, show_progress=False
    )
    assert set(params) == {"in_proj", "out_proj"} and all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    end = eval_fn(params, dparams, tparams, jnp.asarray(held_seqs), jax.random.key(9))
    # conditioned on the parent token, the period-3 motif's next token is nearly determined
    assert float(end["loss"]) < float(end["marginal_loss"]) - 0.5, (float(end["loss"]), float(end["marginal_loss"]))
    assert (
        len(results["heldout_nll_per_depth"]) == BLOCK - 2
        and results["heldout_loss"] < results["heldout_marginal_loss"]
    )
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves((tparams, dparams))):
        assert np.array_equal(a, np.asarray(b))  # the target and the drafter are bit-identical
