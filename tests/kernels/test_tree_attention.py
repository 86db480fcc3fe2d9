"""kernels/tree_attention.py (interpret mode on CPU) against the models' XLA attention: GQA and
two-part (absorbed-MLA-shaped) keys, random trees over ragged prefixes (length 0 included), tree sizes
that are not powers of two, float32 and bf16, rows that see nothing, explicit kv_lengths, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels.tree_attention import (
    SMEM_BUDGET,
    BlockConfig,
    default_block_config,
    shared_memory_bytes,
    tree_attention,
    tree_attention_reference,
    visible_lengths,
)


def _tree_mask(rng, batch, steps, capacity, lengths):
    """Prefix [0, len) visible to every query; slot i at len + i sees itself and its ancestors."""
    mask = np.zeros((batch, steps, capacity), bool)
    for b in range(batch):
        mask[b, :, : lengths[b]] = True
        ancestors = np.eye(steps, dtype=bool)
        for i in range(1, steps):
            ancestors[i] |= ancestors[rng.integers(0, i)]
        mask[b, :, lengths[b] : lengths[b] + steps] = ancestors
    return jnp.asarray(mask)


def _inputs(seed, batch, steps, q_heads, kv_heads, dims, capacity, dtype, mla=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, capacity - steps + 1, batch)
    lengths[0] = 0  # a row with no prefix: the tree alone
    mask = _tree_mask(rng, batch, steps, capacity, lengths)
    q = tuple(jnp.asarray(rng.standard_normal((batch, steps, q_heads, d)), dtype) for d in dims)
    k = tuple(jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, d)), dtype) for d in dims)
    v = k[0] if mla else jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, dims[0])), dtype)
    return q, k, v, mask


CASES = {
    "gqa": dict(batch=3, steps=17, q_heads=8, kv_heads=2, dims=(32,), capacity=300),
    "gqa-single-query": dict(batch=2, steps=1, q_heads=4, kv_heads=4, dims=(16,), capacity=70),
    "gqa-tree-65": dict(batch=1, steps=65, q_heads=2, kv_heads=1, dims=(16,), capacity=200),
    "mla": dict(batch=2, steps=9, q_heads=8, kv_heads=1, dims=(64, 16), capacity=150, mla=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_the_xla_attention(case, dtype):
    q, k, v, mask = _inputs(len(case), dtype=dtype, **CASES[case])
    got = np.asarray(tree_attention(q, k, v, mask), np.float32)
    ref = np.asarray(tree_attention_reference(q, k, v, mask), np.float32)
    assert got.shape == ref.shape
    scale = np.abs(ref).max()
    # float32: reassociation only; bf16: the probabilities are rounded to bf16 before the value product
    assert np.abs(got - ref).max() <= (2e-5 if dtype == jnp.float32 else 2e-2) * scale


def test_rows_that_see_nothing_are_zero_and_kv_lengths_bound_the_keys():
    q, k, v, mask = _inputs(5, **CASES["gqa"], dtype=jnp.float32)
    mask = np.asarray(mask).copy()
    mask[1] = False
    out = np.asarray(tree_attention(q, k, v, jnp.asarray(mask)))
    assert (out[1] == 0).all() and np.abs(out[0]).max() > 0
    lengths = np.asarray(visible_lengths(jnp.asarray(mask)))
    assert lengths[1] == 0 and lengths[0] == np.flatnonzero(mask[0].any(0)).max() + 1
    cut = np.array([40, 0, 100], np.int32)  # keys at or past kv_lengths are neither read nor seen
    got = np.asarray(tree_attention(q, k, v, jnp.asarray(mask), kv_lengths=jnp.asarray(cut)))
    clipped = mask & (np.arange(mask.shape[-1])[None, None, :] < cut[:, None, None])
    np.testing.assert_allclose(got, np.asarray(tree_attention_reference(q, k, v, jnp.asarray(clipped))), atol=2e-5)


def test_kv_lengths_past_the_cache_or_negative_are_clipped_and_bad_shapes_named():
    """A length past S read keys past the cache (NaN out) where the reference attends the mask; a negative one
    sees no key. Clipped to [0, S] in the kernel, as the Mosaic kernels do; a wrong shape or dtype is named."""
    q, k, v, mask = _inputs(6, **CASES["gqa"], dtype=jnp.float32)
    capacity = mask.shape[-1]
    got = np.asarray(tree_attention(q, k, v, mask, kv_lengths=jnp.array([capacity + 40, capacity, 10**6], jnp.int32)))
    np.testing.assert_allclose(got, np.asarray(tree_attention_reference(q, k, v, mask)), atol=2e-5)
    none = np.asarray(tree_attention(q, k, v, mask, kv_lengths=jnp.array([-5, 0, -1], jnp.int32)))
    assert (none == 0).all()
    for bad in (jnp.array([10, 10, 10, 10], jnp.int32), jnp.int32(10), jnp.array([1.0, 2.0, 3.0])):
        with pytest.raises(ValueError, match="kv_lengths must be integers"):
            tree_attention(q, k, v, mask, kv_lengths=bad)


@pytest.mark.parametrize("config", [BlockConfig(16, 4, 1), BlockConfig(32, 8, 2), None])
def test_mla_values_from_the_latent_key_part(config):
    """v=None (absorbed MLA: the latent block serves scores and values) equals passing the latent as v,
    for explicit tilings and the default."""
    q, k, v, mask = _inputs(11, dtype=jnp.bfloat16, **CASES["mla"])
    got = np.asarray(tree_attention(q, k, None, mask, config=config), np.float32)
    ref = np.asarray(tree_attention_reference(q, k, None, mask), np.float32)
    np.testing.assert_array_equal(ref, np.asarray(tree_attention_reference(q, k, v, mask), np.float32))
    assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()


def test_default_tiling_fits_the_shared_memory_at_the_k26_and_qwen3_shapes():
    """The estimate against what Triton asked the H200 for at the MLA shape (64 rows x 512 + 64 key dims,
    512 value dims; BENCHMARKS.md, the first call and the tiling sweep), within 2 KB each, and the
    default tiling within the budget at the K2.6 and Qwen3 shapes."""
    requested = {BlockConfig(64, 4, 2): 353_280, BlockConfig(64, 8, 2): 354_304, BlockConfig(32, 4, 3): 283_648}
    for config, nbytes in requested.items():
        estimate = shared_memory_bytes(64, (512, 64), 512, config)
        assert abs(estimate - nbytes) <= 2048 and estimate > SMEM_BUDGET, (config, estimate)
    for block_m, dims, dv in ((64, (512, 64), 512), (64, (128,), 128), (16, (512, 64), 512)):
        config = default_block_config(block_m, dims, dv)
        assert shared_memory_bytes(block_m, dims, dv, config) <= SMEM_BUDGET, (block_m, dims, config)
    assert default_block_config(64, (128,), 128) == BlockConfig(64, 4, 2)  # GQA: the sweep's best
    assert default_block_config(64, (512, 64), 512) == BlockConfig(64, 8, 1)  # MLA: the sweep's best


def test_a_wrong_mask_is_caught():
    q, k, v, mask = _inputs(6, **CASES["gqa"], dtype=jnp.float32)
    shifted = jnp.roll(mask, 1, axis=-1)
    got = np.asarray(tree_attention(q, k, v, mask))
    assert np.abs(got - np.asarray(tree_attention_reference(q, k, v, shifted))).max() > 1e-2


def test_bad_inputs_are_named():
    q, k, v, mask = _inputs(7, **CASES["gqa"], dtype=jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        tree_attention((q[0][..., :24],), (k[0][..., :24],), v, mask)
    with pytest.raises(ValueError, match="mask must be"):
        tree_attention(q, k, v, mask[:, :3])
    with pytest.raises(ValueError, match="matching query and key parts"):
        tree_attention(q, k + k, v, mask)
    with pytest.raises(ValueError, match="block_s a power of two"):
        tree_attention(q, k, v, mask, config=BlockConfig(24, 4, 1))
