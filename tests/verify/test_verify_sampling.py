"""verify_sampling: a worked example and boundary cases, coin-for-coin agreement with the
line-by-line twin on random trees, duplicate siblings, large vocabularies, greedy equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import COIN_MAX, COIN_MIN, SamplingParams, processed_probs
from ddtree_jax.tree import build_tree, verification_order
from ddtree_jax.verify import verify_greedy, verify_sample_then_walk, verify_sampling
from tests.verify.walk_reference import walk_reference

# a worked example, the expected walks derived by hand: 0 -> {1, 3}, 1 -> 2, 3 -> 4 -> 5
EX_CAND = np.arange(6, dtype=np.int32)[None]
EX_NEXT = np.array([[1, 2, -1, 4, 5, -1]], np.int32)
EX_SIB = np.array([[-1, 3, -1, -1, -1, -1]], np.int32)


def _worked_example_probs(vocab=20):
    """Target probabilities of the worked example's slots where every coin matters (token: p):
    slot 0 {1: .2, 3: .5, 18: .3}, slot 1 {2: .6, 9: .4}, slot 2 {11: .5, 12: .5}, slot 3 {4: .9, 10: .1},
    slot 4 {5: .4, 13: .6}, slot 5 {14: .25, 15: .75}."""
    probs = np.zeros((1, 6, vocab), np.float32)
    for slot, dist in enumerate(
        (
            {1: 0.2, 3: 0.5, 18: 0.3},
            {2: 0.6, 9: 0.4},
            {11: 0.5, 12: 0.5},
            {4: 0.9, 10: 0.1},
            {5: 0.4, 13: 0.6},
            {14: 0.25, 15: 0.75},
        )
    ):
        for tok, p in dist.items():
            probs[0, slot, tok] = p
    return probs


def _coins(root, slot1=0.5, slot3=0.5, slot4=0.5):
    """Per-slot coins of the worked example (slots 2 and 5 are leaves: their coins are never read)."""
    return np.array([[root, slot1, 0.5, slot3, slot4, 0.5]], np.float32)


# (coins per slot, final coin) -> (accept_index, num_accepted, tokens), each derived by hand from the walk:
# at a slot with coin u, the children (in sibling order) are accepted on the inverse CDF of their target
# probabilities; u >= their sum rejects them all, and the final token is drawn with the final coin from
# the slot's probabilities without the rejected children (from the last accepted slot's, all of them).
WORKED_EXAMPLE_CASES = [
    # root u = 1e-7 < .2: token 1; slot 1 u < .6: token 2; slot 2 is a leaf: final .5 * 1 >= .5: token 12
    ((_coins(COIN_MIN, slot1=COIN_MIN), 0.5), ([0, 1, 2, -1], 2, [1, 2, 12, -1])),
    # root .1 < .2: token 1; slot 1 .7 >= .6 rejects token 2; final from {9: .4}: token 9
    ((_coins(0.1, slot1=0.7), 0.5), ([0, 1, -1, -1], 1, [1, 9, -1, -1])),
    # root .3 in [.2, .7): token 3; slot 3 .3 < .9: token 4; slot 4 .3 < .4: token 5; max_accept reached:
    # final from slot 5 {14: .25, 15: .75}: .2 < .25 -> 14, .3 -> 15
    ((_coins(0.3, slot3=0.3, slot4=0.3), 0.2), ([0, 3, 4, 5], 3, [3, 4, 5, 14])),
    ((_coins(0.3, slot3=0.3, slot4=0.3), 0.3), ([0, 3, 4, 5], 3, [3, 4, 5, 15])),
    # slot 4 .5 >= .4 rejects token 5: final from {13: .6}: token 13
    ((_coins(0.3, slot3=0.3, slot4=0.5), COIN_MIN), ([0, 3, 4, -1], 2, [3, 4, 13, -1])),
    # slot 3 .95 >= .9 rejects token 4: final from {10: .1}: token 10
    ((_coins(0.5, slot3=0.95), 0.5), ([0, 3, -1, -1], 1, [3, 10, -1, -1])),
    # root .8 >= .2 + .5 rejects tokens 1 and 3: final from {18: .3}: token 18
    ((_coins(0.8), COIN_MAX), ([0, -1, -1, -1], 0, [18, -1, -1, -1])),
]


@pytest.mark.parametrize("coins_and_final,expected", WORKED_EXAMPLE_CASES)
def test_worked_example(coins_and_final, expected):
    coins, final = coins_and_final
    res = verify_sampling(
        EX_CAND, EX_NEXT, EX_SIB, _worked_example_probs(), coins, np.array([final], np.float32), max_accept=3
    )
    accept, n_acc, tokens = expected
    assert np.asarray(res.accept_index).tolist() == [accept]
    assert np.asarray(res.num_accepted).tolist() == [n_acc]
    assert np.asarray(res.tokens).tolist() == [tokens]
    # the line-by-line twin walks the same way
    assert walk_reference(
        EX_CAND[0], EX_NEXT[0], EX_SIB[0], _worked_example_probs()[0], coins[0], np.float32(final), 3
    )[:3] == (accept, n_acc, tokens)


def on_the_edge_between(u, cdf, token_a, token_b, tol) -> bool:
    """Whether the coin position u lies within tol of an edge (cdf[t - 1] or cdf[t]) of token_a's CDF
    interval and of token_b's: the one boundary where two summation orders may draw a or b."""
    cdf = np.asarray(cdf, np.float64)
    near = lambda t: 0 <= t < len(cdf) and min(abs((cdf[t - 1] if t else 0.0) - u), abs(cdf[t] - u)) < tol  # noqa: E731
    return token_a != token_b and near(token_a) and near(token_b)


def test_on_the_edge_between():
    cdf = np.array([0.25, 0.25, 0.5, 1.0], np.float32)
    assert on_the_edge_between(np.float32(0.25), cdf, 0, 2, 1e-6)  # the edge between 0 and 2 (1 has no mass)
    assert on_the_edge_between(np.float32(0.5 + 1e-7), cdf, 2, 3, 1e-6)
    assert not on_the_edge_between(np.float32(0.5), cdf, 0, 3, 1e-6)  # u on a CDF edge, not between 0 and 3
    assert not on_the_edge_between(np.float32(0.25), cdf, 2, 3, 1e-6)
    assert not on_the_edge_between(np.float32(0.4), cdf, 0, 2, 1e-6)


def _fan(probs_row, coin, final_coin=0.5, max_accept=1):
    """Root with children = tokens 0..C-1 in order; returns (n_acc, tokens)."""
    c = len(probs_row)
    cand = np.arange(c + 1, dtype=np.int32)[None] - 1
    cand[0, 0] = 0
    nxt = np.full((1, c + 1), -1, np.int32)
    nxt[0, 0] = 1
    sib = np.full((1, c + 1), -1, np.int32)
    sib[0, 1:c] = np.arange(2, c + 1)
    probs = np.zeros((1, c + 1, c), np.float32)
    probs[0, 0] = probs_row
    probs[0, 1:] = 1.0 / c
    res = verify_sampling(
        cand,
        nxt,
        sib,
        probs,
        np.full((1, c + 1), coin, np.float32),
        np.array([final_coin], np.float32),
        max_accept=max_accept,
    )
    return int(res.num_accepted[0]), np.asarray(res.tokens[0]).tolist()


def test_coin_on_an_interior_boundary_goes_to_the_next_bucket():
    n_acc, tokens = _fan(np.array([0.25, 0.75], np.float32), coin=0.25)
    assert (n_acc, tokens[0]) == (1, 1)  # not token 0: 0.25 < 0.25 is false
    n_acc, tokens = _fan(np.array([0.25, 0.75], np.float32), coin=np.nextafter(np.float32(0.25), np.float32(0)))
    assert (n_acc, tokens[0]) == (1, 0)


def test_zero_probability_candidates_are_never_accepted_or_emitted():
    assert _fan(np.array([0.0, 1.0, 0.0], np.float32), coin=COIN_MIN)[1][0] == 1
    n_acc, tokens = _fan(np.array([0.0, 0.0, 1.0], np.float32), coin=COIN_MAX)
    assert tokens[0] == 2
    # no candidate has mass: every child rejected; the final sample avoids the zero-probability tokens
    cand = np.array([[0, 0, 1]], np.int32)
    probs = np.zeros((1, 3, 4), np.float32)
    probs[0, 0, 3] = 1.0
    res = verify_sampling(
        cand,
        np.array([[1, -1, -1]], np.int32),
        np.array([[-1, 2, -1]], np.int32),
        probs,
        np.full((1, 3), COIN_MAX, np.float32),
        np.array([COIN_MAX], np.float32),
        max_accept=2,
    )
    assert int(res.num_accepted[0]) == 0 and int(res.tokens[0, 0]) == 3


def test_siblings_covering_the_support_fall_back_within_the_vocab():
    third = np.float32(0.3333333)  # three of these sum to 0.9999999 < the largest coin
    n_acc, tokens = _fan(np.array([third, third, third], np.float32), coin=COIN_MAX, final_coin=COIN_MAX)
    assert n_acc == 0 and tokens[0] == 2  # residual is empty: the last rejected token, never an id >= V
    res = verify_sampling(
        EX_CAND,
        EX_NEXT,
        EX_SIB,
        np.zeros((1, 6, 7), np.float32),
        np.full((1, 6), 0.5, np.float32),
        np.array([0.5], np.float32),
        max_accept=3,
    )
    assert int(res.tokens[0, 0]) == 6  # nothing has mass anywhere: V - 1


def _random_tree_inputs(seed, batch, depth, vocab, budget, order="draft"):
    rng = np.random.default_rng(seed)
    tree = build_tree(
        (rng.standard_normal((batch, depth, vocab)) * 2).astype(np.float32),
        budget,
        rng.integers(0, vocab, batch).astype(np.int32),
    )
    nxt, sib = verification_order(tree, order, jax.random.key(seed))
    target = jnp.asarray(rng.standard_normal((batch, budget + 1, vocab)) * 2, jnp.float32)
    t = rng.choice([0.0, 0.6, 1.0, 1.5], batch)
    params = SamplingParams.create(
        batch,
        temperature=t,
        top_k=rng.choice([0, 3, 10], batch),
        top_p=rng.choice([1.0, 0.9], batch),
        min_p=rng.choice([0.0, 0.05], batch),
    )
    probs = processed_probs(target, params)
    coins = np.clip(rng.random((batch, budget + 1)).astype(np.float32), COIN_MIN, COIN_MAX)
    final = np.clip(rng.random(batch).astype(np.float32), COIN_MIN, COIN_MAX)
    return tree, nxt, sib, probs, coins, final, target


@pytest.mark.parametrize("order", ["draft", "reverse", "random"])
@pytest.mark.parametrize("vocab", [7, 8193])
def test_agrees_coin_for_coin_with_the_spec_twin(order, vocab):
    batch, depth, budget = 24, 4, 20
    tree, nxt, sib, probs, coins, final, target = _random_tree_inputs(vocab, batch, depth, vocab, budget, order)
    rng = np.random.default_rng(vocab)
    target = _follow_some_children(tree, nxt, sib, target, rng)
    params = SamplingParams.create(
        batch, temperature=rng.choice([0.0, 0.7, 1.0], batch), top_k=rng.choice([0, 5], batch)
    )
    probs = processed_probs(target, params)
    res = verify_sampling(tree.tokens, nxt, sib, probs, coins, final, max_accept=depth)
    assert float(np.asarray(res.num_accepted).mean()) > 0.5  # acceptance paths are exercised
    args = [np.asarray(a) for a in (tree.tokens, nxt, sib, probs)]
    for b in range(batch):
        accept, n_acc, tokens, (u, cdf) = walk_reference(
            args[0][b], args[1][b], args[2][b], args[3][b], coins[b], final[b], depth
        )
        assert np.asarray(res.accept_index[b]).tolist() == accept
        assert int(res.num_accepted[b]) == n_acc
        got = np.asarray(res.tokens[b]).tolist()
        if got != tokens:  # only the final draw may differ, and only where u sits on the CDF edge between
            assert got[:n_acc] == tokens[:n_acc]  # the two emitted tokens (cumsum order)
            assert on_the_edge_between(u, cdf, got[n_acc], tokens[n_acc], 1e-6 * max(1.0, float(cdf[-1]))), (
                b,
                u,
                got[n_acc],
                tokens[n_acc],
            )


def test_large_vocabularies_emit_tokens_with_mass():
    for vocab in (151936, 163840):
        tree, nxt, sib, probs, coins, final, _ = _random_tree_inputs(3, 4, 3, vocab, 8)
        res = verify_sampling(tree.tokens, nxt, sib, probs, coins, final, max_accept=3)
        tokens, n_acc, accept = (np.asarray(a) for a in (res.tokens, res.num_accepted, res.accept_index))
        probs = np.asarray(probs)
        for b in range(4):
            rows = accept[b, : n_acc[b] + 1]  # the slot whose row decided each emitted token
            for j, row in enumerate(rows):
                assert 0 <= tokens[b, j] < vocab and probs[b, row, tokens[b, j]] > 0


def _follow_some_children(tree, nxt, sib, target, rng, share=0.7):
    """Raise, at a `share` of the slots, the target logit of one of the slot's children to the top,
    so that walks go deep (otherwise random targets reject almost everything)."""
    target = np.asarray(target).copy()
    tokens, nxt, sib = (np.asarray(a) for a in (tree.tokens, nxt, sib))
    for b in range(target.shape[0]):
        for i in range(target.shape[1]):
            kids, cur = [], nxt[b, i]
            while cur != -1:
                kids.append(cur)
                cur = sib[b, cur]
            if kids and rng.random() < share:
                target[b, i, tokens[b, rng.choice(kids)]] = target[b, i].max() + 3.0
    return jnp.asarray(target)


def test_greedy_equals_sampling_on_one_hot_targets_and_sample_then_walk():
    batch, depth, vocab, budget = 16, 4, 9, 24
    tree, nxt, sib, _, coins, final, target = _random_tree_inputs(11, batch, depth, vocab, budget)
    target = _follow_some_children(tree, nxt, sib, target, np.random.default_rng(0))
    one_hot = processed_probs(target, SamplingParams.create(batch, temperature=0.0))
    a = verify_sampling(tree.tokens, nxt, sib, one_hot, coins, final, max_accept=depth)
    b = verify_greedy(tree.tokens, nxt, sib, target, max_accept=depth)
    c = verify_sample_then_walk(tree.tokens, nxt, sib, one_hot, coins, max_accept=depth)
    for x in (b, c):
        for name in ("accept_index", "num_accepted", "tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(x, name)))
    assert float(np.asarray(a.num_accepted).mean()) >= 1.0  # the walks really descend


def test_duplicate_siblings_and_bad_lists_are_rejected():
    cand = np.array([[0, 5, 5]], np.int32)
    nxt = np.array([[1, -1, -1]], np.int32)
    sib = np.array([[-1, 2, -1]], np.int32)
    probs = np.full((1, 3, 8), 1 / 8, np.float32)
    coins = np.full((1, 3), 0.5, np.float32)
    with pytest.raises(ValueError, match="slots 1 and 2 are siblings.*same token 5"):
        verify_sampling(cand, nxt, sib, probs, coins, np.array([0.5], np.float32), max_accept=2)
    with pytest.raises(ValueError, match=r"next_sibling\[0, 1\] = 7"):
        verify_sampling(
            cand, nxt, np.array([[-1, 7, -1]], np.int32), probs, coins, np.array([0.5], np.float32), max_accept=2
        )
    with pytest.raises(ValueError, match="max_accept"):
        verify_sampling(cand, nxt, sib, probs, coins, np.array([0.5], np.float32), max_accept=-1)
    with pytest.raises(ValueError, match="threshold_acc"):
        verify_sampling(cand, nxt, sib, probs, coins, np.array([0.5], np.float32), max_accept=2, threshold_acc=1.5)
