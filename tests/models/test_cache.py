"""models.cache: the row writes into the stacked caches, against plain numpy on random data."""

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


def test_write_layer_rows_casts_to_the_cache_dtype():
    stack = jnp.zeros((2, 1, 6, 1, 2), jnp.bfloat16)
    new = jnp.full((1, 2, 1, 2), 1.5, jnp.float32)
    got = write_layer_rows(stack, 1, new, jnp.asarray([2], jnp.int32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[1, 0, 2:4], np.float32), np.full((2, 1, 2), 1.5))
    assert float(jnp.abs(got[0]).sum()) == 0 and float(jnp.abs(got[1, 0, :2]).sum()) == 0
