"""`ddtree_kernels.head_projections` against its twins, on fresh random inputs, interpret mode on the CPU and compiled
on a GPU. `merge_up` (the splits' merge and each head's up-projection in one launch): against its twin and against
the two steps it replaces (`mosaic_common.merge_splits`, then the per-head product); ragged split counts, padded rows,
rows whose splits saw no key, stacked weights read at traced layers (negative and past the end, as
`lax.dynamic_index_in_dim` reads them). `absorb` (each head's q slice times its weight rows): against its twin and a
numpy product, offsets into q and into each head's rows, traced layers."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels.head_projections import absorb, absorb_reference, merge_up, merge_up_reference
from ddtree_kernels.mosaic_common import merge_splits

# name: (B, splits, rows, padded rows, D, heads, stride, offset, width, weight layers or None, layer, block_v)
CASES = {
    "mla_shard_ar": (1, 7, 8, 8, 512, 8, 256, 128, 128, 3, 1, 32),  # K2.6 TP8's W_UV shape at one token
    "tree_rows_padded": (2, 5, 24, 29, 64, 8, 48, 16, 32, None, None, 16),
    "one_split": (1, 1, 4, 8, 128, 2, 64, 0, 64, 2, 0, 32),
    "many_splits_negative_layer": (1, 37, 6, 8, 64, 3, 40, 8, 32, 4, -1, 8),
    "layer_past_the_end": (2, 3, 4, 4, 64, 4, 32, 0, 32, 2, 9, 32),
}


def _inputs(name):
    batch, splits, rows, padded, dim, heads, stride, offset, width, layers, layer, block_v = CASES[name]
    keys = jax.random.split(jax.random.key(zlib.crc32(name.encode())), 3)
    partial = jax.random.normal(keys[0], (batch, splits, padded, dim)).astype(jnp.bfloat16)
    lse = jax.random.normal(keys[1], (batch, splits, padded + 3)) * 4
    lse = lse.at[0, :, rows - 1].set(-jnp.inf)  # a row no split saw a key for: merged to 0
    lse = lse.at[-1, 0, 0].set(-jnp.inf)  # one empty split of a row that others saw
    shape = (heads * stride, dim) if layers is None else (layers, heads * stride, dim)
    weight = (jax.random.normal(keys[2], shape) * 0.1).astype(jnp.bfloat16)
    kwargs = dict(rows=rows, heads=heads, offset=offset, width=width)
    return partial, lse, weight, (None if layer is None else jnp.int32(layer)), kwargs, block_v


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name):
    partial, lse, weight, layer, kwargs, block_v = _inputs(name)
    got = jax.jit(lambda *a: merge_up(*a, **kwargs, block_v=block_v, block_s=4))(partial, lse, weight, layer)
    want = merge_up_reference(partial, lse, weight, layer, **kwargs)
    assert got.shape == (partial.shape[0], kwargs["rows"], kwargs["width"]) and got.dtype == partial.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert np.all(got[0, kwargs["rows"] - 1] == 0)  # no key seen: zero, not a plausible row
    # bf16 outputs: within a few units of bf16's spacing of the largest value
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("name", ["mla_shard_ar", "many_splits_negative_layer", "tree_rows_padded"])
def test_reference_equals_the_merge_then_the_product(name):
    """The twin against the two steps it fuses, written independently: `merge_splits` (float32), then each head's
    rows offset .. + width of the (clamped) layer's weight, float64 in numpy."""
    partial, lse, weight, layer, kwargs, _ = _inputs(name)
    rows, heads, offset, width = (kwargs[k] for k in ("rows", "heads", "offset", "width"))
    merged = np.asarray(merge_splits(partial[:, :, :rows], lse[:, :, :rows], axis=1), np.float64)  # [B, R, D]
    w = np.asarray(weight, np.float64)
    if layer is not None:
        index = int(layer) + w.shape[0] if int(layer) < 0 else int(layer)
        w = w[min(max(index, 0), w.shape[0] - 1)]
    per_head = w.reshape(heads, -1, w.shape[-1])[:, offset : offset + width]  # [H, width, D]
    head_of_row = np.arange(rows) % heads
    want = np.einsum("brd,rvd->brv", merged, per_head[head_of_row])
    got = np.asarray(merge_up_reference(partial, lse, weight, layer, **kwargs), np.float64)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rows=7), "heads must be >= 1 and divide rows"),
        (dict(rows=40), "rows must be 1 .."),
        (dict(offset=200, width=64), "must lie in each head's"),
        (dict(width=48), "block_v must be a power of two dividing width"),
        (dict(weight_shape=(3, 8 * 256, 256)), "weight's last axis must be partial's D"),
        (dict(layer=None), "weight must be \\[H x stride, D\\]"),
        (dict(lse_dtype=jnp.bfloat16), "lse must be float32"),
        (dict(block_s=12), "block_s must be a power of two"),
        (dict(block_s=0), "block_s must be a power of two"),
    ],
)
def test_rejects_bad_arguments(change, message):
    partial, lse, weight, layer, kwargs, _ = _inputs("mla_shard_ar")
    change = dict(change)
    if "weight_shape" in change:
        weight = jnp.zeros(change.pop("weight_shape"), jnp.bfloat16)
    if "layer" in change:
        layer = change.pop("layer")
    if "lse_dtype" in change:
        lse = lse.astype(change.pop("lse_dtype"))
    with pytest.raises(ValueError, match=message):
        merge_up(partial, lse, weight, layer, **{**kwargs, **change})


# name: (B, rows, Dq, heads, stride, q_offset, width, w_offset, D, weight layers or None, layer)
ABSORB_CASES = {
    "mla_shard_ar": (1, 8, 192, 8, 256, 0, 128, 0, 512, 3, 2),  # K2.6 TP8's W_UK at one token, q read in place
    "tree_rows": (2, 17 * 4, 48, 4, 40, 0, 32, 0, 64, None, None),
    "offsets_negative_layer": (1, 6, 40, 3, 24, 8, 16, 4, 32, 4, -2),
    "layer_past_the_end": (1, 4, 16, 2, 16, 0, 16, 0, 256, 2, 7),
}


def _absorb_inputs(name):
    batch, rows, dq, heads, stride, q_offset, width, w_offset, dim, layers, layer = ABSORB_CASES[name]
    keys = jax.random.split(jax.random.key(zlib.crc32(name.encode())), 2)
    q = jax.random.normal(keys[0], (batch, rows, dq)).astype(jnp.bfloat16)
    shape = (heads * stride, dim) if layers is None else (layers, heads * stride, dim)
    weight = (jax.random.normal(keys[1], shape) * 0.1).astype(jnp.bfloat16)
    kwargs = dict(heads=heads, q_offset=q_offset, width=width, w_offset=w_offset)
    return q, weight, (None if layer is None else jnp.int32(layer)), kwargs


@pytest.mark.parametrize("name", list(ABSORB_CASES))
def test_absorb_matches_the_reference_and_the_per_head_product(name):
    """`absorb` against its twin, and the twin against the per-head product written independently in numpy
    (float64, the clamped layer, each row's head r mod H)."""
    q, weight, layer, kwargs = _absorb_inputs(name)
    got = jax.jit(lambda *a: absorb(*a, **kwargs, block_d=16))(q, weight, layer)
    want = absorb_reference(q, weight, layer, **kwargs)
    assert got.shape == q.shape[:2] + weight.shape[-1:] and got.dtype == q.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all() and np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    w = np.asarray(weight, np.float64)
    if layer is not None:
        index = int(layer) + w.shape[0] if int(layer) < 0 else int(layer)
        w = w[min(max(index, 0), w.shape[0] - 1)]
    heads, q_offset, width, w_offset = (kwargs[k] for k in ("heads", "q_offset", "width", "w_offset"))
    per_head = w.reshape(heads, -1, w.shape[-1])[:, w_offset : w_offset + width]  # [H, width, D]
    rows = q.shape[1]
    query = np.asarray(q, np.float64)[..., q_offset : q_offset + width]
    numpy = np.einsum("brn,rnd->brd", query, per_head[np.arange(rows) % heads])
    assert np.abs(want - numpy).max() <= 1e-2 * np.abs(numpy).max()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(heads=3), "heads must be >= 1 and divide q's rows"),
        (dict(q_offset=100), "must lie in q's last axis"),
        (dict(width=96), "width must be a power of two"),
        (dict(w_offset=200), "must lie in each head's"),
        (dict(layer=None), "weight must be \\[H x stride, D\\]"),
        (dict(weight_dim=96), "D must be a power of two"),
    ],
)
def test_absorb_rejects_bad_arguments(change, message):
    q, weight, layer, kwargs = _absorb_inputs("mla_shard_ar")
    change = dict(change)
    if "weight_dim" in change:
        weight = jnp.zeros(weight.shape[:-1] + (change.pop("weight_dim"),), jnp.bfloat16)
    if "layer" in change:
        layer = change.pop("layer")
    with pytest.raises(ValueError, match=message):
        absorb(q, weight, layer, **{**kwargs, **change})
