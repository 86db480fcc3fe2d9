"""Manual regions (`sharding.regions`): the Pallas kernels and the expert-parallel MoE inside shard_map, on
8 fake CPU devices (kernels in interpret mode). Sharded = unsharded for the tiny K2 target: tree attention
split by batch and heads, "ep" experts split 4 ways, the grouped kernel on the TP split; tree sampling
split by rows; and the partition-spec fitting (axes that do not divide fall back to replication, a reduction
axis that cannot stay split is an error)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from ddtree_jax import dispatch
from ddtree_jax.models import deepseek_v3, moe
from ddtree_jax.sampling import SamplingParams, row_keys
from ddtree_jax.sharding.regions import context_mesh, fit_specs, shard_call
from ddtree_jax.sharding.rules import MODEL, shard_params
from ddtree_jax.tree import build_tree
from ddtree_jax.verify import verify_step
from tests.models.impl_parity import mla_kernel_twin
from tests.sharding.tiny_k2 import CONFIG, prefill_verify


def _close(got, want, tol=2e-5):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def unsharded(params):
    return prefill_verify(params, moe_impl="reference")


# "decode": what "auto" takes on GPU up to 16 assignments (`dispatch.moe_impl`), on the TP split in the region
@pytest.mark.parametrize("layout,moe_impl", [("ep", "ep"), ("tp", "pallas"), ("tp", "decode")])
def test_pallas_attention_and_moe_regions_equal_unsharded(params, mesh, unsharded, layout, moe_impl, monkeypatch):
    traced, kernel = [], moe.moe_decode
    monkeypatch.setattr(moe, "moe_decode", lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, layout)
    got = prefill_verify(sharded, mesh, in_mesh_context=True, attn_impl="pallas", moe_impl=moe_impl)
    _close(got, unsharded)
    # "decode": the in-place INT4 kernels ran in the region (a row of 7 tokens x top-3: 21 assignments <= 32)
    assert bool(traced) == (moe_impl == "decode")
    assert all(shape[0] <= 7 for shape in traced), traced  # inside the region: one data shard's row of tokens


def test_moe_names_the_rule_tables_model_axis():
    assert moe.MODEL == MODEL  # models/moe.py spells it out (importing sharding there would be a cycle)


def test_ep_without_a_mesh_is_gather(params):
    x = jax.random.normal(jax.random.key(3), (5, CONFIG.hidden_size))
    p = jax.tree.map(lambda a: a[1], params["moe_layers"])  # one MoE layer
    want = moe.moe(CONFIG, p, x, impl="gather")
    np.testing.assert_array_equal(np.asarray(moe.moe(CONFIG, p, x, impl="ep")), np.asarray(want))


def _ep_sharded_layer(params, mesh):
    """MoE layer 1 of the tiny K2 target with its experts split over "model" (the EP rule table)."""
    sharded = shard_params(
        {"moe_layers": params["moe_layers"]}, {"moe_layers": deepseek_v3.param_axes(CONFIG)["moe_layers"]}, mesh, "ep"
    )["moe_layers"]
    return jax.tree.map(lambda a: a[1], sharded)


def test_ep_region_many_tokens_uses_the_dense_local_product(params, mesh):
    """48 tokens * 3 > 4 local experts: each device's dense product over its own experts."""
    p = jax.tree.map(lambda a: a[1], params["moe_layers"])
    x = jax.random.normal(jax.random.key(4), (48, CONFIG.hidden_size))
    want = moe.moe_reference(CONFIG, p, x)
    layer = _ep_sharded_layer(params, mesh)
    with jax.set_mesh(mesh):
        run = jax.jit(lambda p, x: moe.moe(CONFIG, p, x, impl="ep"))
        assert "shard_map" in str(run.trace(layer, x).jaxpr)  # the region, not the unsharded fallback
        got = run(layer, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_ep_region_with_the_grouped_kernel_locally(params, mesh, monkeypatch):
    """The GPU rule for many assignments inside "ep": each device's grouped kernel (interpret mode here)
    over its own experts, the other devices' assignments run as local expert 0 with weight 0."""
    monkeypatch.setattr(dispatch, "local_expert_impl", lambda *args, **kwargs: "pallas")
    p = jax.tree.map(lambda a: a[1], params["moe_layers"])
    x = jax.random.normal(jax.random.key(6), (12, CONFIG.hidden_size))
    want = moe.moe_reference(CONFIG, p, x)
    layer = _ep_sharded_layer(params, mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, x: moe.moe(CONFIG, p, x, impl="ep"))(layer, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_tree_sampling_kernel_region_equals_unsharded(mesh):
    rng = np.random.default_rng(5)
    batch, vocab = 4, 128
    tree = build_tree(
        jnp.asarray(rng.standard_normal((batch, 3, vocab)) * 2, jnp.float32), 6, jnp.asarray([3, 5, 7, 2], jnp.int32)
    )
    logits = jnp.asarray(rng.standard_normal((batch, tree.tokens.shape[1], vocab)) * 3, jnp.float32)
    params = SamplingParams.create(
        batch, temperature=[1.0, 0.7, 0.0, 1.3], top_p=[0.9, 1.0, 1.0, 0.8], top_k=[0, 20, 0, 0]
    )
    keys = row_keys(jax.random.key(6), jnp.arange(batch))
    step = jax.jit(functools.partial(verify_step, impl="pallas"))
    want = step(tree, logits, params, keys)
    with jax.set_mesh(mesh):
        got = step(tree, logits, params, keys)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fit_specs_and_shard_call(mesh):
    x = jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 8)  # 6 rows: not divisible by "data"'s... 2 is fine, 4 not
    in_fit, out_fit, dropped = fit_specs(mesh, (x,), (P("data", "model"),), P("data", "model"))
    assert in_fit == (P("data", "model"),) and out_fit == P("data", "model") and not dropped
    odd = jnp.zeros((3, 8))
    in_fit, out_fit, dropped = fit_specs(mesh, (odd, x), (P("data", None), P(None, "model")), P("data", "model"))
    assert dropped == {"data"} and in_fit == (P(None, None), P(None, "model")) and out_fit == P(None, "model")

    def row_sums(block):  # a contraction split over "model": partial sums, then the psum
        return lax.psum(block.sum(-1), "model")

    assert context_mesh() is None
    with jax.set_mesh(mesh):
        assert context_mesh() is not None
        got = jax.jit(lambda a: shard_call(row_sums, (a,), (P("data", "model"),), P("data"), reduce_axes=("model",)))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x.sum(-1)))
        with pytest.raises(ValueError, match="mesh axis 'model' .* does not divide"):
            shard_call(row_sums, (jnp.zeros((2, 6)),), (P("data", "model"),), P("data"), reduce_axes=("model",))


def test_projections_read_in_place_per_shard_equal_unsharded(params, mesh, unsharded, monkeypatch):
    """The dense projections a layer scan hands over stacked (`dispatch.stacked_in_place`), read in place per
    shard under the TP mesh (`layers._linear_in_place`: each shard's part of the stack, partial products of a
    weight split along its input summed over "model"), equal the unsharded model. The skinny kernel (GPU only)
    is replaced by its twin with the same arguments; the twin's own tests are the kernel's."""
    from ddtree_jax.models import layers
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul_reference

    shapes = []

    def twin(x, stack, *, layer, interpret):
        assert interpret is False  # the layers call the compiled kernel (the dispatch sent them to a GPU)
        shapes.append(tuple(stack.shape))
        return skinny_matmul_reference(x, stack, layer=layer)

    names = dict(dispatch.IN_PLACE_PROJECTIONS)  # every split kind: out, in, none
    monkeypatch.setattr(dispatch, "stacked_in_place", lambda name, rows: name in names)
    monkeypatch.setattr(dispatch, "matmul_in_place", lambda *args, **kwargs: True)
    monkeypatch.setattr(layers, "skinny_matmul", twin)
    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, "tp")
    got = prefill_verify(sharded, mesh, in_mesh_context=True, attn_impl="pallas", moe_impl="pallas")
    _close(got, unsharded)
    moe_layers = CONFIG.num_layers - CONFIG.first_k_dense_replace
    heads_v = CONFIG.num_heads * CONFIG.v_head_dim
    assert (moe_layers, CONFIG.hidden_size, heads_v // 4) in shapes  # o_proj: its input split 4 ways, summed
    assert (moe_layers, CONFIG.q_lora_rank, CONFIG.hidden_size) in shapes  # q_a_proj: replicated, whole


def test_mla_head_kernels_per_shard_equal_unsharded(params, mesh, unsharded, monkeypatch):
    """Absorbed MLA's per-head products in `head_projections`' kernels (`dispatch.mla_head_kernels`) under the TP
    mesh: the layer scan hands kv_b_proj over stacked, each shard reads its heads' rows of it in place (split over
    "model" by the rule table) for W_UK (`absorb`, interpret mode) and W_UV (in the Mosaic kernel's merge: its twin
    here, with the same arguments); equal to the unsharded model."""
    import importlib

    attention_module = importlib.import_module("ddtree_jax.models.attention")
    shapes = []

    def twin(q_latent, q_rope, latent, rope_key, mask, *, scale, layer=None, packed_mask=None, **kwargs):
        up = {name: kwargs.pop(name) for name in ("up_weight", "up_layer", "up_offset", "up_width")}
        shapes.append((q_latent.shape[2], up["up_weight"].shape))
        return mla_kernel_twin(
            q_latent, q_rope, latent, rope_key, mask, scale=scale, layer=layer, packed_mask=packed_mask, **up
        )

    monkeypatch.setattr(attention_module, "mla_tree_attention", twin)
    monkeypatch.setattr(dispatch, "mla_attention_kernel", lambda **kw: "mosaic")
    monkeypatch.setattr(dispatch, "mla_head_kernels", lambda **kw: (True, True))
    monkeypatch.setattr(dispatch, "head_kernels_in_place", lambda name, backend_name=None: name == "kv_b_proj")
    sharded = shard_params(params, deepseek_v3.param_axes(CONFIG), mesh, "tp")
    got = prefill_verify(sharded, mesh, in_mesh_context=True, attn_impl="pallas", moe_impl="pallas")
    _close(got, unsharded)
    model = mesh.shape[MODEL]
    stride = CONFIG.qk_nope_head_dim + CONFIG.v_head_dim
    # per shard: its H / model heads, and their rows of every layer's kv_b_proj
    assert shapes and all(heads == CONFIG.num_heads // model for heads, _ in shapes), shapes
    assert all(shape[1:] == (CONFIG.num_heads // model * stride, CONFIG.kv_lora_rank) for _, shape in shapes), shapes
