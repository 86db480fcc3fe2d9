"""INT4 pack-quantized and block-FP8 weights: bit layout, dequantisation, round trip."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight, dense, quantize_int4


def test_int4_bit_layout_by_hand():
    # one row of 32 inputs: codes 0..15 then 15..0 (values -8..7, 7..-8), scale 0.5
    codes = np.concatenate([np.arange(16), np.arange(15, -1, -1)])
    words = [sum(int(codes[8 * j + k]) << (4 * k) for k in range(8)) for j in range(4)]
    packed = np.array([words], np.uint32).view(np.int32)
    w = Int4Weight(jnp.asarray(packed), jnp.asarray([[0.5]], jnp.float32))
    np.testing.assert_array_equal(np.asarray(w.dequantize()), [(codes - 8) * 0.5])
    assert w.shape == (1, 32)


def test_int4_round_trip_error_is_within_half_a_step():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((2, 24, 96)).astype(np.float32)
    q = quantize_int4(weight)
    step = np.repeat(np.asarray(q.scale), 32, axis=-1)
    assert (np.abs(np.asarray(dense(q)) - weight) <= 0.5 * step + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(np.ones((4, 40), np.float32))


def test_fp8_block_dequantisation():
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((200, 300)) * 2).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    w = Fp8BlockWeight(jnp.asarray(weight), jnp.asarray(scale))
    expected = weight.astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    np.testing.assert_array_equal(np.asarray(w.dequantize()), expected)
