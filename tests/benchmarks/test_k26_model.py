"""benchmarks/k26_model.py's SpreadDraftsDrafter: a random-weight drafter giving each (row, depth) its own
distribution (a trained drafter's positions have theirs; the random drafter's own repeat one token along the chain,
so the K2.6 shard's chain step read few experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.k26_model import OWN_WEIGHT, SPREAD_SCALE, SpreadDraftsDrafter, spread_logits
from ddtree_jax.engine.drafters import DFlashDrafter
from experiments.tp_shard_step import shard_pair


@pytest.mark.parametrize("vocab", [2048, 20480])
def test_spread_logits_give_each_row_and_depth_its_own_distribution(vocab):
    # the drafter's own logits the same at every depth (what the random drafter gives), and large
    own = jnp.broadcast_to(jax.random.normal(jax.random.key(7), (1, 1, vocab)) * 30, (3, 7, vocab))
    lengths = jnp.array([5, 4096, 123], jnp.int32)
    spread = spread_logits(own, lengths)
    noise = np.asarray(spread - own * OWN_WEIGHT)
    # the random part: standard normal x SPREAD_SCALE (mean within 5 standard errors, std within 2%)
    assert abs(noise.std() / SPREAD_SCALE - 1) < 0.02 and abs(noise.mean()) < 5 * SPREAD_SCALE / noise.size**0.5
    top = np.asarray(spread.argmax(-1))  # [B, L]
    # distinct tokens along each row's depths (probability of a repeat ~21 / vocab a row: fixed seed)
    for row in top:
        assert len(set(row.tolist())) == 7, row
    later = np.asarray(spread_logits(own, lengths + 1).argmax(-1))
    assert (later != top).mean() > 0.9  # the next step's context draws anew
    # the drafter's own logits still reach the output (its work is not dead code), at OWN_WEIGHT
    grad = jax.grad(lambda x: spread_logits(x, lengths).sum())(own)
    np.testing.assert_allclose(np.asarray(grad), OWN_WEIGHT, rtol=1e-6)


def test_the_spread_drafter_drafts_a_different_token_at_each_depth():
    _, _, model_pair = shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="model")
    _, _, spread_pair = shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="spread")
    drafter = spread_pair.drafter
    assert isinstance(drafter, SpreadDraftsDrafter) and isinstance(drafter, DFlashDrafter)
    assert type(model_pair.drafter) is DFlashDrafter
    # same weights: the spread drafter's pass is the model's own, then spread_logits
    state = drafter.init_state(2, 64)
    features = jax.random.normal(jax.random.key(1), (2, 16, drafter.params["fc"].shape[1]), jnp.float32)
    state = drafter.append(state, features, jnp.array([16, 9], jnp.int32))
    bonus = jnp.array([3, 11], jnp.int32)
    own = model_pair.drafter.draft(state, bonus, 8)
    spread = drafter.draft(state, bonus, 8)
    np.testing.assert_allclose(np.asarray(spread), np.asarray(spread_logits(own, state.lengths)), rtol=1e-6)
    # the tiny shard's vocabulary is 128: 7 draws may repeat one (p ~ 0.15 a row), the model's own drafts repeat more
    spread_tokens = [len(set(row.tolist())) for row in np.asarray(spread.argmax(-1))]
    own_tokens = [len(set(row.tolist())) for row in np.asarray(own.argmax(-1))]
    assert min(spread_tokens) >= 5 and sum(spread_tokens) > sum(own_tokens), (spread_tokens, own_tokens)
    # a registered pytree (an unregistered object would be one opaque leaf): its arrays are the leaves, and a jitted
    # call rebuilds the same class
    leaves, treedef = jax.tree_util.tree_flatten(drafter)
    assert treedef.num_leaves == jax.tree_util.tree_structure(model_pair.drafter).num_leaves > 1
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    rebuilt = jax.jit(lambda d: d)(drafter)
    assert type(rebuilt) is SpreadDraftsDrafter
    np.testing.assert_allclose(np.asarray(rebuilt.draft(state, bonus, 8)), np.asarray(spread), rtol=1e-6)


def test_unknown_drafts_are_refused():
    with pytest.raises(ValueError, match="drafts must be one of .* got 'oracle'"):
        shard_pair(2, 1, 2, tiny=True, dtype=jnp.float32, drafts="oracle")
