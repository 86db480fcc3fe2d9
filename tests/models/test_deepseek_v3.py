"""DeepSeek-V3 / Kimi K2 target: routing facts, YaRN tables, parameter axes (parity: tests/checkpoint)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.models import deepseek_v3
from tests.models.impl_parity import relerr
from tests.tiny_models import DSV3_TINY

# the shared tiny config (tests/tiny_models.py) with K2's YaRN RoPE
CONFIG = dataclasses.replace(
    DSV3_TINY,
    rope_type="yarn",
    rope_factor=64.0,
    rope_original_max_position=4096,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
)


def test_routing_is_group_limited_normalised_and_bias_only_chooses():
    key = jax.random.split(jax.random.key(0), 3)
    router = jax.random.normal(key[0], (16, 32))
    bias = jax.random.normal(key[1], (16,))
    x = jax.random.normal(key[2], (2, 50, 32))
    experts, weights = deepseek_v3.route(CONFIG, router, bias, x)
    experts, weights = np.asarray(experts), np.asarray(weights)
    groups = experts // 4
    assert (np.array([len(set(g)) for g in groups.reshape(-1, 3)]) <= 2).all()  # within topk_group groups
    np.testing.assert_allclose(weights.sum(-1), 2.827, rtol=1e-5)  # normalised, times the scaling factor
    scores = 1 / (1 + np.exp(-np.einsum("btd,ed->bte", np.asarray(x), np.asarray(router))))
    np.testing.assert_allclose(
        weights / weights.sum(-1, keepdims=True),
        np.take_along_axis(scores, experts, -1) / np.take_along_axis(scores, experts, -1).sum(-1, keepdims=True),
        rtol=1e-5,
    )  # weights come from the scores, not the biased choice
    huge = np.zeros(16, np.float32)
    huge[[5, 6, 7]] = 100.0  # the bias decides the choice
    chosen, _ = deepseek_v3.route(CONFIG, router, jnp.asarray(huge), x)
    assert (np.sort(np.asarray(chosen), -1) == [5, 6, 7]).all()


def test_routing_with_every_group_allowed_is_the_plain_top_k():
    """topk_group == n_group (Kimi K2: one group) skips the group top-k: the choice is the top-k of the biased
    scores, the same as the group-limited path gives when every group survives."""
    key = jax.random.split(jax.random.key(3), 3)
    router = jax.random.normal(key[0], (16, 32))
    bias = jax.random.normal(key[1], (16,))
    x = jax.random.normal(key[2], (2, 50, 32))
    for n_group in (1, 4):
        config = DeepSeekV3Config(**{**CONFIG.__dict__, "n_group": n_group, "topk_group": n_group})
        experts, weights = deepseek_v3.route(config, router, bias, x)
        scores = 1 / (1 + np.exp(-np.einsum("btd,ed->bte", np.asarray(x), np.asarray(router))))
        expected = np.argsort(-(scores + np.asarray(bias)), axis=-1)[..., : CONFIG.num_experts_per_tok]
        np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(expected, -1))
        np.testing.assert_allclose(np.asarray(weights).sum(-1), CONFIG.routed_scaling_factor, rtol=1e-5)
        # one top-k (the experts'), no group top-k: what the skip saves a MoE layer
        jaxpr = jax.make_jaxpr(lambda x, config=config: deepseek_v3.route(config, router, bias, x))(x)
        assert [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns].count("top_k") == 1
    grouped = jax.make_jaxpr(lambda x: deepseek_v3.route(CONFIG, router, bias, x))(x)  # topk_group < n_group
    assert [eqn.primitive.name for eqn in grouped.jaxpr.eqns].count("top_k") == 3


def test_yarn_tables_and_scale():
    cos, sin = deepseek_v3.rope_tables_half(CONFIG, jnp.arange(8))
    # mscale == mscale_all_dim: the attention factor is 1, so cos^2 + sin^2 = 1
    np.testing.assert_allclose(np.asarray(cos**2 + sin**2), 1.0, rtol=1e-6)
    # softmax scale = qk_head_dim^-0.5 * (0.1 * ln(64) + 1)^2 (the YaRN mscale correction)
    assert deepseek_v3.softmax_scale(CONFIG) == pytest.approx(12**-0.5 * (0.1 * np.log(64) + 1) ** 2)


def test_param_axes_and_forward_shape():
    params = deepseek_v3.init_params(CONFIG, jax.random.key(1))
    axes = deepseek_v3.param_axes(CONFIG)
    for arr, names in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert arr.ndim == len(names)
    assert params["moe_layers"]["expert_gate"].shape == (2, 16, 16, 32)
    logits = deepseek_v3.forward_logits(CONFIG, params, jnp.array([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, 50) and bool(jnp.isfinite(logits).all())
    with pytest.raises(ValueError, match="multiple of n_group"):
        DeepSeekV3Config(**{**CONFIG.__dict__, "n_group": 3})


TINY = DeepSeekV3Config(
    **{**CONFIG.__dict__, "rope_factor": 4.0, "rope_original_max_position": 16, "tapped_layers": (0, 2)}
)
PAD = 20


@pytest.fixture(scope="module")
def tiny_params():
    return deepseek_v3.init_params(TINY, jax.random.key(2), norm_jitter=0.2)


@jax.jit
def _naive_at(params, seq, last):
    return deepseek_v3.forward_logits(TINY, params, seq[None])[0, last]


def _naive(params, seq):
    padded = np.zeros(PAD, np.int32)
    padded[: len(seq)] = seq
    return _naive_at(params, jnp.asarray(padded), len(seq) - 1)


def test_absorbed_tree_verify_and_commit_equal_the_naive_causal_path(tiny_params):
    """Latent-cache prefill (ragged rows), tree verify (each slot = its root-to-node path run causally
    through the expanded-K/V reference), commit, then continue (= uninterrupted decoding)."""
    from ddtree_jax.models.cache import commit
    from ddtree_jax.tree import ancestor_mask, build_tree

    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 50, (2, 8)).astype(np.int32)
    lengths = np.array([5, 0], np.int32)
    cache = deepseek_v3.create_cache(TINY, 2, 40, jnp.float32)
    pre_logits, _, cache = deepseek_v3.prefill(TINY, tiny_params, cache, jnp.asarray(prefix), jnp.asarray(lengths))
    assert relerr(pre_logits[0, 4], _naive(tiny_params, prefix[0, :5])) < 1e-5
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 7, jnp.array([9, 11], jnp.int32))
    logits, features, cache = deepseek_v3.tree_forward(
        TINY, tiny_params, cache, tree.tokens, tree.depths, ancestor_mask(tree)
    )
    assert features.shape == (2, 8, 64)
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    paths = {}
    for b in range(2):
        for i in range(int(tree.num_nodes[b])):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[b, j]
            paths[b, i] = path[::-1]
            seq = np.concatenate([prefix[b, : lengths[b]], tokens[b, path[::-1]]])
            assert relerr(logits[b, i], _naive(tiny_params, seq)) < 1e-5, (b, i)
    deepest = [int(np.argmax(np.asarray(tree.depths[b]))) for b in range(2)]
    accept = np.full((2, 4), -1, np.int32)
    for b in range(2):
        accept[b, : len(paths[b, deepest[b]])] = paths[b, deepest[b]]
    num_accepted = np.array([len(paths[b, deepest[b]]) - 1 for b in range(2)], np.int32)
    cache = commit(cache, jnp.asarray(accept), jnp.asarray(num_accepted))
    new = np.array([[3], [4]], np.int32)
    cont, _, _ = deepseek_v3.prefill(TINY, tiny_params, cache, jnp.asarray(new), jnp.ones(2, jnp.int32))
    for b in range(2):
        seq = np.concatenate([prefix[b, : lengths[b]], tokens[b, paths[b, deepest[b]]], new[b]])
        assert relerr(cont[b, 0], _naive(tiny_params, seq)) < 1e-5


def test_a_long_prefill_runs_the_expanded_form_and_equals_the_naive_path(tiny_params):
    """A 40-token prefill (more queries than `dispatch.mla_form`'s break-even at this shape: the expanded
    form, per-head keys from the latent cache) on ragged rows (40 and 23 tokens): the last token's logits of
    each row equal the expanded-K/V reference run on that row alone."""
    from ddtree_jax import dispatch

    shape = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert dispatch.mla_form("auto", queries=40, **shape) == "expanded"
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 50, (2, 40)).astype(np.int32)
    lengths = np.array([40, 23], np.int32)
    cache = deepseek_v3.create_cache(TINY, 2, 48, jnp.float32)
    logits, _, cache = deepseek_v3.prefill(TINY, tiny_params, cache, jnp.asarray(prefix), jnp.asarray(lengths))
    for b in range(2):
        row = jnp.asarray(prefix[b, : lengths[b]])
        assert relerr(logits[b, lengths[b] - 1], _naive_at(tiny_params, row, lengths[b] - 1)) < 1e-5, b
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)


def test_scanned_layers_equal_the_unrolled_loop(tiny_params):
    """layer_loop="scan" (the default: one layer of each kind in the program) = the Python loop."""
    from ddtree_jax.tree import ancestor_mask, build_tree

    rng = np.random.default_rng(4)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 6)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 5, jnp.array([2, 8], jnp.int32))
    outs = {}
    for loop in ("scan", "unrolled"):
        cache = deepseek_v3.create_cache(TINY, 2, 24, jnp.float32)
        pre, pre_feats, cache = deepseek_v3.prefill(
            TINY, tiny_params, cache, prefix, jnp.array([6, 2], jnp.int32), layer_loop=loop
        )
        ver, feats, cache = deepseek_v3.tree_forward(
            TINY, tiny_params, cache, tree.tokens, tree.depths, ancestor_mask(tree), layer_loop=loop
        )
        outs[loop] = (pre, pre_feats, ver, feats, cache.k, cache.v)
    for got, want in zip(outs["scan"], outs["unrolled"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="layer_loop"):
        deepseek_v3.prefill(
            TINY,
            tiny_params,
            deepseek_v3.create_cache(TINY, 2, 24, jnp.float32),
            prefix,
            jnp.array([6, 2], jnp.int32),
            layer_loop="while",
        )


def test_projections_passed_stacked_equal_the_sliced_layers(tiny_params, monkeypatch):
    """The layer scan hands the projections `dispatch.stacked_in_place` names to the layer as a LayerOf
    (read in place on GPU); off GPU `linear` slices the layer out, so the step equals the default exactly."""
    from ddtree_jax import dispatch
    from ddtree_jax.models import layers
    from ddtree_jax.tree import ancestor_mask, build_tree

    rng = np.random.default_rng(6)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 6)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 5, jnp.array([3, 5], jnp.int32))
    seen = []
    sliced = layers.LayerOf.get

    def get(self):  # records which weights reached `linear` stacked
        seen.append(self.stack.shape)
        return sliced(self)

    def run():
        cache = deepseek_v3.create_cache(TINY, 2, 24, jnp.float32)
        _, _, cache = deepseek_v3.prefill(TINY, tiny_params, cache, prefix, jnp.array([6, 4], jnp.int32))
        return deepseek_v3.tree_forward(TINY, tiny_params, cache, tree.tokens, tree.depths, ancestor_mask(tree))[:2]

    want = run()
    asked = []

    def stacked_in_place(name, rows):
        asked.append((name, rows))
        return name in ("q_a_proj", "o_proj")

    monkeypatch.setattr(dispatch, "stacked_in_place", stacked_in_place)
    monkeypatch.setattr(layers.LayerOf, "get", get)
    got = run()
    for stack in ("dense_layers", "moe_layers"):
        for name in ("q_a_proj", "o_proj"):
            assert tiny_params[stack][name].shape in seen, (stack, name)
    assert {rows for _, rows in asked} == {2 * 6, 2 * tree.tokens.shape[1]}  # B x T: the prefill, the verify
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_absorbed_products_as_reductions_equal_the_dots(tiny_params, monkeypatch):
    """dispatch.MLA_REDUCE_MAX_ROWS: W_UK / W_UV applied as broadcast products and sums = the dots (float32)."""
    from ddtree_jax import dispatch
    from ddtree_jax.tree import ancestor_mask, build_tree

    rng = np.random.default_rng(8)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 6)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 5, jnp.array([4, 6], jnp.int32))

    def run():
        cache = deepseek_v3.create_cache(TINY, 2, 24, jnp.float32)
        _, _, cache = deepseek_v3.prefill(TINY, tiny_params, cache, prefix, jnp.array([6, 3], jnp.int32))
        return deepseek_v3.tree_forward(TINY, tiny_params, cache, tree.tokens, tree.depths, ancestor_mask(tree))[:2]

    want = run()
    monkeypatch.setattr(dispatch, "MLA_REDUCE_MAX_ROWS", 1 << 20)
    got = run()
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    q_nope = jnp.asarray(rng.standard_normal((1, 1, 3, 4)), jnp.float32)
    w_uk = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(deepseek_v3._absorb_query(q_nope, w_uk)), np.einsum("bthn,hnr->bthr", q_nope, w_uk), rtol=1e-6
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_group=0), "n_group must be >= 1, got 0"),  # was a ZeroDivisionError
        # past the kept groups' experts routing picked masked experts (or lax.top_k failed late)
        (dict(num_experts_per_tok=100), r"num_experts_per_tok \(100\) must be in \[1, topk_group x experts a group"),
        (dict(num_experts_per_tok=0), r"num_experts_per_tok \(0\) must be in \[1, "),
        (dict(tapped_layers=(7, -1)), r"tapped_layers \[7, -1\] are outside \[0, num_layers"),  # were clamped / wrapped
    ],
)
def test_the_config_names_routing_and_tap_settings_it_cannot_run(change, message):
    import dataclasses

    from ddtree_jax.presets import preset

    with pytest.raises(ValueError, match=message):
        dataclasses.replace(preset("kimi-k2-mesh-tiny"), **change)
