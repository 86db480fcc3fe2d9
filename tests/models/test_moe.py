"""The MoE dispatches (models/moe.py): gather, ragged and pallas (kernels/decode_matmul.grouped_matmul, interpret mode) equal the every-expert reference for float, INT4
and block-FP8 routed experts, with group-limited routing and a non-zero correction bias."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax import dispatch
from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.models import deepseek_v3, moe
from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight, quantize_int4
from tests.models.impl_parity import relerr

# 16 experts in 4 groups (top-2 groups), 3 per token; hidden 160 spans two 128-wide FP8 blocks, and both
# expert input widths (160, 32) are multiples of the INT4 group.
CONFIG = DeepSeekV3Config(
    vocab_size=50,
    hidden_size=160,
    intermediate_size=48,
    moe_intermediate_size=32,
    num_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    num_heads=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
)
EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _fp8(rng, w):
    out, inner = w.shape[-2:]
    scale = rng.uniform(0.5, 2.0, w.shape[:-2] + (-(-out // 128), -(-inner // 128))).astype(np.float32)
    return Fp8BlockWeight(jnp.asarray((np.asarray(w) * 50).astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale / 50))


def _layer(fmt: str, seed: int = 0) -> dict:
    """One MoE layer's parameters, routed experts in `fmt` (the correction bias drawn by init_params)."""
    params = deepseek_v3.init_params(CONFIG, jax.random.key(seed))
    p = jax.tree.map(lambda w: w[0], params["moe_layers"])
    assert float(jnp.abs(p["router_bias"]).max()) > 0.1
    p["router"] = p["router"] * 20  # spread the scores so that groups and top-k are decisive
    rng = np.random.default_rng(seed)
    for name in EXPERTS:
        if fmt == "int4":
            p[name] = quantize_int4(np.asarray(p[name]))
        elif fmt == "fp8":
            p[name] = _fp8(rng, p[name])
    return p


@jax.jit
def _reference(p, x):
    return moe.moe_reference(CONFIG, p, x)


_DISPATCH = {
    impl: jax.jit(lambda p, x, impl=impl: moe.moe(CONFIG, p, x, impl=impl))
    for impl in ("gather", "ragged", "pallas", "decode")  # decode: the moe_decode kernels for INT4 at <= 32
}


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("steps", [1, 7, 17])
def test_dispatches_equal_the_reference(fmt, steps):
    p = _layer(fmt, seed=steps)
    if fmt == "int4":
        assert isinstance(p["expert_down"], Int4Weight)
    x = jax.random.normal(jax.random.key(10 + steps), (2, steps, CONFIG.hidden_size))
    experts, _ = moe.route(CONFIG, p["router"], p["router_bias"], x)
    assert (np.array([len(set(e // 4)) for e in np.asarray(experts).reshape(-1, 3)]) <= 2).all()
    want = _reference(p, x)
    for impl, fn in _DISPATCH.items():
        got = fn(p, x)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert relerr(got, want) < 1e-5, (impl, relerr(got, want))


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_crowded_and_empty_experts(fmt):
    """A bias that sends every token to experts 5, 6, 7: one big group per chosen expert, the rest empty
    (both ragged branches: 6 assignments < 16 experts, 102 >= 16)."""
    p = _layer(fmt)
    bias = np.zeros(16, np.float32)
    bias[[5, 6, 7]] = 100.0
    p["router_bias"] = jnp.asarray(bias)
    for steps in (1, 17):
        x = jax.random.normal(jax.random.key(steps), (2, steps, CONFIG.hidden_size))
        want = _reference(p, x)
        for impl, fn in _DISPATCH.items():
            assert relerr(fn(p, x), want) < 1e-5, (impl, steps)


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_bfloat16_activations(fmt):
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16) if w.dtype == jnp.float32 else w, _layer(fmt))
    x = jax.random.normal(jax.random.key(3), (2, 7, CONFIG.hidden_size), jnp.bfloat16)
    want = _reference(p, x).astype(jnp.float32)
    for impl, fn in _DISPATCH.items():
        got = fn(p, x)
        assert got.dtype == jnp.bfloat16 and relerr(got.astype(jnp.float32), want) < 2e-2, impl


def test_decode_kernels_read_a_stacked_layer_in_place():
    """moe_impl="decode" on INT4 experts handed over as LayerOf(stack, layer) (what the layer loops pass):
    the kernels read layer 1 of a 2-layer stack in place and equal "gather" and the reference on it; 2 x 4
    tokens x 3 = 24 assignments (<= moe_decode.MAX_ASSIGNMENTS)."""
    first, second = _layer("int4", seed=1), _layer("int4", seed=2)
    stacked = dict(second)
    for name in EXPERTS:
        stack = jax.tree.map(lambda a, b: jnp.stack([a, b]), first[name], second[name])
        stacked[name] = moe.LayerOf(stack, jnp.asarray(1, jnp.int32))
    x = jax.random.normal(jax.random.key(4), (2, 4, CONFIG.hidden_size))
    want = _reference(second, x)
    got = jax.jit(lambda p, x: moe.moe(CONFIG, p, x, impl="decode"))(stacked, x)
    assert relerr(got, want) < 1e-5
    assert relerr(got, _reference(first, x)) > 1e-2  # the other layer would differ


def test_auto_rule_and_unknown_impl(monkeypatch):
    k, experts = CONFIG.num_experts_per_tok, CONFIG.n_routed_experts
    assert dispatch.moe_impl(5 * k, experts, backend_name="cpu") == "gather"  # 15 assignments <= 16 experts
    assert dispatch.moe_impl(6 * k, experts, backend_name="cpu") == "reference"
    # GPU: the in-place decode kernels up to GPU_GATHER_MAX_ASSIGNMENTS (16: two K2.6 tokens; "gather" with
    # AUTO_MOE_DECODE off), then the grouped kernel
    assert dispatch.GPU_GATHER_MAX_ASSIGNMENTS == 16
    assert dispatch.moe_impl(16, experts, backend_name="gpu") == "decode"
    assert dispatch.moe_impl(1, experts, backend_name="gpu") == "decode"
    assert dispatch.moe_impl(16, experts, backend_name="gpu", int4=False) == "gather"  # FP8 / bf16 experts
    assert dispatch.moe_impl(17, experts, backend_name="gpu") == "pallas"
    monkeypatch.setattr(dispatch, "AUTO_MOE_DECODE", False)
    assert dispatch.moe_impl(16, experts, backend_name="gpu") == "gather"
    assert dispatch.local_expert_impl(4, 4, backend_name="cpu") == "gather"
    assert dispatch.local_expert_impl(5, 4, backend_name="cpu") == "dense"
    assert dispatch.local_expert_impl(16, 48, backend_name="gpu") == "gather"
    assert dispatch.local_expert_impl(17, 48, backend_name="gpu") == "pallas"
    p = _layer("float")
    x = jax.random.normal(jax.random.key(0), (1, 1, CONFIG.hidden_size))
    np.testing.assert_array_equal(np.asarray(moe.moe(CONFIG, p, x)), np.asarray(moe.moe(CONFIG, p, x, impl="gather")))
    with pytest.raises(ValueError, match="unknown MoE impl"):
        moe.moe(CONFIG, p, x, impl="dense")


def test_prefill_and_verify_take_each_impl():
    """The absorbed path with every dispatch gives the same logits (the default is tested against the
    expanded reference in test_deepseek_v3 / test_hf_parity)."""
    params = deepseek_v3.init_params(CONFIG, jax.random.key(5))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 50, (2, 6)), jnp.int32)
    depths = jnp.array([[0, 1, 1, 2]] * 2, jnp.int32)
    tree_mask = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]] * 2, bool)
    outs = {}
    for impl in moe.MOE_IMPLS:
        cache = deepseek_v3.create_cache(CONFIG, 2, 16, jnp.float32)
        pre, _, cache = deepseek_v3.prefill(CONFIG, params, cache, ids, jnp.array([6, 4], jnp.int32), moe_impl=impl)
        ver, _, _ = deepseek_v3.tree_forward(CONFIG, params, cache, ids[:, :4], depths, tree_mask, moe_impl=impl)
        outs[impl] = (pre, ver)
    for impl in ("auto", "gather", "ragged", "pallas", "decode"):
        for got, want in zip(outs[impl], outs["reference"]):
            assert relerr(got, want) < 1e-5, impl


def test_stacked_layers_reach_each_dispatch_in_place():
    """Two MoE layers: the layer loops hand the experts over as LayerOf(stack, layer) (no per-layer slice);
    gather / pallas / ep (no mesh) read the right layer: scan and unrolled equal the reference."""
    import dataclasses

    config = dataclasses.replace(CONFIG, num_layers=3)
    params = deepseek_v3.init_params(config, jax.random.key(6))
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 50, (2, 5)), jnp.int32)
    outs = {}
    for impl in ("reference", "gather", "pallas", "ep"):
        for loop in ("scan", "unrolled"):
            cache = deepseek_v3.create_cache(config, 2, 8, jnp.float32)
            outs[impl, loop] = deepseek_v3.prefill(
                config, params, cache, ids, jnp.array([5, 3], jnp.int32), moe_impl=impl, layer_loop=loop
            )[0]
    sliced = {**params, "moe_layers": {**params["moe_layers"]}}
    for name in moe.EXPERT_AXES:  # a different second layer would change the logits: each layer is read
        sliced["moe_layers"][name] = jax.tree.map(lambda a: a.at[1].set(a[0]), params["moe_layers"][name])
    changed = deepseek_v3.prefill(
        config,
        sliced,
        deepseek_v3.create_cache(config, 2, 8, jnp.float32),
        ids,
        jnp.array([5, 3], jnp.int32),
        moe_impl="reference",
    )[0]
    assert relerr(changed, outs["reference", "scan"]) > 1e-3
    for key, got in outs.items():
        assert relerr(got, outs["reference", "scan"]) < 1e-5, key


def test_pallas_takes_the_mosaic_grouped_kernel_for_int4():
    """Where `dispatch.grouped_int4_kernel` says "mosaic" (on GPU: INT4 experts at prefill sizes), "pallas" runs
    the three expert matmuls on `grouped_int4_mgpu` (here interpreted, forced on, in an NPROC=64 subprocess: its
    warpgroups are threads) and equals the reference, also on stacked layers read in place (`LayerOf`); the kernel
    is really called (a spy counts its calls). Where `dispatch.decode_moe_kernel` says "mosaic", "decode" runs
    them on the decode form (`gathered_int4_matmul`), stacked layers read in place; where `grouped_int4_kernel`
    says "stream", "pallas" runs them on the streamed kernel (`streamed_int4_matmul`). Each MoE call runs under
    jit and is waited for (`mosaic_interpret`'s rule: op-by-op calls deadlocked the interpreter under CPU load)."""
    from tests.kernels.mosaic_interpret import run_in_subprocess

    out = run_in_subprocess(
        """
import dataclasses, functools, json
import jax, jax.numpy as jnp, numpy as np
from ddtree_jax import dispatch
from ddtree_jax.models import deepseek_v3, moe
from ddtree_kernels.quant import quantize_int4
from tests.kernels.mosaic_interpret import run_jitted
from tests.models.test_moe import CONFIG, EXPERTS

config = dataclasses.replace(CONFIG, hidden_size=256, moe_intermediate_size=256, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=1, topk_group=1)
params = deepseek_v3.init_params(config, jax.random.key(3))
p = jax.tree.map(lambda w: w[0], params["moe_layers"])
for name in EXPERTS:
    p[name] = quantize_int4(np.asarray(p[name]))
x = (jax.random.normal(jax.random.key(4), (40, 256)) * 2).astype(jnp.bfloat16)
calls = []
real = moe.grouped_int4_matmul
moe.grouped_int4_matmul = lambda *a, **k: calls.append(1) or real(*a, **k)
dispatch.grouped_int4_kernel = lambda *a, **k: "mosaic"
# one program a call, waited for: no op-by-op dispatch while a kernel's warpgroups run (mosaic_interpret's rule)
run = lambda impl, params, rows: np.asarray(run_jitted(functools.partial(moe.moe, config), params, rows, impl=impl),
                                            np.float32)
got = run("pallas", p, x)
want = np.asarray(moe.moe_reference(config, p, x), np.float32)
# the layer loops' form: every layer's experts stacked, this layer read in place (moe.LayerOf)
stacked = dict(p)
for name in EXPERTS:
    stacked[name] = moe.LayerOf(jax.tree.map(lambda a: jnp.stack([a * 0 + 1, a]), p[name]), jnp.int32(1))
got_stacked = run("pallas", stacked, x)
# "decode" on the Mosaic decode form (forced on; 4 tokens x top-2: 8 assignments, each its own tile), stacked too
gathered = []
real_gathered = moe.gathered_int4_matmul
moe.gathered_int4_matmul = lambda *a, **k: gathered.append(1) or real_gathered(*a, **k)
dispatch.decode_moe_kernel = lambda *a, **k: "mosaic"
few = x[:4]
want_few = np.asarray(moe.moe_reference(config, p, few), np.float32)
got_decode = run("decode", stacked, few)
# "pallas" on the streamed kernel (forced on, as `dispatch.GROUPED_INT4_DECODE = "stream"` would on GPU), stacked
streamed = []
real_streamed = moe.streamed_int4_matmul
moe.streamed_int4_matmul = lambda *a, **k: streamed.append(1) or real_streamed(*a, **k)
dispatch.grouped_int4_kernel = lambda *a, **k: "stream"
got_streamed = run("pallas", stacked, x)
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
print(json.dumps({"calls": len(calls), "rel": rel(got, want), "rel_stacked": rel(got_stacked, want),
                  "gathered_calls": len(gathered), "rel_decode": rel(got_decode, want_few),
                  "streamed_calls": len(streamed), "rel_streamed": rel(got_streamed, want)}))
"""
    )
    assert out["streamed_calls"] == 3 and out["rel_streamed"] < 2e-2  # the streamed kernel: gate, up, down
    assert out["gathered_calls"] == 3 and out["rel_decode"] < 2e-2  # the decode form: gate, up, down
    assert out["calls"] == 6
    assert out["rel"] < 2e-2  # bf16 activations and intermediate rounding (the kernel alone: ~1e-7 in interpret mode)
    assert out["rel_stacked"] < 2e-2


@pytest.mark.parametrize("sort", ["argsort", "rank"])
def test_sort_by_expert_is_the_stable_sort_and_its_inverse(sort, monkeypatch):
    """Both sorts (`dispatch.moe_sort`) give numpy's stable argsort and its inverse, on repeated experts (ties kept in
    assignment order); the "pallas" and "ragged" MoE paths with them equal the reference."""
    monkeypatch.setattr(dispatch, "MOE_SORT", sort)
    rng = np.random.default_rng(7)
    for count, experts in ((1, 4), (24, 5), (136, 384), (300, 16)):
        flat = rng.integers(0, experts, count).astype(np.int32)
        order, position = jax.jit(moe.sort_by_expert)(jnp.asarray(flat))
        np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
        np.testing.assert_array_equal(np.asarray(order)[np.asarray(position)], np.arange(count))
    p = _layer("int4", seed=3)
    x = jax.random.normal(jax.random.key(5), (2, 17, CONFIG.hidden_size))
    for impl in ("pallas", "ragged"):
        got = jax.jit(lambda p, x, impl=impl: moe.moe(CONFIG, p, x, impl=impl))(p, x)
        assert relerr(got, _reference(p, x)) < 1e-5, impl


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
def test_pallas_with_the_rows_read_through_a_row_index(fmt, monkeypatch):
    """`dispatch.GROUPED_GATHER` "kernel": the gate / up kernels read the tokens in place through each sorted
    assignment's token (no gathered copy): the same output bits as "xla" (the rows gathered first, the kernel reading
    them in order) and as "xla_apart" (that gather behind an optimization barrier, once for gate and up), and the
    reference's values."""
    p = _layer(fmt, seed=11)
    x = jax.random.normal(jax.random.key(6), (3, 5, CONFIG.hidden_size), jnp.bfloat16)
    run = {}
    for where in ("xla", "xla_apart", "kernel"):
        monkeypatch.setattr(dispatch, "GROUPED_GATHER", where)
        call = jax.jit(lambda p, x: moe.moe(CONFIG, p, x, impl="pallas"))
        kernels = str(jax.make_jaxpr(call)(p, x))
        assert ("_gathered" in kernels) == (where == "kernel"), where  # the kernel's row-index form
        assert kernels.count("optimization_barrier") == (where == "xla_apart"), where  # one gather for gate and up
        run[where] = np.asarray(call(p, x), np.float32)
    np.testing.assert_array_equal(run["kernel"], run["xla"])
    np.testing.assert_array_equal(run["xla_apart"], run["xla"])
    assert relerr(jnp.asarray(run["kernel"]), _reference(p, x.astype(jnp.float32))) < 2e-2  # bf16 activations
    monkeypatch.setattr(dispatch, "GROUPED_GATHER", "sideways")
    with pytest.raises(ValueError, match="sideways"):
        dispatch.grouped_gather()


def test_moe_sort_rule():
    gpu = dict(backend_name="gpu")
    assert dispatch.moe_sort(dispatch.RANK_SORT_MAX_ASSIGNMENTS, **gpu) == "rank"
    assert dispatch.moe_sort(dispatch.RANK_SORT_MAX_ASSIGNMENTS + 1, **gpu) == "argsort"
    assert dispatch.moe_sort(8, backend_name="cpu") == "argsort"


def test_router_bf16_gemm_rule():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert dispatch.router_bf16_gemm(dispatch.ROUTER_BF16_MIN_ROWS, bf16, bf16)
    assert not dispatch.router_bf16_gemm(dispatch.ROUTER_BF16_MIN_ROWS - 1, bf16, bf16)  # AR: one fused reduction
    assert not dispatch.router_bf16_gemm(64, f32, bf16) and not dispatch.router_bf16_gemm(64, bf16, f32)


def test_bf16_router_logits_are_the_float32_logits():
    """bf16 activations and router: `route` takes one bf16 GEMM accumulating in float32 (exact products), which must
    choose the experts the float32 upcast path chooses, with the same weights to float32 rounding (random inputs,
    fixed seed; a near-tie of the 8th and 9th scores would need a gap below the summation-order error, ~1e-6)."""
    rng = np.random.default_rng(11)
    hidden, experts = 512, 64
    config = dataclasses.replace(CONFIG, hidden_size=hidden, n_routed_experts=experts)
    router = jnp.asarray(rng.standard_normal((experts, hidden)) * 0.05, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(experts) * 0.01, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 17, hidden)), jnp.bfloat16)
    got_experts, got_weights = jax.jit(lambda x, r: moe.route(config, r, bias, x))(x, router)
    want_experts, want_weights = jax.jit(lambda x, r: moe.route(config, r, bias, x))(
        x.astype(jnp.float32), router.astype(jnp.float32)
    )
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5)


def test_top_k_by_rank_is_lax_top_k():
    """`moe.top_k_by_rank` gives lax.top_k's indices in its order (largest first, ties to the lower index) and the
    carried values at them, on random rows with many ties (values drawn from 5 levels) and with -inf entries (the
    group-limited routing's masked experts), and with NaNs; a k outside 1 .. E is refused."""
    rng = np.random.default_rng(21)
    for shape, k in (((1, 384), 8), ((3, 17, 16), 3), ((40, 9), 9), ((2, 6), 1)):
        values = rng.integers(0, 5, shape).astype(np.float32)
        values[rng.random(shape) < 0.2] = -np.inf
        values = jnp.asarray(values)
        carried = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        indices, chosen = jax.jit(moe.top_k_by_rank, static_argnums=1)(values, k, carried)
        _, want = jax.lax.top_k(values, k)
        np.testing.assert_array_equal(indices, want)
        np.testing.assert_array_equal(chosen, jnp.take_along_axis(carried, want, axis=-1))
    # NaN above every number, as lax.top_k orders it (no out-of-range index from a NaN's rank)
    values = jnp.asarray([[1.0, np.nan, 0.5, 2.0], [1.0, np.nan, 0.5, np.nan]])
    indices, _ = moe.top_k_by_rank(values, 3, values)
    np.testing.assert_array_equal(indices, jax.lax.top_k(values, 3)[1])
    with pytest.raises(ValueError, match="k must be 1 .. 6"):
        moe.top_k_by_rank(jnp.zeros((2, 6)), 7, jnp.zeros((2, 6)))


def test_route_by_rank_equals_route_by_lax(monkeypatch):
    """`dispatch.ROUTER_TOPK` "rank" routes to the same experts with the same weights as "lax", with group-limited
    routing and a drawn correction bias (CONFIG: 4 groups, top-2 groups), and the same MoE output; an unknown
    choice is refused."""
    p = _layer("float", seed=2)
    x = jax.random.normal(jax.random.key(9), (2, 9, CONFIG.hidden_size))
    run = {}
    for choice in ("lax", "rank"):
        monkeypatch.setattr(dispatch, "ROUTER_TOPK", choice)
        route = jax.jit(lambda p, x: moe.route(CONFIG, p["router"], p["router_bias"], x))
        layer = jax.jit(lambda p, x: moe.moe(CONFIG, p, x, impl="gather"))
        run[choice] = (*route(p, x), layer(p, x))
    (experts, weights, out), (want_experts, want_weights, want_out) = run["rank"], run["lax"]
    np.testing.assert_array_equal(experts, want_experts)
    # the weights are the same scores picked; XLA may fuse the sigmoid differently in the two programs (ulps)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    assert dispatch.router_topk(dispatch.RANK_TOPK_MAX_ROWS) == "rank"
    assert dispatch.router_topk(dispatch.RANK_TOPK_MAX_ROWS + 1) == "lax"  # a prefill chunk: [rows, E, E] too many
    monkeypatch.setattr(dispatch, "ROUTER_TOPK", "auto")
    assert dispatch.router_topk(1) == "lax"
    monkeypatch.setattr(dispatch, "ROUTER_TOPK", "heap")
    with pytest.raises(ValueError, match="heap"):
        dispatch.router_topk(1)
