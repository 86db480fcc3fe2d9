"""The models with attn_impl="pallas" (ddtree_kernels/tree_attention.py, interpret mode) equal the XLA path:
Qwen3 prefill + tree verify, and the DeepSeek-V3 absorbed MLA (two key parts, no [latent ; rope] copy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import deepseek_v3, qwen3
from ddtree_jax.models.attention import attention
from tests.models.impl_parity import forward_by_impl, mla_kernel_twin, relerr
from tests.tiny_models import DSV3_TWO_LAYER, QWEN3_TINY


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_prefill_and_tree_verify_equal_the_xla_path(family):
    module, config = (qwen3, QWEN3_TINY) if family == "qwen3" else (deepseek_v3, DSV3_TWO_LAYER)
    params = module.init_params(config, jax.random.key(0))
    outs = forward_by_impl(module, config, params, "attn_impl")
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert relerr(got, want) < 1e-5


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the Mosaic GPU kernel compiles for Hopper only; its interpret-mode tests: tests/kernels/test_mla_attention_mgpu.py",
)
@pytest.mark.parametrize("merge_up", [False, True])
def test_mla_on_the_mosaic_kernel_equals_the_xla_path_on_gpu(monkeypatch, merge_up):
    """attn_impl="pallas" runs absorbed MLA on the Mosaic GPU kernel for bf16 on GPU (the kernel's head dims:
    latent 512, rope 64): the tree verify's logits and features equal the XLA path's to bf16 rounding, with
    W_UK / W_UV's products in XLA or in `head_projections`' kernels (`dispatch.MLA_ABSORB`, `MLA_MERGE_UP`; kv_b_proj
    read in place)."""
    import dataclasses
    import importlib

    from ddtree_jax import dispatch
    from ddtree_jax.tree import ancestor_mask, build_tree

    assert dispatch.mla_attention_kernel(bfloat16=True) == "mosaic"
    monkeypatch.setattr(dispatch, "MLA_MERGE_UP", merge_up)
    monkeypatch.setattr(dispatch, "MLA_ABSORB", merge_up)
    ran = []  # the head kernels traced (spies around the real kernels)
    for module_name, name in (
        ("ddtree_jax.models.attention", "absorb"),
        ("ddtree_kernels.mla_attention_mgpu", "merge_up"),
    ):
        module = importlib.import_module(module_name)
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name, **k: ran.append(name) or kernel(*a, **k))
    # nope and v 32: the widths the head kernels take (`dispatch.mla_head_kernels`: v a multiple of 32)
    config = dataclasses.replace(
        DSV3_TWO_LAYER, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32
    )
    params = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        deepseek_v3.init_params(config, jax.random.key(3)),
    )
    rng = np.random.default_rng(4)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 70)), jnp.int32)  # 70 + 7 slots: two 64-key blocks
    lengths = jnp.asarray([70, 5], jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    cache = deepseek_v3.create_cache(config, 2, 128, jnp.bfloat16)
    _, _, cache = deepseek_v3.prefill(config, params, cache, prefix, lengths, attn_impl="xla")
    outs = {
        impl: deepseek_v3.tree_forward(
            config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl=impl
        )[:2]
        for impl in ("xla", "pallas")
    }
    assert set(ran) == ({"absorb", "merge_up"} if merge_up else set()), ran
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 3e-2


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the Mosaic GPU kernel compiles for Hopper only; its interpret-mode tests: tests/kernels/test_prefill_attention_mgpu.py",
)
def test_qwen3_prefill_on_the_causal_kernel_equals_the_xla_path_on_gpu():
    """A bf16 Qwen3 prefill of 2 ragged rows (then a second chunk at their offsets) with attn_impl="pallas"
    runs the causal Mosaic GPU kernel (head dim 64, a 256-row cache) and equals the XLA path to bf16 rounding."""
    import dataclasses

    from ddtree_jax import dispatch

    config = dataclasses.replace(QWEN3_TINY, head_dim=64)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), qwen3.init_params(config, jax.random.key(5)))
    assert (
        dispatch.prefill_attention_kernel("pallas", queries=40, keys=256, key_dim=64, value_dim=64, bfloat16=True)
        == "mosaic"
    )
    rng = np.random.default_rng(6)
    first = jnp.asarray(rng.integers(0, 61, (2, 70)), jnp.int32)
    second = jnp.asarray(rng.integers(0, 61, (2, 40)), jnp.int32)
    outs = {}
    for impl in ("xla", "pallas"):
        cache = qwen3.create_cache(config, 2, 256, jnp.bfloat16)
        logits_1, feats_1, cache = qwen3.prefill(config, params, cache, first, jnp.asarray([70, 33]), attn_impl=impl)
        logits_2, feats_2, _ = qwen3.prefill(config, params, cache, second, jnp.asarray([40, 40]), attn_impl=impl)
        outs[impl] = (logits_1, feats_1, logits_2, feats_2)
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 3e-2


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the Mosaic GPU kernels compile for Hopper only; interpret-mode tests: tests/kernels/test_*_mgpu.py",
)
def test_mla_prefill_on_the_kernels_equals_the_xla_path_on_gpu():
    """A bf16 DeepSeek-V3 prefill with attn_impl="pallas": a 100-token chunk in the expanded MLA form on the
    causal Mosaic kernel (Dk = 48 + 16, Dv = 64; the form is expanded past 63 queries at kv_lora 512), then a
    20-token chunk in the absorbed form on the MLA tree kernel; logits and features equal the XLA path's."""
    import dataclasses

    from ddtree_jax import dispatch

    config = dataclasses.replace(
        DSV3_TWO_LAYER, kv_lora_rank=512, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64
    )
    shape = dict(kv_lora_rank=512, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64)
    assert dispatch.mla_form("auto", queries=100, **shape) == "expanded"
    params = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        deepseek_v3.init_params(config, jax.random.key(8)),
    )
    rng = np.random.default_rng(9)
    first = jnp.asarray(rng.integers(0, 50, (2, 100)), jnp.int32)
    second = jnp.asarray(rng.integers(0, 50, (2, 20)), jnp.int32)
    outs = {}
    for impl in ("xla", "pallas"):
        cache = deepseek_v3.create_cache(config, 2, 128, jnp.bfloat16)
        logits_1, feats_1, cache = deepseek_v3.prefill(
            config, params, cache, first, jnp.asarray([100, 61]), attn_impl=impl
        )
        logits_2, feats_2, _ = deepseek_v3.prefill(config, params, cache, second, jnp.asarray([20, 20]), attn_impl=impl)
        outs[impl] = (logits_1, feats_1, logits_2, feats_2)
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 3e-2


def test_gqa_calls_the_kernel_dispatch_names(monkeypatch):
    """attention(impl="pallas") routes a GQA call to the kernel `dispatch.gqa_attention_kernel` names, with the
    caller's q, k, v, mask and scale: "mosaic" -> gqa_attention_mgpu (a spy here: on CPU the Mosaic kernel
    runs only in interpret mode, tested in tests/kernels/test_gqa_attention_mgpu.py), "triton" -> tree_attention."""
    import importlib

    from ddtree_jax import dispatch
    from ddtree_kernels.tree_attention import tree_attention_reference

    attention_module = importlib.import_module("ddtree_jax.models.attention")  # the package re-exports the function

    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 16)), jnp.bfloat16) for _ in range(2))
    mask = jnp.asarray(rng.random((2, 5, 24)) < 0.6)
    calls = []

    def spy(q_, k_, v_, mask_, *, scale):
        calls.append((q_.shape, k_.shape, v_.shape, mask_.shape, scale))
        return tree_attention_reference((q_,), (k_,), v_, mask_, scale=scale)

    monkeypatch.setattr(attention_module, "gqa_tree_attention", spy)
    monkeypatch.setattr(dispatch, "gqa_attention_kernel", lambda **kw: "mosaic")
    got = attention(q, k, v, mask, impl="pallas", scale=0.3)
    assert calls == [((2, 5, 4, 16), (2, 24, 2, 16), (2, 24, 2, 16), (2, 5, 24), 0.3)]
    want = attention(q, k, v, mask, impl="xla", scale=0.3)
    assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 1e-2
    monkeypatch.setattr(dispatch, "gqa_attention_kernel", lambda **kw: "triton")
    attention(q, k, v, mask, impl="pallas", scale=0.3)
    assert len(calls) == 1  # the Triton kernel: the spy is not called


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the Mosaic GPU kernel compiles for Hopper only; its interpret-mode tests: tests/kernels/test_gqa_attention_mgpu.py",
)
def test_qwen3_tree_verify_on_the_mosaic_gqa_kernel_equals_the_xla_path_on_gpu():
    """A bf16 Qwen3 tree verify against a cache of AUTO_MOSAIC_GQA_MIN_KEYS rows with attn_impl="pallas" runs
    the Mosaic GPU GQA kernel (head dim 64) and equals the XLA path to bf16 rounding."""
    import dataclasses

    from ddtree_jax import dispatch
    from ddtree_jax.tree import ancestor_mask, build_tree

    capacity = dispatch.AUTO_MOSAIC_GQA_MIN_KEYS
    assert dispatch.gqa_attention_kernel(queries=7, keys=capacity, head_dim=64, value_dim=64, bfloat16=True) == "mosaic"
    config = dataclasses.replace(QWEN3_TINY, head_dim=64)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), qwen3.init_params(config, jax.random.key(8)))
    rng = np.random.default_rng(9)
    prefix = jnp.asarray(rng.integers(0, 61, (2, 300)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 61)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    cache = qwen3.create_cache(config, 2, capacity, jnp.bfloat16)
    _, _, cache = qwen3.prefill(config, params, cache, prefix, jnp.asarray([300, 41]), attn_impl="xla")
    outs = {
        impl: qwen3.tree_forward(config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl=impl)[
            :2
        ]
        for impl in ("xla", "pallas")
    }
    for got, want in zip(outs["pallas"], outs["xla"]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relerr(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 3e-2
    verify = jax.jit(
        lambda c: qwen3.tree_forward(
            config, params, c, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="pallas"
        )[0]
    )
    assert "mosaic_gpu" in verify.lower(cache).as_text()  # the Mosaic GPU kernel's custom call ran, not Triton's


def test_causal_start_off_gpu_is_the_masked_path():
    """On CPU `attention(..., causal_start=...)` takes the masked path: equal to it exactly."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 2, 16)), jnp.float32) for _ in range(2))
    start = jnp.asarray([0, 6], jnp.int32)
    mask = jnp.arange(12)[None, None, :] <= start[:, None, None] + jnp.arange(5)[None, :, None]
    np.testing.assert_array_equal(
        np.asarray(attention(q, k, v, mask, impl="pallas", causal_start=start)),
        np.asarray(attention(q, k, v, mask, impl="pallas")),
    )


def test_attention_entry_dispatches_and_falls_back_for_odd_head_dims():
    rng = np.random.default_rng(2)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 3, 2, 12), (1, 10, 1, 12), (1, 10, 1, 12))
    )
    mask = jnp.asarray(rng.random((1, 3, 10)) < 0.7)
    np.testing.assert_allclose(
        np.asarray(attention(q, k, v, mask, impl="pallas")),  # 12: not a power of two -> xla
        np.asarray(attention(q, k, v, mask, impl="xla")),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="attention impl"):
        attention(q, k, v, mask, impl="flash")


def test_auto_takes_the_kernel_only_where_the_h200_measured_it_faster(monkeypatch):
    """ "auto": XLA off GPU; on GPU the kernel for GQA calls with <= 65 query positions (tree verify,
    decode; <= 129 against a short cache), XLA for absorbed MLA and long blocks (BENCHMARKS.md, tree-verify
    attention)."""
    from ddtree_jax import dispatch

    resolve = dispatch.attention_impl
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    assert resolve("auto", queries=17) == "xla"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "gpu_compute_capability", lambda: (9, 0))  # the H200 (Mosaic: Hopper only)
    assert resolve("auto", queries=17) == "pallas" and resolve("auto") == "pallas"
    assert resolve("auto", queries=dispatch.AUTO_PALLAS_GQA_QUERIES) == "pallas"
    assert resolve("auto", queries=dispatch.AUTO_PALLAS_GQA_QUERIES + 1, keys=1 << 15) == "xla"
    few = dispatch.AUTO_PALLAS_MLA_MIN_KEYS
    assert resolve("auto", queries=1, keys=max(few, 1), mla=True) == "pallas"  # the Mosaic kernel (bf16)
    assert resolve("auto", queries=1, keys=max(few, 1), mla=True, float32=True) == "xla"
    assert resolve("auto", queries=dispatch.AUTO_PALLAS_MLA_QUERIES + 1, keys=1 << 12, mla=True) == "xla"
    if few > 1:
        assert resolve("auto", queries=1, keys=few - 1, mla=True) == "xla"
    assert resolve("xla", queries=17) == "xla" and resolve("pallas", queries=512, mla=True) == "pallas"
    with pytest.raises(ValueError, match="attention impl must be one of"):
        resolve("flash")


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_blockwise_attention_equals_the_reference(block):
    """models.attention.blockwise_attention (online softmax over key blocks) against attention_reference:
    GQA (4 query heads over 2 KV heads), a key count no block size divides, random masks with rows that see
    no key at all (zeros), float32 and bf16."""
    from ddtree_jax.models.attention import blockwise_attention
    from ddtree_kernels.tree_attention import attention_reference

    rng = np.random.default_rng(block)
    keys = jax.random.split(jax.random.key(block), 3)
    q = jax.random.normal(keys[0], (2, 7, 4, 8)) * 2.0
    k = jax.random.normal(keys[1], (2, 37, 2, 8)) * 2.0
    v = jax.random.normal(keys[2], (2, 37, 2, 6))
    mask = rng.random((2, 7, 37)) < 0.4
    mask[1, 3] = False  # a row with no visible key
    mask = jnp.asarray(mask)
    want = attention_reference(q, k, v, mask)
    got = blockwise_attention(q, k, v, mask, block=block)
    assert got.shape == want.shape == (2, 7, 4, 6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert not np.asarray(got[1, 3]).any() and np.abs(np.asarray(want)).max() > 0.1
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got16 = blockwise_attention(*bf16, mask, block=block).astype(jnp.float32)
    want16 = attention_reference(*bf16, mask).astype(jnp.float32)
    assert relerr(got16, want16) < 2e-2
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        blockwise_attention(q, k, v, mask, block=0)


def test_auto_attention_goes_blockwise_for_long_prefills_only():
    from ddtree_jax import dispatch

    big = dispatch.BLOCKWISE_MIN_SCORES // 1024
    for backend in ("cpu", "gpu"):
        assert dispatch.attention_impl("auto", queries=1024, keys=big, backend_name=backend) == "blockwise"
        assert dispatch.attention_impl("auto", queries=1024, keys=big - 1, backend_name=backend) == "xla"
        assert dispatch.attention_impl("auto", queries=1024, keys=big, mla=True, backend_name=backend) == "blockwise"
    # a decode step at a huge context keeps its rule (the tree-attention kernel for GQA on GPU)
    assert dispatch.attention_impl("auto", queries=17, keys=10**7, backend_name="gpu") == "pallas"
    assert dispatch.attention_impl("xla", queries=1024, keys=big) == "xla"


@pytest.mark.parametrize("attn_impl", ["xla", "blockwise"])
def test_expanded_mla_equals_the_absorbed_form(attn_impl):
    """deepseek_v3.mla_absorbed(form="expanded") (per-head keys and values from the latent cache, expanded one
    key block at a time under "blockwise") against the absorbed form on the same cache: random weights and
    inputs, rows writing at different offsets (ragged caches), a random causal-plus-prefix mask with a
    row that sees nothing; both return the same updated caches."""
    c = DSV3_TWO_LAYER
    params = deepseek_v3.init_params(c, jax.random.key(5))
    p = jax.tree.map(lambda w: w[0], params["dense_layers"])
    batch, steps, capacity = 2, 9, 2500  # > BLOCKWISE_KEYS: "blockwise" scans 3 key blocks, the last partial
    keys = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(keys[0], (batch, steps, c.hidden_size))
    latent = jax.random.normal(keys[1], (batch, capacity, 1, c.kv_lora_rank))
    rope = jax.random.normal(keys[2], (batch, capacity, 1, c.qk_rope_head_dim))
    start = jnp.array([2400, 1030], jnp.int32)
    positions = start[:, None] + jnp.arange(steps)
    cos, sin = deepseek_v3.rope_tables_half(c, positions)
    rng = np.random.default_rng(7)
    mask = np.arange(capacity)[None, None, :] <= np.asarray(positions)[:, :, None]
    mask &= rng.random((batch, steps, capacity)) < 0.8
    mask[1, 4] = False
    args = (c, p, x, cos, sin, latent, rope, start, jnp.asarray(mask), attn_impl)
    want, want_latent, want_rope = deepseek_v3.mla_absorbed(*args, form="absorbed")
    got, got_latent, got_rope = deepseek_v3.mla_absorbed(*args, form="expanded")
    assert relerr(got, want) < 1e-5 and float(jnp.abs(want).max()) > 1e-5  # small init weights: a small output
    np.testing.assert_array_equal(np.asarray(got_latent), np.asarray(want_latent))
    np.testing.assert_array_equal(np.asarray(got_rope), np.asarray(want_rope))


def test_mla_form_picks_expanded_where_it_needs_fewer_flops():
    from ddtree_jax import dispatch

    k2 = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    # absorbed per (query, key): 2 x 512 + 64; expanded: 128 + 64 + 128, plus 512 x 256 per key
    assert dispatch.mla_form("auto", queries=170, **k2) == "absorbed"
    assert dispatch.mla_form("auto", queries=171, **k2) == "expanded"
    assert dispatch.mla_form("auto", queries=None, **k2) == "absorbed"  # decode / verify
    assert dispatch.mla_form("auto", queries=dispatch.AUTO_PALLAS_MAX_QUERIES, **DSV3_SHAPE) == "absorbed"
    assert dispatch.mla_form("auto", queries=dispatch.AUTO_PALLAS_MAX_QUERIES + 1, **DSV3_SHAPE) == "expanded"
    assert dispatch.mla_form("expanded", queries=1, **k2) == "expanded"
    with pytest.raises(ValueError, match="MLA form must be one of .* got 'naive'"):
        dispatch.mla_form("naive", queries=1, **k2)


DSV3_SHAPE = dict(
    kv_lora_rank=DSV3_TWO_LAYER.kv_lora_rank,
    qk_nope_head_dim=DSV3_TWO_LAYER.qk_nope_head_dim,
    qk_rope_head_dim=DSV3_TWO_LAYER.qk_rope_head_dim,
    v_head_dim=DSV3_TWO_LAYER.v_head_dim,
)


@pytest.mark.parametrize("capacity, in_place", [(128, True), (100, False)])
def test_mla_layer_scan_hands_the_mosaic_kernel_every_layers_cache(monkeypatch, capacity, in_place):
    """Under the layer scan the MLA caches are stacks [L, B, S, 1, ...]: with the Mosaic kernel (a spy here, the
    kernel's reference on the layer it is told to read; the kernel itself: tests/kernels/test_mla_attention_mgpu.py)
    the stacks and the scan's layer reach it whole (it reads the layer in place: no copy of the layer's cache a
    call), where S is whole 64-key blocks; otherwise one layer is sliced out first. The tree verify equals the
    XLA path either way."""
    import dataclasses
    import importlib

    from ddtree_jax import dispatch
    from ddtree_jax.tree import ancestor_mask, build_tree

    attention_module = importlib.import_module("ddtree_jax.models.attention")
    config = dataclasses.replace(DSV3_TWO_LAYER, num_layers=3)
    params = deepseek_v3.init_params(config, jax.random.key(5))
    rng = np.random.default_rng(6)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 40)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    cache = deepseek_v3.create_cache(config, 2, capacity, jnp.float32)
    _, _, cache = deepseek_v3.prefill(config, params, cache, prefix, jnp.asarray([40, 9], jnp.int32), attn_impl="xla")
    want = deepseek_v3.tree_forward(
        config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="xla"
    )
    calls = []

    def spy(q_latent, q_rope, latent, rope_key, mask, *, scale, layer=None, packed_mask=None, **schedule):
        assert schedule == dispatch.mla_schedule_options()  # the kernel's schedule flags, from the dispatch knob
        calls.append((latent.shape, layer is not None))
        # attends under the packed mask handed in (packed once a step, outside the layer scan)
        return mla_kernel_twin(
            q_latent, q_rope, latent, rope_key, mask, scale=scale, layer=layer, packed_mask=packed_mask
        )

    monkeypatch.setattr(attention_module, "mla_tree_attention", spy)
    monkeypatch.setattr(dispatch, "mla_attention_kernel", lambda **kw: "mosaic")
    got = deepseek_v3.tree_forward(
        config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="pallas", layer_loop="scan"
    )
    stacked = (config.num_layers, 2, capacity, 1, config.kv_lora_rank)
    assert calls and all(call == ((stacked, True) if in_place else (stacked[1:], False)) for call in calls), calls
    # the mask is packed once, outside the layer scans: its words [B, 1, S] enter each scan as an input
    jaxpr = jax.make_jaxpr(
        lambda cache: deepseek_v3.tree_forward(
            config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="pallas", layer_loop="scan"
        )
    )(cache)
    scans = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "scan"]
    assert scans and all(
        any(getattr(v.aval, "shape", None) == (2, 1, capacity) and v.aval.dtype == jnp.int32 for v in eqn.invars)
        for eqn in scans
    )
    for g, w in zip(got[:2], want[:2]):
        assert relerr(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 1e-5


@pytest.mark.parametrize(
    "layer_loop, absorb, merge_up",
    [("scan", True, True), ("unrolled", True, True), ("scan", True, False), ("scan", False, True)],
)
def test_mla_head_kernels_read_kv_b_proj_in_place(monkeypatch, layer_loop, absorb, merge_up):
    """With absorbed MLA's per-head products in `head_projections`' kernels (`dispatch.mla_head_kernels`), the layer
    loop passes kv_b_proj stacked (`dispatch.head_kernels_in_place`): W_UK's product runs in `absorb` (interpret
    mode here) reading q and the stack in place, and the Mosaic kernel (a spy here: the twin on the layer it is told
    to read; the kernel itself: tests/kernels/test_mla_attention_mgpu.py) gets every layer's kv_b_proj, the loop's
    layer, W_UV's offset (nope) and width (v), and returns [B, T, H, v]. The tree verify equals the XLA path."""
    import dataclasses
    import importlib

    from ddtree_jax import dispatch
    from ddtree_jax.tree import ancestor_mask, build_tree

    attention_module = importlib.import_module("ddtree_jax.models.attention")
    config = dataclasses.replace(DSV3_TWO_LAYER, num_layers=3)
    params = deepseek_v3.init_params(config, jax.random.key(7))
    rng = np.random.default_rng(8)
    prefix = jnp.asarray(rng.integers(0, 50, (2, 40)), jnp.int32)
    tree = build_tree((rng.standard_normal((2, 3, 50)) * 2).astype(np.float32), 6, jnp.asarray([4, 7], jnp.int32))
    cache = deepseek_v3.create_cache(config, 2, 128, jnp.float32)
    _, _, cache = deepseek_v3.prefill(config, params, cache, prefix, jnp.asarray([40, 9], jnp.int32), attn_impl="xla")
    want = deepseek_v3.tree_forward(
        config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="xla"
    )
    calls = []

    def spy(q_latent, q_rope, latent, rope_key, mask, *, scale, layer=None, packed_mask=None, **kwargs):
        up = {name: kwargs.pop(name) for name in ("up_weight", "up_layer", "up_offset", "up_width") if name in kwargs}
        assert kwargs == dispatch.mla_schedule_options()
        assert layer is not None
        if up.get("up_weight") is None:
            assert not merge_up
        else:
            calls.append((up["up_weight"].shape, up["up_offset"], up["up_width"]))
            assert up["up_layer"] is not None
        return mla_kernel_twin(
            q_latent, q_rope, latent, rope_key, mask, scale=scale, layer=layer, packed_mask=packed_mask, **up
        )

    monkeypatch.setattr(attention_module, "mla_tree_attention", spy)
    monkeypatch.setattr(dispatch, "mla_attention_kernel", lambda **kw: "mosaic")
    monkeypatch.setattr(dispatch, "mla_head_kernels", lambda **kw: (absorb, merge_up))
    monkeypatch.setattr(dispatch, "head_kernels_in_place", lambda name, backend_name=None: name == "kv_b_proj")
    absorbed = []
    real_absorb = attention_module.absorb

    def absorb_spy(q, weight, layer, **kwargs):
        absorbed.append((weight.shape, kwargs["q_offset"], kwargs["width"], kwargs["w_offset"]))
        return real_absorb(q, weight, layer, **kwargs)

    monkeypatch.setattr(attention_module, "absorb", absorb_spy)
    got = deepseek_v3.tree_forward(
        config, params, cache, tree.tokens, tree.depths, ancestor_mask(tree), attn_impl="pallas", layer_loop=layer_loop
    )
    assert bool(absorbed) == absorb and bool(calls) == merge_up, (absorbed, calls)
    assert all(call[1:] == (0, config.qk_nope_head_dim, 0) for call in absorbed), absorbed
    kv_b = (config.num_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)
    per_kind = {(config.first_k_dense_replace,) + kv_b, (config.num_layers - config.first_k_dense_replace,) + kv_b}
    assert {call[0] for call in calls} | {call[0] for call in absorbed} <= per_kind, (calls, absorbed)
    assert all(call[1:] == (config.qk_nope_head_dim, config.v_head_dim) for call in calls), calls
    for g, w in zip(got[:2], want[:2]):
        assert relerr(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 1e-5
