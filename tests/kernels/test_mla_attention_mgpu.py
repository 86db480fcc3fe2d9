"""The Mosaic GPU absorbed-MLA tree attention (`ddtree_kernels.mla_attention_mgpu`) against its XLA twin, in
Mosaic GPU interpret mode on the CPU.

Interpret mode runs a CTA's three warpgroups as threads that block inside host callbacks (barrier waits);
with XLA's CPU thread pool at its default size (the core count) two blocked warpgroups can starve the
third on a 2-core machine and the kernel hangs. The cases therefore run in one subprocess with a larger
pool (NPROC=64, read when the CPU client starts), and each test checks its case's result.
"""

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.mosaic_interpret import compare, run_in_subprocess, run_jitted, tree_mask

# name: (B, T, H, S, kv_lengths, kwargs). Rows T * H = 136, 72, 68, 144, 66: partial row blocks; S not a
# multiple of the key block in two; ragged lengths with 0 and 1; one split with the pipeline in its steady
# state (5 blocks, 2 stages); T = 33: two mask words.
CASES = {
    "t17_h8_splits": (2, 17, 8, 320, (300, 1), dict(num_splits=3)),
    "t9_h8_empty_row": (2, 9, 8, 200, (0, 190), dict(num_splits=2)),
    "t17_h4_scale": (2, 17, 4, 192, (150, 40), dict(num_splits=2, scale=0.05)),
    "t9_h16_one_split": (1, 9, 16, 300, (297,), dict(num_splits=1)),
    "t33_h2_two_words": (1, 33, 2, 130, (128,), dict(num_splits=2)),
    # split_scores: each compute warpgroup scores half of a block's keys, P and row statistics exchanged
    "split_t17_h8_splits": (2, 17, 8, 320, (300, 1), dict(num_splits=3, split_scores=True)),
    "split_t33_h2_two_words": (1, 33, 2, 130, (128,), dict(num_splits=2, split_scores=True)),
    # overlap: block i's scores issued with block i - 1's value product (FA3's intra-warpgroup overlap); a split
    # of 0 blocks (length 0: the pipeline skipped), of 1 (prologue and epilogue only), a ring that wraps (5 blocks,
    # 2 slots), two mask words, a stacked layer
    "overlap_t9_h8_empty_row": (2, 9, 8, 200, (0, 190), dict(num_splits=2, overlap=True)),
    "overlap_t17_h8_splits": (2, 17, 8, 320, (300, 1), dict(num_splits=3, overlap=True)),
    "overlap_t9_h16_one_split": (1, 9, 16, 300, (297,), dict(num_splits=1, overlap=True)),
    "overlap_t33_h2_stacked": (1, 33, 2, 192, (150,), dict(num_splits=1, stack=(2, 1), overlap=True)),
    # alternate: blocks in pairs, one scored by each compute warpgroup (P and maxima exchanged); an empty split, odd
    # block counts (1, 3, 5: the last block unpaired), a ring that wraps (5 blocks, 2 slots), two mask words, a stack
    "alt_t9_h8_empty_row": (2, 9, 8, 200, (0, 190), dict(num_splits=2, alternate=True)),
    "alt_t17_h8_splits": (2, 17, 8, 320, (300, 1), dict(num_splits=3, alternate=True)),
    "alt_t9_h16_one_split": (1, 9, 16, 300, (297,), dict(num_splits=1, alternate=True)),
    "alt_t33_h2_stacked": (1, 33, 2, 192, (150,), dict(num_splits=1, stack=(2, 1), alternate=True)),
    # striped: even tree queries see keys in odd key blocks only, odd ones in even blocks only (8 blocks, one
    # split): a row whose first key is in a pair's second block, or whose pair's second block is all hidden
    "alt_striped_blocks": (1, 9, 8, 512, (500,), dict(num_splits=1, alternate=True, striped=True)),
    "overlap_striped_blocks": (1, 9, 8, 512, (500,), dict(num_splits=1, overlap=True, striped=True)),
    "striped_blocks": (1, 9, 8, 512, (500,), dict(num_splits=1, striped=True)),
    # layer=: every layer's caches stacked [L, B, S, 1, ...] (L = 3), layer 2 / 0 read in place, traced
    "stacked_layer2": (2, 9, 8, 192, (150, 40), dict(num_splits=2, stack=(3, 2))),
    "stacked_layer0_split": (2, 9, 8, 192, (150, 40), dict(num_splits=2, stack=(3, 0), split_scores=True)),
    # a negative layer counts from the end, as lax.dynamic_index_in_dim (the callers' slicing path) reads it
    "stacked_layer_minus1": (1, 9, 8, 128, (100,), dict(num_splits=1, stack=(3, -1))),
    # past the last layer: clamped to it (the kernel clamps the index itself, as dynamic_index_in_dim does)
    "stacked_layer_past_end": (1, 9, 8, 128, (100,), dict(num_splits=2, stack=(3, 5))),
    # lengths out of range (kv_lengths: the kernel's and the reference's, the mask built from the first): past S
    # (clamped to S by the kernel, no block past the cache read) and negative (nothing seen: the row is zero)
    "lengths_out_of_range": (2, 9, 8, 192, (150, 40), dict(num_splits=2, kv_lengths=(262, -5))),
    # packed_mask: the mask packed once by the caller (pack_tree_mask), S = 300 padded to whole blocks
    "packed_t9_h16": (1, 9, 16, 300, (297,), dict(num_splits=2, packed=True)),
    # up_weight: each head's W_UV rows (kv_b_proj's layout: stride nope + v = 256, offset nope = 128, width v = 128)
    # applied in the splits' merge (`head_projections.merge_up`); unstacked with three splits, and every layer's
    # weights [4, H x 256, 512] read at a traced layer -1 beside stacked caches, an empty row among them
    "up_t17_h8_splits": (2, 17, 8, 320, (300, 1), dict(num_splits=3, up=(256, 128, 128))),
    "up_stacked_t9_h8_empty_row": (2, 9, 8, 192, (0, 150), dict(num_splits=2, stack=(3, 2), up=(256, 128, 128, 4, -1))),
}
TOLERANCE = 1e-2  # ||out - ref|| / ||ref||, bf16 outputs and probabilities
ROW_TOLERANCE = 3e-2  # the same over the worst row that sees a key (8 x bf16's relative spacing)
# compiled on the GPU only (too slow to interpret): the K2.6 TP8 shard's verify shapes, long enough for every split
# to run its pipeline in the steady state
GPU_CASES = {
    "gpu_t17_h8_8k": (1, 17, 8, 8192, (8150,), dict()),
    "gpu_t17_h8_8k_overlap": (1, 17, 8, 8192, (8150,), dict(overlap=True)),
    "gpu_t65_h64_2k_overlap": (2, 65, 64, 2048, (2000, 3), dict(overlap=True)),
    "gpu_t9_h8_stacked_overlap": (2, 9, 8, 4096, (4000, 1), dict(stack=(4, 3), overlap=True)),
    "gpu_t17_h8_8k_alternate": (1, 17, 8, 8192, (8150,), dict(alternate=True)),
    "gpu_t65_h64_2k_alternate": (2, 65, 64, 2048, (2000, 3), dict(alternate=True)),
    "gpu_up_t17_h8_8k_stacked": (1, 17, 8, 8192, (8150,), dict(stack=(2, 1), up=(256, 128, 128, 3, 2))),
    "gpu_up_t1_h8_4k": (1, 1, 8, 4160, (4100,), dict(up=(256, 128, 128))),
}


def out_width(name: str) -> int:
    """A case's output columns: 512, or the up-projection's width."""
    up = {**CASES, **GPU_CASES}[name][-1].get("up")
    return 512 if up is None else up[2]


def run_case(name: str) -> dict:
    from ddtree_kernels.mla_attention_mgpu import mla_tree_attention, mla_tree_attention_reference, pack_tree_mask

    batch, steps, heads, capacity, lengths, kwargs = {**CASES, **GPU_CASES}[name]
    kwargs = dict(kwargs)
    packed = kwargs.pop("packed", False)
    striped = kwargs.pop("striped", False)
    num_layers, layer = kwargs.pop("stack", (None, None))
    stack = () if num_layers is None else (num_layers,)
    up = kwargs.pop("up", None)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 5)
    up_reference = {}
    if up is not None:  # (stride, offset, width[, weight layers, traced layer]): W_UV rows of each head
        stride, offset, width, *up_stack = up
        weight = jax.random.normal(keys[4], tuple(up_stack[:1]) + (heads * stride, 512), jnp.bfloat16) * 0.05
        kwargs.update(up_weight=weight, up_offset=offset, up_width=width)
        if up_stack:
            kwargs["up_layer"] = jnp.int32(up_stack[1])
            weight = jax.lax.dynamic_index_in_dim(weight, up_stack[1], 0, keepdims=False)
        up_reference = dict(up_weight=weight, up_offset=offset, up_width=width)
    q_latent = jax.random.normal(keys[0], (batch, steps, heads, 512), jnp.bfloat16)
    q_rope = jax.random.normal(keys[1], (batch, steps, heads, 64), jnp.bfloat16)
    latent = jax.random.normal(keys[2], stack + (batch, capacity, 1, 512), jnp.bfloat16)
    rope_key = jax.random.normal(keys[3], stack + (batch, capacity, 1, 64), jnp.bfloat16)
    mask = tree_mask(rng, steps, capacity, lengths)
    if striped:  # tree query t sees only key blocks of the other parity than t
        block_parity = (np.arange(capacity) // 64) % 2
        mask = mask & (block_parity[None, None, :] != (np.arange(steps) % 2)[None, :, None])
    mask = jnp.asarray(mask)
    kv_lengths = jnp.asarray(kwargs.pop("kv_lengths", lengths), jnp.int32)
    if stack:  # the layer a traced scalar, as in a layer scan; the reference reads that layer's slice
        attend = jax.jit(lambda *a: mla_tree_attention(*a[:5], kv_lengths=kv_lengths, layer=a[5], **kwargs))
        out = run_jitted(attend, q_latent, q_rope, latent, rope_key, mask, jnp.int32(layer))
        latent = jax.lax.dynamic_index_in_dim(latent, layer, 0, keepdims=False)
        rope_key = jax.lax.dynamic_index_in_dim(rope_key, layer, 0, keepdims=False)
    elif packed:  # the kernel reads the packing, not mask's values: hand it an all-False mask beside it
        packed_mask = pack_tree_mask(mask, kv_lengths)
        out = run_jitted(
            mla_tree_attention, q_latent, q_rope, latent, rope_key, jnp.zeros_like(mask), packed_mask=packed_mask
        )
    else:
        out = run_jitted(mla_tree_attention, q_latent, q_rope, latent, rope_key, mask, kv_lengths=kv_lengths, **kwargs)
    scale = kwargs.get("scale")
    ref = mla_tree_attention_reference(
        q_latent, q_rope, latent, rope_key, mask, scale=scale, kv_lengths=kv_lengths, **up_reference
    )
    visible = mask & (jnp.arange(capacity)[None, None, :] < kv_lengths[:, None, None])  # what the rows may see
    return compare(out, ref, visible)


def _main():  # the subprocess: every case, one JSON line
    print(json.dumps({name: run_case(name) for name in CASES}))


@pytest.fixture(scope="module")
def results():
    return run_in_subprocess("from tests.kernels.test_mla_attention_mgpu import _main; _main()")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(results, name):
    batch, steps, heads, *_ = CASES[name]
    result = results[name]
    assert result["shape"] == [batch, steps, heads, out_width(name)]
    assert result["finite"]
    assert result["empty_rows_zero"], result
    assert result["rel_err"] < TOLERANCE and result["max_row_err"] < ROW_TOLERANCE, result


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a Hopper GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES) + list(GPU_CASES))
def test_compiled_on_gpu(name):
    """Every interpret-mode case, and the shard's long-context shapes, compiled on the GPU against the twin."""
    batch, steps, heads, *_ = {**CASES, **GPU_CASES}[name]
    result = run_case(name)
    assert result["shape"] == [batch, steps, heads, out_width(name)]
    assert result["finite"] and result["empty_rows_zero"], result
    assert result["rel_err"] < TOLERANCE and result["max_row_err"] < ROW_TOLERANCE, result


def test_cases_cover_empty_and_single_key_rows():
    lengths = [length for case in CASES.values() for length in case[4]]
    assert 0 in lengths and 1 in lengths


def test_out_of_range_lengths_see_their_clamped_keys(results):
    """kv_lengths past S read the whole cache, a negative one nothing (its rows zero), as the reference says."""
    result = results["lengths_out_of_range"]
    assert result["empty_rows"] == 9 and result["empty_rows_zero"], result  # the batch row of length -5: 9 rows


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_latent=(1, 3, 2, 256)), "q_latent must be"),
        (dict(q_rope=(1, 3, 2, 32)), "q_rope must be"),
        (dict(latent=(1, 40, 2, 512)), "latent must be"),
        (dict(rope_key=(1, 41, 1, 64)), "rope_key must be"),
        (dict(mask=(1, 3, 39)), "mask must be"),
        (dict(dtype=jnp.float32), "must be bfloat16"),
        (dict(block_kv=128), "block_kv must be 64 .* got 128"),
        (dict(block_kv=32), "block_kv must be 64 .* got 32"),  # interprets, but does not lower for the GPU
        (dict(q_latent=(1, 700, 2, 512), q_rope=(1, 700, 2, 64), mask=(1, 700, 40)), "T = 700 tree queries"),
        (dict(num_splits=0), "num_splits must be >= 1, got 0"),
        (dict(alternate=True, split_scores=True), "alternate excludes split_scores and overlap"),
        (dict(kv_lengths=(2,)), "kv_lengths must be"),
        (dict(layer=1), "with layer= latent and rope_key are every layer's caches"),
        (dict(layer=1, latent=(2, 1, 40, 1, 512), rope_key=(2, 1, 40, 1, 64)), "S = 40 must be a multiple of"),
        (dict(layer=1, latent=(2, 1, 64, 1, 512), rope_key=(3, 1, 64, 1, 64)), "must stack the same layers"),
        (dict(packed_mask=((1, 1, 39), (1,))), "packed_mask must be pack_tree_mask of a"),
        (dict(packed_mask=((1, 1, 40), (1,)), kv_lengths=(1,)), "pass kv_lengths through pack_tree_mask"),
        # an empty cache or tree was a zero-size reduction error
        (
            dict(latent=(1, 0, 1, 512), rope_key=(1, 0, 1, 64)),
            "B, T, H and S must be >= 1, got B = 1, T = 3, H = 2, S = 0",
        ),
        (dict(q_latent=(1, 0, 2, 512), q_rope=(1, 0, 2, 64), mask=(1, 0, 40)), "T = 0"),
        # the up-projection in the merge (up_weight=): its arguments named
        (dict(up_offset=128, up_width=128), "go with up_weight"),
        (dict(up_weight=(2 * 256, 512), up_offset=128), "up_width .* must be given"),
        (dict(up_weight=(2 * 256, 512), up_offset=200, up_width=128), "must lie in each head's 256 rows"),
        (dict(up_weight=(2 * 256, 512), up_offset=128, up_width=48), "multiple of 32"),
        (dict(up_weight=(3, 2 * 256, 512), up_offset=128, up_width=128), "up_weight must be \\[H x stride, 512\\]"),
        (dict(up_weight=(3, 2 * 256, 512), up_layer=1.7, up_offset=128, up_width=128), "up_layer must be an integer"),
    ],
)
def test_rejects_bad_shapes(change, message):
    from ddtree_kernels.mla_attention_mgpu import mla_tree_attention

    dtype = change.get("dtype", jnp.bfloat16)
    shapes = dict(q_latent=(1, 3, 2, 512), q_rope=(1, 3, 2, 64), latent=(1, 40, 1, 512), rope_key=(1, 40, 1, 64))
    shapes.update({k: v for k, v in change.items() if k in shapes})
    arrays = {k: jnp.zeros(v, jnp.bfloat16 if k.startswith("q") else dtype) for k, v in shapes.items()}
    mask = jnp.ones(change.get("mask", (1, 3, arrays["latent"].shape[-3])), bool)
    names = ("block_kv", "num_splits", "layer", "alternate", "split_scores", "up_layer", "up_offset", "up_width")
    kwargs = {k: change[k] for k in names if k in change}
    if "up_weight" in change:
        kwargs["up_weight"] = jnp.zeros(change["up_weight"], jnp.bfloat16)
    if "packed_mask" in change:
        words, lengths = change["packed_mask"]
        kwargs["packed_mask"] = (jnp.zeros(words, jnp.int32), jnp.zeros(lengths, jnp.int32))
    if "kv_lengths" in change:
        kwargs["kv_lengths"] = jnp.zeros(change["kv_lengths"], jnp.int32)
    with pytest.raises(ValueError, match=message):
        mla_tree_attention(**arrays, mask=mask, **kwargs)


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(split_scores=True), dict(overlap=True), dict(alternate=True)],
    ids=["default", "split", "overlap", "alternate"],
)
@pytest.mark.parametrize("steps, heads, capacity", [(17, 8, 8256), (7, 4, 128), (9, 16, 300), (65, 64, 1088)])
def test_lowers_for_gpu(steps, heads, capacity, variant):
    """The compiled kernel (not the interpreter) lowers to Mosaic GPU for "cuda" on this CPU machine, TMA
    tiling included: T * H = 28 (not a multiple of 8) failed here and on the H200 before the rows were padded;
    S = 300 is padded to whole key blocks by the wrapper. The lowering also checks the shared memory (232,448
    bytes) and wgmma's operand layouts: split_scores' first forms failed both here (235,584 bytes; P's swizzle
    as a shared-memory operand)."""
    from ddtree_kernels.mla_attention_mgpu import mla_tree_attention

    args = (
        jax.ShapeDtypeStruct((2, steps, heads, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, steps, heads, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, capacity, 1, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, capacity, 1, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, steps, capacity), jnp.bool_),
    )
    attend = jax.jit(lambda *a: mla_tree_attention(*a, **variant, interpret=False))
    assert "mosaic_gpu" in attend.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_stacked_caches_reach_the_kernel_unsliced():
    """layer=: the GPU program passes the stacked caches [L, B, S, 1, ...] to the Mosaic kernel as they are (no
    slice, no copy of the layer's cache before the custom call) and reads the layer inside it."""
    from ddtree_kernels.mla_attention_mgpu import mla_tree_attention

    num_layers, batch, steps, heads, capacity = 61, 1, 17, 8, 4224
    args = (
        jax.ShapeDtypeStruct((batch, steps, heads, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, steps, heads, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_layers, batch, capacity, 1, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_layers, batch, capacity, 1, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, steps, capacity), jnp.bool_),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    attend = jax.jit(lambda *a: mla_tree_attention(*a[:5], layer=a[5], interpret=False))
    text = attend.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert f"{num_layers}x{batch}x{capacity}x512xbf16" in text  # the stack reshaped (a bitcast), whole
    assert "stablehlo.dynamic_slice" not in text
