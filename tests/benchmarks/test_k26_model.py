"""benchmarks/k26_model.py's DistinctDraftsDrafter: a random-weight drafter proposing a different token at each
depth (a trained drafter's chain does; the random drafter's own repeats one token, so the K2.6 shard's chain step
read few experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.k26_model import SPREAD_BOOST, DistinctDraftsDrafter, spread_logits
from ddtree_jax.engine.drafters import DFlashDrafter
from experiments.tp_shard_step import shard_pair


@pytest.mark.parametrize("vocab", [2048, 20480, 1000])
def test_spread_logits_boost_one_distinct_token_a_depth(vocab):
    key = jax.random.key(7)
    logits = jax.random.normal(key, (3, 7, vocab), jnp.float32) * 20  # fresh random logits, wide range
    lengths = jnp.array([5, 4096, 123457], jnp.int32)
    spread = spread_logits(logits, lengths)
    # every entry but one a (row, depth) unchanged; that one raised by SPREAD_BOOST
    changed = np.asarray(spread != logits)
    assert (changed.sum(-1) == 1).all()
    np.testing.assert_allclose(np.asarray(spread - logits).max(-1), SPREAD_BOOST, rtol=1e-6)
    top = np.asarray(spread.argmax(-1))  # [B, L]
    for row in top:
        assert len(set(row.tolist())) == 7, row  # a different token at each depth
    assert len({tuple(row) for row in top.tolist()}) == 3  # and other tokens for other rows / context lengths
    later = np.asarray(spread_logits(logits, lengths + 1).argmax(-1))
    assert (later != top).all()  # the next step's context moves every token on


def test_the_distinct_drafter_drafts_a_different_token_at_each_depth():
    _, _, model_pair = shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="model")
    _, _, distinct_pair = shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="distinct")
    drafter = distinct_pair.drafter
    assert isinstance(drafter, DistinctDraftsDrafter) and isinstance(drafter, DFlashDrafter)
    assert type(model_pair.drafter) is DFlashDrafter
    # same weights: the distinct drafter's pass is the model's own plus the boost
    state = drafter.init_state(2, 64)
    features = jax.random.normal(jax.random.key(1), (2, 16, drafter.params["fc"].shape[1]), jnp.float32)
    state = drafter.append(state, features, jnp.array([16, 9], jnp.int32))
    bonus = jnp.array([3, 11], jnp.int32)
    own = model_pair.drafter.draft(state, bonus, 8)
    spread = drafter.draft(state, bonus, 8)
    np.testing.assert_allclose(np.asarray(spread), np.asarray(spread_logits(own, state.lengths)), rtol=1e-6)
    for row in np.asarray(spread.argmax(-1)):
        assert len(set(row.tolist())) == 7, row
    # a pytree the engine's jitted step takes: flattened and rebuilt as the same class
    leaves, treedef = jax.tree_util.tree_flatten(drafter)
    assert type(jax.tree_util.tree_unflatten(treedef, leaves)) is DistinctDraftsDrafter


def test_unknown_drafts_are_refused():
    with pytest.raises(ValueError, match="drafts must be one of .* got 'oracle'"):
        shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="oracle")
