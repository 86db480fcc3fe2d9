"""models.cache: the row writes into the stacked caches, against plain numpy on random data."""

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models.cache import write_layer_rows, write_rows


def test_write_layer_rows_writes_one_layer_of_the_stack_at_each_rows_start():
    rng = np.random.default_rng(3)
    layers, batch, capacity, heads, dim, steps = 3, 4, 11, 2, 5, 4
    stack = rng.standard_normal((layers, batch, capacity, heads, dim)).astype(np.float32)
    new = rng.standard_normal((batch, steps, heads, dim)).astype(np.float32)
    start = np.array([0, 3, 7, 5], np.int32)  # ragged starts; row 2 ends exactly at the capacity
    for layer in range(layers):
        got = np.asarray(write_layer_rows(jnp.asarray(stack), layer, jnp.asarray(new), jnp.asarray(start)))
        want = stack.copy()
        for b in range(batch):
            want[layer, b, start[b] : start[b] + steps] = new[b]
        np.testing.assert_array_equal(got, want)
        # the same as writing into the layer's slice (the per-layer `write_rows`) and putting it back
        sliced = np.asarray(write_rows(jnp.asarray(stack[layer]), jnp.asarray(new), jnp.asarray(start)))
        np.testing.assert_array_equal(got[layer], sliced)


def test_write_layer_rows_at_one_row_is_one_in_place_update():
    """B = 1 (the decode step at batch 1): a dynamic_update_slice, equal to the scatter's rows for every layer
    (traced, and negative from the end); the program reads no old rows (no scatter, no slice)."""
    rng = np.random.default_rng(4)
    layers, capacity, dim = 3, 13, 6
    stack = rng.standard_normal((layers, 1, capacity, 1, dim)).astype(np.float32)
    for steps, start in ((1, 0), (1, 12), (5, 4), (5, 8)):  # the last rows, and a write ending at the capacity
        new = rng.standard_normal((1, steps, 1, dim)).astype(np.float32)
        write = jax.jit(write_layer_rows)
        for layer in (0, 2, -1):
            got = np.asarray(write(jnp.asarray(stack), jnp.int32(layer), jnp.asarray(new), jnp.asarray([start])))
            want = stack.copy()
            want[layer, 0, start : start + steps] = new[0]
            np.testing.assert_array_equal(got, want)
    text = write.lower(jnp.asarray(stack), jnp.int32(0), jnp.asarray(new), jnp.asarray([start])).as_text()
    assert "dynamic_update_slice" in text and "scatter" not in text and "stablehlo.dynamic_slice" not in text


def test_write_layer_rows_at_one_row_clamps_out_of_range_writes():
    """Out of range at B = 1 (callers check room first: `check_room`): a write that would pass S lands on the last T
    rows, as `write_rows`' dynamic_update_slice puts it, and a layer past the stack on its last layer."""
    rng = np.random.default_rng(6)
    stack = rng.standard_normal((3, 1, 13, 1, 4)).astype(np.float32)
    new = rng.standard_normal((1, 5, 1, 4)).astype(np.float32)
    got = np.asarray(write_layer_rows(jnp.asarray(stack), jnp.int32(3), jnp.asarray(new), jnp.asarray([11])))
    want = stack.copy()
    want[2, 0, 8:13] = new[0]
    np.testing.assert_array_equal(got, want)
    sliced = np.asarray(write_rows(jnp.asarray(stack[2]), jnp.asarray(new), jnp.asarray([11])))
    np.testing.assert_array_equal(got[2], sliced)


def test_write_layer_rows_casts_to_the_cache_dtype():
    stack = jnp.zeros((2, 1, 6, 1, 2), jnp.bfloat16)
    new = jnp.full((1, 2, 1, 2), 1.5, jnp.float32)
    got = write_layer_rows(stack, 1, new, jnp.asarray([2], jnp.int32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[1, 0, 2:4], np.float32), np.full((2, 1, 2), 1.5))
    assert float(jnp.abs(got[0]).sum()) == 0 and float(jnp.abs(got[1, 0, :2]).sum()) == 0


def _commit_reference(k, lengths, accept_index, num_accepted):
    """numpy: row b's accepted slots accept_index[b, :n + 1] (n = num_accepted[b]; -1: commit nothing) move to
    rows lengths[b] .. lengths[b] + n, read from the cache before any write."""
    out = k.copy()
    for b in range(k.shape[1]):
        for j in range(num_accepted[b] + 1):
            out[:, b, lengths[b] + j] = k[:, b, lengths[b] + accept_index[b, j]]
    return out


def test_commit_moves_the_accepted_slots_down_in_every_layer():
    """Random caches and accepted paths (increasing slots, as the tree's pop order gives), ragged lengths, a row
    that commits nothing (-1) and one that accepts the whole path; the lengths advance by n + 1."""
    from ddtree_jax.models.cache import KVCache, commit

    rng = np.random.default_rng(5)
    layers, batch, capacity, heads, dim, slots, steps = 3, 4, 40, 2, 3, 9, 5
    lengths = np.array([0, 7, 20, 31], np.int32)
    num_accepted = np.array([2, -1, 4, 0], np.int32)
    accept_index = np.full((batch, steps), -1, np.int32)
    for b in range(batch):
        path = np.sort(rng.choice(np.arange(1, slots), size=steps - 1, replace=False))
        accept_index[b, : max(num_accepted[b] + 1, 0)] = np.concatenate([[0], path])[: max(num_accepted[b] + 1, 0)]
    k = rng.standard_normal((layers, batch, capacity, heads, dim)).astype(np.float32)
    v = rng.standard_normal((layers, batch, capacity, heads, dim)).astype(np.float32)
    cache = KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    got = commit(cache, jnp.asarray(accept_index), jnp.asarray(num_accepted))
    np.testing.assert_array_equal(np.asarray(got.k), _commit_reference(k, lengths, accept_index, num_accepted))
    np.testing.assert_array_equal(np.asarray(got.v), _commit_reference(v, lengths, accept_index, num_accepted))
    np.testing.assert_array_equal(np.asarray(got.lengths), lengths + num_accepted + 1)


def test_commit_names_bad_paths_and_lengths_past_the_capacity_eagerly():
    """commit checked nothing: lengths could pass the capacity (the error came from a later prefill) and a -1 slot
    was committed as a row (start - 1 copied)."""
    import pytest

    from ddtree_jax.models.cache import KVCache, commit

    k = jnp.zeros((1, 1, 8, 1, 2))
    cache = KVCache(k, k, jnp.array([6], jnp.int32))
    for accept, n, message in (
        ([[0, 1, -1, -1]], [9], r"num_accepted\[0\] = 9 is outside \[-1, 4\)"),
        ([[0, 1, 2, -1]], [2], "passes the cache's capacity 8"),
        ([[0, -1, -1, -1]], [1], r"accept_index\[0, :2\] = \[0, -1\]"),
        ([[1, 2, -1, -1]], [1], "must start at the root"),
        ([[0, 3, 2, -1]], [2], "increase"),
    ):
        with pytest.raises(ValueError, match=message):
            commit(cache, jnp.asarray(accept, jnp.int32), jnp.asarray(n, jnp.int32))
    # -1 commits nothing (the engine's finished rows); under jit nothing is checked
    assert int(commit(cache, jnp.array([[0, -1, -1, -1]], jnp.int32), jnp.array([-1], jnp.int32)).lengths[0]) == 6
    assert (
        int(jax.jit(commit)(cache, jnp.array([[0, 1, -1, -1]], jnp.int32), jnp.array([1], jnp.int32)).lengths[0]) == 8
    )


def test_a_model_pass_names_bad_inputs_eagerly():
    """prefill / append_context / tree_forward took num_new past T (unwritten rows counted as committed), negative
    lengths, token ids past the vocabulary (the embedding lookup clamps), head_rows past T (NaN logits) and a tree
    mask of the wrong shape (an obscure broadcasting error)."""
    import pytest

    from ddtree_jax.models import dflash, qwen3
    from ddtree_jax.models.cache import KVCache
    from ddtree_jax.presets import preset_pair

    config, drafter_config = preset_pair("qwen3-tiny")
    params = qwen3.init_params(config, jax.random.key(0))
    cache = qwen3.create_cache(config, 2, 16)
    ids = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    for kwargs, message in (
        (dict(num_new=jnp.array([10, 3])), r"num_new must lie in \[0, 3\], got \[10, 3\]"),
        (dict(num_new=jnp.array([-2, 3])), r"num_new must lie in \[0, 3\]"),
        (dict(input_ids=ids.at[0, 2].set(config.vocab_size + 1000)), r"token id .* at \[0, 2\] is outside"),
        (dict(input_ids=ids.at[1, 0].set(-1)), r"token id -1 at \[1, 0\] is outside"),
        (dict(head_rows=jnp.array([3, 0])), r"head_rows must lie in \[0, 2\]"),
        (dict(cache=KVCache(cache.k, cache.v, jnp.array([-5, 0], jnp.int32))), "cache lengths must be >= 0"),
    ):
        args = dict(cache=cache, input_ids=ids, num_new=jnp.array([3, 3]), head_rows=None) | kwargs
        with pytest.raises(ValueError, match=message):
            qwen3.prefill(
                config, params, args["cache"], args["input_ids"], args["num_new"], head_rows=args["head_rows"]
            )
    with pytest.raises(ValueError, match=r"tree_mask must be \[B, N, N\] = \(2, 3, 3\)"):
        qwen3.tree_forward(config, params, cache, ids, jnp.zeros_like(ids), jnp.ones((2, 4, 4), bool))
    drafter_params = dflash.init_params(drafter_config, config.hidden_size, jax.random.key(1))
    context = dflash.create_context_cache(drafter_config, 1, 16)
    features = jnp.zeros((1, 3, len(drafter_config.target_layers) * config.hidden_size))
    with pytest.raises(ValueError, match=r"num_new must lie in \[0, 3\], got \[9\]"):
        dflash.append_context(drafter_config, drafter_params, context, features, jnp.array([9]))
