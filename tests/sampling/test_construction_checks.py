"""SamplingParams validates at construction (no unvalidated public path); row_keys rejects ids that wrap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import SamplingParams, row_keys


def _fields(**over):
    fields = dict(
        temperature=jnp.ones((3,), jnp.float32),
        top_k=jnp.zeros((3,), jnp.int32),
        top_p=jnp.ones((3,), jnp.float32),
        min_p=jnp.zeros((3,), jnp.float32),
    )
    fields.update({k: jnp.asarray(v) for k, v in over.items()})
    return fields


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(temperature=[1.0, -1.0, 1.0]), r"temperature\[1\] = -1.0"),
        (dict(top_p=[1.0, 1.0, 2.0]), r"top_p\[2\] = 2.0"),
        (dict(top_k=[0, -2, 0]), r"top_k\[1\] = -2"),
        (dict(min_p=[1.0, 0.0, 0.0]), r"min_p\[0\] = 1.0"),
    ],
)
def test_direct_construction_validates(over, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**_fields(**over))
    numpy_fields = {k: np.asarray(v) for k, v in _fields(**over).items()}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**numpy_fields)


def test_create_has_no_unvalidated_path():
    with pytest.raises(TypeError):
        SamplingParams.create(2, temperature=-1.0, validate=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.create(2, temperature=-1.0)


def test_sequences_booleans_and_float32_underflow_are_refused():
    """A direct construction from Python sequences (never a pytree leaf) names SamplingParams.create; create refuses
    booleans (top_k=True was k = 1) and values that round to 0 in float32 (temperature 1e-46 was greedy)."""
    with pytest.raises(ValueError, match=r"fields must be arrays \[B\].*SamplingParams.create"):
        SamplingParams([0.5], [0], [1.0], [0.0])
    with pytest.raises(ValueError, match="top_k must be numbers, got a boolean True"):
        SamplingParams.create(2, top_k=True)
    with pytest.raises(ValueError, match=r"temperature\[1\] = 1e-46 rounds to 0 in float32"):
        SamplingParams.create(2, temperature=[0.5, 1e-46])
    assert SamplingParams.create(2, temperature=1e-30).temperature[0] > 0  # representable: kept


def test_pytree_operations_still_work():
    params = SamplingParams.create(3, temperature=[0.0, 0.5, 1.0], top_k=2, top_p=0.9)
    # traced rebuilds, abstract rebuilds, stacked and scalar leaves: not checked, never raise
    inside = jax.jit(lambda p: jax.tree.map(lambda x: x * 0, p).top_p)(params)  # traced: unchecked
    assert np.asarray(inside).tolist() == [0.0, 0.0, 0.0]
    same = jax.jit(lambda p: p)(params)
    np.testing.assert_array_equal(np.asarray(same.temperature), np.asarray(params.temperature))
    jax.eval_shape(lambda p: p, params)
    jax.tree.map(lambda x: x[0], params)
    jax.tree.map(lambda x: jnp.stack([x, x]), params)
    jax.vmap(lambda p: p)(params)
    assert jax.tree.map(lambda x: x[1:], params).batch_size == 2


def test_row_keys_reject_ids_that_would_wrap():
    key = jax.random.key(0)
    row_keys(key, np.array([0, 2**32 - 1], np.int64))
    for bad in ([0, -1], np.array([3, 2**32], np.int64)):
        with pytest.raises(ValueError, match=r"request_ids\[1\] = .* outside \[0, 2\^32\)"):
            row_keys(key, bad)
    with pytest.raises(ValueError, match="integers"):
        row_keys(key, [0.5, 1.0])
    jax.jit(row_keys)(key, jnp.arange(3))  # traced ids: not checked
