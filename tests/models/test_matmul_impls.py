"""The Qwen3 target with matmul_impl="pallas" (ddtree_kernels/decode_matmul.py, interpret mode) equals the XLA
path: prefill and tree verify logits and tapped features, and a greedy engine generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import Qwen3Config
from ddtree_jax.models import deepseek_v3, qwen3
from ddtree_jax.models.layers import linear
from tests.models.impl_parity import forward_by_impl, relerr

CONFIG = Qwen3Config(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tapped_layers=(0, 1),
)


def test_prefill_and_verify_equal_the_xla_path():
    params = qwen3.init_params(CONFIG, jax.random.key(0), norm_jitter=0.1)
    outs = forward_by_impl(qwen3, CONFIG, params, "matmul_impl", vocab=61)
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert relerr(got, want) < 1e-5


def test_switch_errors():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="matmul impl"):
        linear(x, jnp.ones((4, 8)), "cublas")
    with pytest.raises(NotImplementedError, match="not wired into the DeepSeek-V3 family"):
        deepseek_v3.tree_forward(
            None,
            {},
            None,
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1, 2, 2), bool),
            matmul_impl="pallas",
        )


@pytest.mark.slow
@pytest.mark.gpu
def test_greedy_generation_is_unchanged():
    from ddtree_jax.engine.generate import generate
    from ddtree_jax.engine.run import random_tiny_pair, request_args
    from ddtree_jax.options import DecodeOptions

    pair = random_tiny_pair(0)
    args = request_args(pair, [[1, 2, 3, 4, 5], [7, 8]], temperature=0.0, seed=0, max_new_tokens=12)
    out = {
        impl: np.asarray(
            generate(
                *args,
                max_new_tokens=12,
                method="ddtree",
                budget=8,
                block_size=8,
                options=DecodeOptions(matmul_impl=impl),
            ).tokens
        )
        for impl in ("xla", "pallas")
    }
    np.testing.assert_array_equal(out["pallas"], out["xla"])


def test_auto_takes_the_kernel_only_where_the_h200_measured_it_faster(monkeypatch):
    """ "auto": XLA off GPU; on GPU the kernel for INT4 / FP8 weights at <= 32 rows, XLA for bf16 weights
    (the kernel slowed the whole Qwen3-8B forward) and for quantised ones at more rows (BENCHMARKS.md)."""
    from ddtree_jax import dispatch

    def resolve(impl, rows, quantized):
        return dispatch.matmul_impl(impl, rows=rows, quantized=quantized)

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    assert resolve("auto", 1, True) == "xla"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert resolve("auto", 1, False) == "xla" and resolve("auto", 17, False) == "xla"
    assert resolve("auto", 65, False) == "xla"
    assert resolve("auto", 1, True) == "pallas"
    assert resolve("auto", 17, True) == "pallas" and resolve("auto", 65, True) == "xla"
    assert resolve("auto", dispatch.AUTO_PALLAS_MAX_ROWS, True) == "pallas"
    assert resolve("xla", 1, True) == "xla" and resolve("pallas", 65, False) == "pallas"
