import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import SamplingParams


def test_broadcast_and_fields():
    params = SamplingParams.create(3, temperature=[0.0, 0.7, 1.0], top_k=5, top_p=0.9, min_p=0.05)
    assert params.temperature.dtype == jnp.float32 and params.top_k.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(params.top_k), [5, 5, 5])
    np.testing.assert_array_equal(np.asarray(params.is_greedy), [True, False, False])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=[1.0, -0.5]), r"temperature\[1\] = -0.5"),
        (dict(temperature=[np.nan, 1.0]), r"temperature\[0\] = nan"),
        (dict(top_p=[0.0, 1.0]), r"top_p\[0\] = 0.0"),
        (dict(top_p=[1.0, 1.5]), r"top_p\[1\] = 1.5"),
        (dict(top_k=[-1, 0]), r"top_k\[0\] = -1"),
        (dict(top_k=[1.5, 0]), "top_k must be integers"),
        (dict(top_k=[0, 2**31]), r"top_k\[1\] = 2147483648 does not fit int32"),  # not wrapped to -2^31
        (dict(min_p=[0.0, 1.0]), r"min_p\[1\] = 1.0"),
        (dict(min_p=[np.nan, 0.0]), r"min_p\[0\] = nan"),
        (dict(temperature=[1.0, 1.0, 1.0]), r"shape \[B\] = \(2,\)"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.create(2, **kwargs)
