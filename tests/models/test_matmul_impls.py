"""The Qwen3 target with matmul_impl="pallas" (ddtree_kernels/decode_matmul.py, interpret mode) equals the XLA
path: prefill and tree verify logits and tapped features, and a greedy engine generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import deepseek_v3, qwen3
from ddtree_jax.models.layers import linear
from tests.models.impl_parity import forward_by_impl, relerr
from tests.tiny_models import QWEN3_TINY

CONFIG = QWEN3_TINY


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


def test_mosaic_off_gpu_is_the_xla_path():
    """matmul_impl="mosaic" is the Mosaic GPU kernel on GPU only; elsewhere (and for weights it does not take) the
    XLA product, exactly."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(linear(x, w, "mosaic"), np.float32), np.asarray(linear(x, w), np.float32))


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the Mosaic GPU kernel compiles for Hopper only; its interpret-mode tests: tests/kernels/test_skinny_matmul_mgpu.py",
)
def test_qwen3_tree_verify_on_the_mosaic_matmul_equals_the_xla_path_on_gpu():
    """A bf16 Qwen3 (q / o, gate / up, down and the LM head >= MOSAIC_MATMUL_MIN_OUT wide) prefill + tree verify with matmul_impl="mosaic" runs the Mosaic
    GPU weight-streaming kernel and equals the XLA path to bf16 rounding."""
    import dataclasses

    from ddtree_jax.tree import ancestor_mask, build_tree

    config = dataclasses.replace(
        CONFIG, vocab_size=4096, hidden_size=2048, intermediate_size=2048, num_heads=32, num_kv_heads=2, head_dim=64
    )
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), qwen3.init_params(config, jax.random.key(4)))
    rng = np.random.default_rng(5)
    prefix = jnp.asarray(rng.integers(0, 4096, (2, 40)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 4, 4096)) * 2).astype(np.float32), 16, jnp.asarray([4, 7], jnp.int32))
    outs = {}
    for impl in ("xla", "mosaic"):
        cache = qwen3.create_cache(config, 2, 128, jnp.bfloat16)
        _, _, cache = qwen3.prefill(config, params, cache, prefix, jnp.asarray([40, 23]), matmul_impl=impl)
        outs[impl] = qwen3.tree_forward(
            config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), matmul_impl=impl
        )[:2]
    for got, want in zip(outs["mosaic"], outs["xla"]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 3e-2
    verify = jax.jit(
        lambda c: qwen3.tree_forward(
            config, params, c, tree.tokens, tree.depths, ancestor_mask(tree), matmul_impl="mosaic"
        )[0]
    )
    assert "mosaic_gpu" in verify.lower(cache).as_text()  # the Mosaic GPU kernel's custom call, not XLA's dot


def test_a_stacked_layer_off_gpu_is_its_slice():
    """linear(x, LayerOf(stack, layer)) off GPU slices the layer: exactly linear(x, stack[layer]), every impl."""
    from ddtree_jax.models.layers import LayerOf

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.bfloat16)
    stack = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.bfloat16)
    for impl in ("xla", "auto", "mosaic"):
        got = linear(x, LayerOf(stack, jnp.int32(2)), impl)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(linear(x, stack[2], impl), np.float32))


def test_a_stacked_layer_on_gpu_is_read_in_place(monkeypatch):
    """Where `dispatch.matmul_in_place` holds (on GPU), a LayerOf weight under a layer scan lowers to the skinny
    kernel's custom call over the whole stack, with no slice of it (lowered for "cuda" here)."""
    from ddtree_jax import dispatch
    from ddtree_jax.models.layers import LayerOf

    monkeypatch.setattr(dispatch, "_on_gpu", lambda backend_name=None: True)
    assert dispatch.matmul_in_place(17, (1536, 7168), quantized=False, bfloat16=True)
    assert not dispatch.matmul_in_place(17, (1536, 7168), quantized=True, bfloat16=False)
    assert not dispatch.matmul_in_place(300, (1536, 7168), quantized=False, bfloat16=True)  # > 256 rows
    assert not dispatch.matmul_in_place(17, (1536, 7168), quantized=False, bfloat16=False)

    def scan(x, stack):
        def step(h, layer):
            return linear(h, LayerOf(stack, layer))[..., : h.shape[-1]], None

        return jax.lax.scan(step, x, jnp.arange(stack.shape[0], dtype=jnp.int32))[0]

    args = (jax.ShapeDtypeStruct((1, 2, 256), jnp.bfloat16), jax.ShapeDtypeStruct((3, 512, 256), jnp.bfloat16))
    text = jax.jit(scan).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    reads = [line for line in text.splitlines() if ("slice %" in line or "gather" in line) and "3x512x256" in line]
    assert not reads, reads


def test_stacked_in_place_names_the_measured_projections(monkeypatch):
    from ddtree_jax import dispatch

    monkeypatch.setattr(dispatch, "AUTO_IN_PLACE", True)
    monkeypatch.setattr(dispatch, "IN_PLACE_PROJECTIONS", {"q_a_proj": 1, "o_proj": 8})
    gpu = dict(backend_name="gpu")
    assert dispatch.stacked_in_place("q_a_proj", 1, **gpu) and dispatch.stacked_in_place("q_a_proj", 17, **gpu)
    assert not dispatch.stacked_in_place("q_a_proj", 17, backend_name="cpu")
    assert not dispatch.stacked_in_place("q_a_proj", dispatch.IN_PLACE_MAX_ROWS + 1, **gpu)
    assert not dispatch.stacked_in_place("o_proj", 7, **gpu) and dispatch.stacked_in_place("o_proj", 8, **gpu)
    assert not dispatch.stacked_in_place("kv_b_proj", 17, **gpu)
    monkeypatch.setattr(dispatch, "AUTO_IN_PLACE", False)
    assert not dispatch.stacked_in_place("q_a_proj", 17, **gpu)


def test_the_in_place_table_as_measured():
    """The thresholds dispatch states were measured (q_a and the dense FFN from 1 row; kv_a, q_b, o_proj and the
    shared expert lost to XLA at 1 row)."""
    from ddtree_jax import dispatch

    gpu = dict(backend_name="gpu")
    assert dispatch.AUTO_IN_PLACE
    assert dispatch.stacked_in_place("q_a_proj", 1, **gpu)
    assert not dispatch.stacked_in_place("kv_a_proj", 1, **gpu) and dispatch.stacked_in_place("kv_a_proj", 8, **gpu)
    assert not dispatch.stacked_in_place("o_proj", 7, **gpu) and dispatch.stacked_in_place("o_proj", 65, **gpu)
    assert not dispatch.stacked_in_place("o_proj", 66, **gpu)
    assert not dispatch.stacked_in_place("router", 17, **gpu)  # float32 in `moe.route`
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert dispatch.stacked_in_place(name, 1, **gpu), name
    for name in ("q_b_proj", "shared_gate", "shared_up", "shared_down"):
        assert not dispatch.stacked_in_place(name, 1, **gpu) and dispatch.stacked_in_place(name, 9, **gpu), name


def test_in_place_projections_are_the_models_parameters():
    from ddtree_jax import dispatch
    from ddtree_jax.models import deepseek_v3
    from tests.models.test_deepseek_v3 import CONFIG

    shapes = deepseek_v3.param_shapes(CONFIG)
    for name in dispatch.IN_PLACE_PROJECTIONS:
        assert name in shapes["moe_layers"] or name in shapes["dense_layers"], name
