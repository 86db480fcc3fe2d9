"""The path-conditioned child head (`models.child_head`): an untrained head is the marginal drafter (the
conditional tree it gives is DDTree's), a trained-like one conditions on the parent, and the draft pass's
hidden states are what its logits are read from."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.engine.run import random_tiny_pair
from ddtree_jax.models import child_head, dflash
from ddtree_jax.models.layers import linear
from ddtree_jax.tree import build_conditional_tree, build_tree


@pytest.fixture(scope="module")
def drafted():
    """The random tiny pair's draft pass after a short context: (pair, logits [B, L, V], hidden [B, L, D])."""
    pair = random_tiny_pair(0)
    drafter = pair.drafter
    rng = np.random.default_rng(0)
    batch, context = 2, 6
    cache = dflash.create_context_cache(drafter.config, batch, 32, jnp.float32)
    features = jnp.asarray(
        rng.standard_normal((batch, context, len(drafter.config.target_layers) * drafter.config.hidden_size)),
        jnp.float32,
    )
    cache = dflash.append_context(drafter.config, drafter.params, cache, features, jnp.asarray([context, 4]))
    bonus = jnp.asarray(rng.integers(0, pair.target_config.vocab_size, batch), jnp.int32)
    logits, hidden = dflash.draft(
        drafter.config, drafter.params, drafter.embed, drafter.lm_head, cache, bonus, return_hidden=True
    )
    plain = dflash.draft(drafter.config, drafter.params, drafter.embed, drafter.lm_head, cache, bonus)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))  # return_hidden changes nothing else
    return pair, bonus, logits, hidden


def test_the_draft_logits_are_read_from_the_hidden_states(drafted):
    pair, _, logits, hidden = drafted
    assert hidden.shape == logits.shape[:2] + (pair.drafter.config.hidden_size,)
    np.testing.assert_allclose(
        np.asarray(linear(hidden, pair.drafter.lm_head)), np.asarray(logits), rtol=1e-5, atol=1e-5
    )


def _inputs(pair, hidden, params):
    return child_head.HeadInputs(params=params, hidden=hidden, embed=pair.drafter.embed, lm_head=pair.drafter.lm_head)


def test_an_untrained_head_gives_ddtrees_tree(drafted):
    pair, bonus, logits, hidden = drafted
    config = ChildHeadConfig(hidden_size=pair.drafter.config.hidden_size, inner_size=48)
    params = child_head.init_params(config, jax.random.key(1))
    fn = functools.partial(child_head.head_child_logits, config)
    budget, depth = 24, logits.shape[1]
    got = build_conditional_tree(logits[:, 0], fn, _inputs(pair, hidden, params), budget, depth, bonus)
    want = build_tree(logits, budget, bonus, impl="xla")
    for name in ("tokens", "parents", "depths", "ranks", "num_nodes"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    # the head's logits are recomputed from the hidden states (an ulp from the draft pass's): near, not equal
    np.testing.assert_allclose(np.asarray(got.logw), np.asarray(want.logw), rtol=1e-5, atol=1e-5)


def test_a_trained_head_conditions_on_the_parent(drafted):
    pair, bonus, logits, hidden = drafted
    config = ChildHeadConfig(hidden_size=pair.drafter.config.hidden_size, inner_size=48)
    params = child_head.init_params(config, jax.random.key(2))
    params = {**params, "out_proj": jax.random.normal(jax.random.key(3), params["out_proj"].shape) * 0.5}
    inputs = _inputs(pair, hidden, params)
    parents = jnp.asarray([[3, 7, 3], [5, 5, 9]], jnp.int32)
    out = child_head.head_child_logits(config, inputs, 2, parents)
    assert out.shape == (2, 3, pair.target_config.vocab_size) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out[0, 0]), np.asarray(out[0, 2]))  # same parent token, same children
    assert not np.allclose(np.asarray(out[0, 0]), np.asarray(out[0, 1]))  # another parent: another distribution
    # by hand: depth 3's hidden state (index 2) and the parent's embedding through the MLP and the LM head
    h = hidden[1, 2]
    x = jnp.concatenate([h, pair.drafter.embed[9]])
    g = h + params["out_proj"] @ jax.nn.silu(params["in_proj"] @ x)
    np.testing.assert_allclose(np.asarray(out[1, 2]), np.asarray(pair.drafter.lm_head @ g), rtol=1e-4, atol=1e-4)
    tree = build_conditional_tree(
        logits[:, 0], functools.partial(child_head.head_child_logits, config), inputs, 24, logits.shape[1], bonus
    )
    assert (np.asarray(tree.num_nodes) == 25).all()


def test_config_and_shapes_are_checked():
    with pytest.raises(ValueError, match="ChildHeadConfig.inner_size must be an integer >= 1, got 0"):
        ChildHeadConfig(hidden_size=8, inner_size=0)
    config = ChildHeadConfig(hidden_size=8, inner_size=4)
    params = child_head.init_params(config, jax.random.key(0))
    assert params["in_proj"].shape == (4, 16) and params["out_proj"].shape == (8, 4)
    assert child_head.param_axes(config) == {"in_proj": ("mlp", "features"), "out_proj": ("embed", "mlp")}
    with pytest.raises(ValueError, match=r"must end in hidden_size = 8"):
        child_head.child_hidden(config, params, jnp.zeros((2, 8)), jnp.zeros((2, 6)))
