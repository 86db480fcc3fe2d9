"""verify_step's input checks: out-of-vocabulary draft tokens and non-float target logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import INVALID_TOKEN, SamplingParams, row_keys
from ddtree_jax.tree import build_tree
from ddtree_jax.verify import verify_step

VOCAB = 10


def _case(batch=3, budget=4):
    draft = jax.random.normal(jax.random.key(0), (batch, 3, VOCAB)) * 2.0
    tree = build_tree(draft, budget, jnp.arange(batch, dtype=jnp.int32) % VOCAB)
    logits = jax.random.normal(jax.random.key(1), (batch, tree.num_slots, VOCAB)) * 2.0
    params = SamplingParams.create(batch, temperature=([0.0, 1.0, 1.0] * batch)[:batch])
    keys = row_keys(jax.random.key(2), jnp.arange(batch))
    return tree, logits, params, keys


def _with_token(tree, row, slot, token):
    return dataclasses.replace(tree, tokens=tree.tokens.at[row, slot].set(token))


@pytest.mark.parametrize("token", [VOCAB, 15, -3])
def test_out_of_vocabulary_draft_token_raises_eagerly(token):
    tree, logits, params, keys = _case()
    bad = _with_token(tree, 1, 2, token)
    with pytest.raises(ValueError, match=rf"row 1, slot 2: token {token} .*V={VOCAB}"):
        verify_step(bad, logits, params, keys)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_out_of_vocabulary_draft_token_makes_the_row_invalid_under_jit(impl):
    tree, logits, params, keys = _case()
    bad = _with_token(tree, 1, 2, 15)
    run = jax.jit(lambda t: verify_step(t, logits, params, keys, impl=impl))
    got, want = run(bad), run(tree)
    assert int(got.num_accepted[1]) == 0
    assert (np.asarray(got.tokens[1]) == INVALID_TOKEN).all()
    assert np.asarray(got.accept_index[1]).tolist() == [0] + [-1] * tree.max_depth
    for row in (0, 2):  # other rows unchanged
        np.testing.assert_array_equal(np.asarray(got.tokens[row]), np.asarray(want.tokens[row]))


def test_padding_and_root_tokens_are_not_checked():
    tree, logits, params, keys = _case(budget=40)
    tree = dataclasses.replace(tree, num_nodes=jnp.minimum(tree.num_nodes, 3))
    want = verify_step(tree, logits, params, keys)
    padded = _with_token(_with_token(tree, 0, 5, 99), 0, 0, 99)  # slot 5 is padding; slot 0 the root
    got = verify_step(padded, logits, params, keys)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.float64])
def test_non_float_target_logits_are_rejected(dtype):
    tree, logits, params, keys = _case()
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        verify_step(tree, np.asarray(logits).astype(dtype), params, keys)


def test_float16_and_bfloat16_target_logits_are_accepted():
    tree, logits, params, keys = _case()
    for dtype in (jnp.float16, jnp.bfloat16):
        verify_step(tree, logits.astype(dtype), params, keys)
    # the fused kernel reads float32 / bfloat16: float16 is widened for it (it raised on "pallas", so on GPU's "auto")
    want = verify_step(tree, logits.astype(jnp.float16), params, keys, impl="xla")
    got = verify_step(tree, logits.astype(jnp.float16), params, keys, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_duplicate_sibling_tokens_raise_eagerly():
    """Two siblings with one token: its target mass would be tested twice (the first token's law was 1.0 where the
    target gives 0.7); eagerly a ValueError, as verify_sampling's own check."""
    tree, logits, params, keys = _case(batch=1)
    children = np.flatnonzero(np.asarray(tree.parents[0]) == 0)
    assert len(children) >= 2
    bad = _with_token(tree, 0, int(children[1]), int(tree.tokens[0, children[0]]))
    with pytest.raises(ValueError, match="are siblings .* with the same token"):
        verify_step(bad, logits, params, keys)


def test_verify_greedy_marks_rows_of_invalid_logits_at_read_slots():
    """argmax takes NaN for the largest value: a NaN at the root's row gave a plausible token. Now the row is
    invalid under jit and a ValueError eagerly; a NaN at a slot the walk never reads changes nothing."""
    from ddtree_jax.tree import verification_order
    from ddtree_jax.verify import verify_greedy

    tree, logits, params, keys = _case()
    next_token, next_sibling = verification_order(tree, "draft", keys)
    lists = (tree.tokens, next_token, next_sibling)
    greedy = jax.jit(lambda logits: verify_greedy(*lists, logits, max_accept=tree.max_depth, check=False))
    clean = greedy(logits)
    bad = greedy(logits.at[1, 0, 3].set(jnp.nan))
    assert np.asarray(bad.tokens)[1].tolist() == [INVALID_TOKEN] * (tree.max_depth + 1)
    assert int(bad.num_accepted[1]) == 0
    for row in (0, 2):
        np.testing.assert_array_equal(np.asarray(bad.tokens)[row], np.asarray(clean.tokens)[row])
    with pytest.raises(ValueError, match="target_logits row 1: a slot the walk reads holds NaN"):
        verify_greedy(*lists, logits.at[1, 0, 3].set(jnp.nan), max_accept=tree.max_depth)
    read = set(np.asarray(clean.accept_index)[0].tolist()) - {-1}
    unread = next(i for i in range(tree.num_slots) if i not in read)
    same = verify_greedy(*lists, logits.at[0, unread, 0].set(jnp.nan), max_accept=tree.max_depth)
    np.testing.assert_array_equal(np.asarray(same.tokens), np.asarray(clean.tokens))
    with pytest.raises(ValueError, match=r"target_logits must be \[B, N, V\]"):
        verify_greedy(*lists, logits[:, 1:], max_accept=tree.max_depth)


BAD_SETTINGS = [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_k", -3),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("min_p", 1.0),
    ("min_p", -1.0),
    ("min_p", float("nan")),
]
BAD_ROWS = len(BAD_SETTINGS)  # rows 0 .. BAD_ROWS - 1 each have one bad setting; the last two rows are good


def _bad_settings_case():
    """(tree, logits, keys, good params, build): a batch of BAD_ROWS + 2 rows; build(values) makes SamplingParams
    inside jit (nothing can raise there) with row i's BAD_SETTINGS[i] field set to values[i]."""
    batch = BAD_ROWS + 2
    tree, logits, _, keys = _case(batch=batch)
    good = SamplingParams.create(batch, temperature=[0.7, 1.0] * (batch // 2), top_p=0.9)

    def build(values):
        rows = {name: getattr(good, name) for name in ("temperature", "top_k", "top_p", "min_p")}
        for i, (field, _) in enumerate(BAD_SETTINGS):
            rows[field] = rows[field].at[i].set(values[i].astype(rows[field].dtype))
        return SamplingParams(**rows)

    bad = jnp.asarray([value for _, value in BAD_SETTINGS], jnp.float32)
    valid = jnp.asarray([float(getattr(good, field)[i]) for i, (field, _) in enumerate(BAD_SETTINGS)], jnp.float32)
    return tree, logits, keys, build, bad, valid


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_out_of_range_settings_make_the_row_invalid_under_jit(impl):
    """Under jit `SamplingParams` cannot raise: a row whose settings `validate` would refuse (each of BAD_SETTINGS,
    one a row) is an invalid row (num_accepted 0, INVALID_TOKEN), not a row sampled with a clamped or NaN setting;
    with valid settings the same rows emit, and the good rows are unchanged."""
    tree, logits, keys, build, bad, valid = _bad_settings_case()
    run = jax.jit(lambda v: verify_step(tree, logits, build(v), keys, impl=impl))
    got, want = run(bad), run(valid)
    assert (np.asarray(got.num_accepted[:BAD_ROWS]) == 0).all()
    assert (np.asarray(got.tokens[:BAD_ROWS]) == INVALID_TOKEN).all()
    assert (np.asarray(want.tokens[:BAD_ROWS, 0]) != INVALID_TOKEN).all()
    np.testing.assert_array_equal(np.asarray(got.tokens[BAD_ROWS:]), np.asarray(want.tokens[BAD_ROWS:]))


def test_out_of_range_settings_give_no_token_and_no_distribution_under_jit():
    from ddtree_jax.sampling import processed_probs, sample

    tree, logits, keys, build, bad, valid = _bad_settings_case()
    tokens = jax.jit(lambda v: sample(logits[:, 0], build(v), keys))
    probs = np.asarray(jax.jit(lambda v: processed_probs(logits[:, 0], build(v)))(bad))
    assert (np.asarray(tokens(bad))[:BAD_ROWS] == INVALID_TOKEN).all()
    assert (np.asarray(tokens(valid)) != INVALID_TOKEN).all()
    assert (probs[:BAD_ROWS] == 0).all()
    np.testing.assert_allclose(probs[BAD_ROWS:].sum(-1), 1.0, rtol=1e-5)
