"""Qwen3 target: cached passes against the plain causal forward (prefill / decode, tree verify, commit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import Qwen3Config, default_tapped_layers
from ddtree_jax.models import qwen3
from ddtree_jax.models.cache import KVCache, commit, gather_accepted
from ddtree_jax.tree import ancestor_mask, build_tree
from tests.models.impl_parity import relerr

CONFIG = Qwen3Config(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10_000.0,
    tapped_layers=(0, 2),
)
TOL = 2e-5  # float32 throughout; differences are reduction order only


@pytest.fixture(scope="module")
def params():
    return qwen3.init_params(CONFIG, jax.random.key(0), norm_jitter=0.2)


def _cache(batch, capacity=48):
    return KVCache.create(CONFIG.num_layers, batch, capacity, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)


PAD = 24  # reference sequences are padded to one length: one compilation (causal, so padding is inert)


@jax.jit
def _causal_at(params, seq, last):
    """Logits and tapped features of the causal forward at position `last` of a padded sequence."""
    logits = qwen3.forward_logits(CONFIG, params, seq[None])[0, last]
    cache = KVCache.create(CONFIG.num_layers, 1, PAD, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    _, features, _ = qwen3.prefill(CONFIG, params, cache, seq[None], jnp.array([PAD], jnp.int32))
    return logits, features[0, last]


def _reference(params, seq):
    padded = np.zeros(PAD, np.int32)
    padded[: len(seq)] = seq
    return _causal_at(params, jnp.asarray(padded), len(seq) - 1)


def _prefill_ragged(params, tokens, lengths, capacity=48):
    cache = _cache(tokens.shape[0], capacity)
    return qwen3.prefill(CONFIG, params, cache, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32))


def test_prefill_then_decode_equals_full_forward(params):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CONFIG.vocab_size, (3, 12)).astype(np.int32)
    full = qwen3.forward_logits(CONFIG, params, jnp.asarray(tokens))
    lengths = np.array([5, 1, 9])
    logits, _, cache = _prefill_ragged(params, tokens, lengths)
    for b in range(3):
        assert relerr(logits[b, : lengths[b]], full[b, : lengths[b]]) < TOL
    # decode one token at a time from each row's own length
    for step in range(12 - lengths.max()):
        pos = lengths + step
        step_logits, _, cache = qwen3.prefill(
            CONFIG, params, cache, jnp.asarray(tokens[np.arange(3), pos][:, None]), jnp.ones(3, jnp.int32)
        )
        for b in range(3):
            assert relerr(step_logits[b, 0], full[b, pos[b]]) < TOL
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 12 - lengths.max())


def _tree_case(seed, batch, budget, depth=4):
    rng = np.random.default_rng(seed)
    draft = (rng.standard_normal((batch, depth, CONFIG.vocab_size)) * 2).astype(np.float32)
    roots = rng.integers(0, CONFIG.vocab_size, batch).astype(np.int32)
    tree = build_tree(draft, budget, roots)
    prefix = rng.integers(0, CONFIG.vocab_size, (batch, 10)).astype(np.int32)
    lengths = rng.integers(0, 11, batch)
    lengths[0] = 0  # an empty prefix
    return tree, prefix, lengths


def _path_tokens(tree, b, i):
    parents, tokens = np.asarray(tree.parents[b]), np.asarray(tree.tokens[b])
    path = []
    while i >= 0:
        path.append(int(tokens[i]))
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("budget", [1, 6, 21])
def test_verify_logits_equal_the_causal_path(params, budget):
    batch = 3
    tree, prefix, lengths = _tree_case(budget, batch, budget)
    _, _, cache = _prefill_ragged(params, prefix, lengths)
    logits, features, cache = qwen3.tree_forward(CONFIG, params, cache, tree.tokens, tree.depths, ancestor_mask(tree))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)  # verify never moves lengths
    for b in range(batch):
        for i in range(int(tree.num_nodes[b])):
            seq = np.concatenate([prefix[b, : lengths[b]], _path_tokens(tree, b, i)]).astype(np.int32)
            ref_logits, ref_features = _reference(params, seq)
            assert relerr(logits[b, i], ref_logits) < TOL, (b, i)
            assert relerr(features[b, i], ref_features) < TOL  # the tapped layers' outputs there


def test_commit_then_continue_equals_uninterrupted_decoding(params):
    batch, budget = 3, 12
    tree, prefix, lengths = _tree_case(7, batch, budget)
    _, _, cache = _prefill_ragged(params, prefix, lengths)
    _, features, cache = qwen3.tree_forward(CONFIG, params, cache, tree.tokens, tree.depths, ancestor_mask(tree))
    # accept a root-to-leaf path of varying length in each row (deepest node, its parent, root only)
    accept = np.full((batch, tree.max_depth + 1), -1, np.int32)
    num_accepted = np.zeros(batch, np.int32)
    for b, kind in enumerate(["deepest", "parent of deepest", "root"]):
        deepest = int(np.argmax(np.asarray(tree.depths[b])))
        target = {"deepest": deepest, "parent of deepest": int(tree.parents[b, deepest]), "root": 0}[kind]
        path, i = [], target
        while i >= 0:
            path.append(i)
            i = int(tree.parents[b, i])
        path = path[::-1]
        accept[b, : len(path)] = path
        num_accepted[b] = len(path) - 1
    cache = commit(cache, jnp.asarray(accept), jnp.asarray(num_accepted))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + num_accepted + 1)
    # continue with 3 new tokens; compare with one causal forward over prefix + accepted + new
    rng = np.random.default_rng(8)
    new = rng.integers(0, CONFIG.vocab_size, (batch, 3)).astype(np.int32)
    cont, _, _ = qwen3.prefill(CONFIG, params, cache, jnp.asarray(new), jnp.full(batch, 3, jnp.int32))
    for b in range(batch):
        accepted_tokens = [int(tree.tokens[b, s]) for s in accept[b, : num_accepted[b] + 1]]
        seq = np.concatenate([prefix[b, : lengths[b]], accepted_tokens, new[b]]).astype(np.int32)
        for j in range(3):
            assert relerr(cont[b, j], _reference(params, seq[: len(seq) - 2 + j])[0]) < TOL
    picked = np.asarray(gather_accepted(features, jnp.asarray(accept), jnp.asarray(num_accepted)))
    for b in range(batch):
        n = num_accepted[b]
        np.testing.assert_array_equal(picked[b, : n + 1], np.asarray(features)[b, accept[b, : n + 1]])
        assert (picked[b, n + 1 :] == 0).all()


def test_param_axes_cover_every_parameter_and_config_validation(params):
    axes = qwen3.param_axes(CONFIG)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)
    for arr, names in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert arr.ndim == len(names)
    tied = Qwen3Config(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    assert "lm_head" not in qwen3.init_params(tied, jax.random.key(1))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Qwen3Config(**{**CONFIG.__dict__, "num_kv_heads": 3})
    with pytest.raises(ValueError, match=r"tapped_layers \[5\]"):
        Qwen3Config(**{**CONFIG.__dict__, "tapped_layers": (0, 5)})
    assert default_tapped_layers(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B-DFlash (models.md)
    assert default_tapped_layers(61, 6) == (1, 12, 24, 35, 47, 58)  # Kimi drafters (models.md)
    assert default_tapped_layers(36, 1) == (18,)  # one drafter layer: the middle layer, as DFlash's own rule


def test_a_write_past_the_cache_end_is_an_error(params):
    cache = _cache(1, capacity=8)
    with pytest.raises(ValueError, match="KV cache too small: a row needs 9 rows, capacity is 8"):
        qwen3.prefill(CONFIG, params, cache, jnp.zeros((1, 9), jnp.int32), jnp.array([9], jnp.int32))


# --- layer_loop: "scan" (lax.scan over the stacked layers) against "unrolled" (one layer copy per layer)

LOOP_TOL = 1e-5


@pytest.fixture(scope="module")
def loop_params():
    return qwen3.init_params(CONFIG, jax.random.key(11), norm_jitter=0.3)


def _assert_loops_agree(outs):
    """outs: {layer_loop: (logits, features[, cache])}; float leaves within LOOP_TOL, int leaves equal."""
    scan, unrolled = jax.tree.leaves(outs["scan"]), jax.tree.leaves(outs["unrolled"])
    assert len(scan) == len(unrolled)
    for a, b in zip(scan, unrolled):
        assert a.shape == b.shape and a.dtype == b.dtype
        if jnp.issubdtype(b.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert np.abs(np.asarray(b)).max() > 0  # not a vacuous comparison
            assert relerr(a, b) < LOOP_TOL


def test_scan_equals_unrolled_forward(loop_params):
    tokens = jnp.asarray(np.random.default_rng(21).integers(0, CONFIG.vocab_size, (2, 10)), jnp.int32)
    outs = {loop: qwen3.forward_features(CONFIG, loop_params, tokens, layer_loop=loop) for loop in qwen3.LAYER_LOOPS}
    _assert_loops_agree(outs)
    assert outs["scan"][1].shape == (2, 10, len(CONFIG.tapped_layers) * CONFIG.hidden_size)
    logits = {loop: qwen3.forward_logits(CONFIG, loop_params, tokens, layer_loop=loop) for loop in qwen3.LAYER_LOOPS}
    _assert_loops_agree(logits)


def test_scan_equals_unrolled_prefill_on_ragged_rows(loop_params):
    rng = np.random.default_rng(22)
    prefix = rng.integers(0, CONFIG.vocab_size, (3, 8)).astype(np.int32)
    _, _, cache = _prefill_ragged(loop_params, prefix, np.array([3, 0, 8]), capacity=24)  # ragged start rows
    new = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 7)), jnp.int32)
    num_new = jnp.array([7, 2, 4], jnp.int32)
    outs = {
        loop: qwen3.prefill(CONFIG, loop_params, cache, new, num_new, layer_loop=loop) for loop in qwen3.LAYER_LOOPS
    }
    _assert_loops_agree(outs)
    np.testing.assert_array_equal(np.asarray(outs["scan"][2].lengths), [10, 2, 12])


def test_scan_equals_unrolled_verify_on_a_tree(loop_params):
    tree, prefix, lengths = _tree_case(23, 3, budget=9)
    _, _, cache = _prefill_ragged(loop_params, prefix, lengths, capacity=24)
    outs = {
        loop: qwen3.tree_forward(
            CONFIG, loop_params, cache, tree.tokens, tree.depths, ancestor_mask(tree), layer_loop=loop
        )
        for loop in qwen3.LAYER_LOOPS
    }
    _assert_loops_agree(outs)
    np.testing.assert_array_equal(np.asarray(outs["scan"][2].lengths), lengths)


def test_an_unknown_layer_loop_is_an_error(loop_params):
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"layer_loop must be one of \('scan', 'unrolled'\), got 'loop'"):
        qwen3.forward_logits(CONFIG, loop_params, tokens, layer_loop="loop")
    with pytest.raises(ValueError, match="'loop'"):
        qwen3.prefill(CONFIG, loop_params, _cache(1, capacity=8), tokens, jnp.array([4], jnp.int32), layer_loop="loop")


def test_unstacked_layers_give_the_same_tree_forward(loop_params):
    """`unstack_layers` (what generate does before its loop) under both layer loops equals the stacked
    parameters bit for bit; restack_layers inverts it."""
    from ddtree_jax.models.layers import restack_layers, unstack_layers

    layers = unstack_layers(loop_params["layers"], CONFIG.num_layers)
    assert isinstance(layers, tuple) and len(layers) == CONFIG.num_layers
    assert unstack_layers(layers, CONFIG.num_layers) == layers
    for a, b in zip(jax.tree.leaves(restack_layers(layers)), jax.tree.leaves(loop_params["layers"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    unstacked = {**loop_params, "layers": layers}
    tree, prefix, lengths = _tree_case(24, 2, budget=7)
    _, _, cache = _prefill_ragged(loop_params, prefix, lengths, capacity=24)
    for loop in qwen3.LAYER_LOOPS:
        want = qwen3.tree_forward(
            CONFIG, loop_params, cache, tree.tokens, tree.depths, ancestor_mask(tree), layer_loop=loop
        )
        got = qwen3.tree_forward(
            CONFIG, unstacked, cache, tree.tokens, tree.depths, ancestor_mask(tree), layer_loop=loop
        )
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
