"""ddtree_kernels.tiling and each kernel's shared-memory planning: every default tiling fits Hopper's
232,448 bytes for every supported dtype, the estimate bounds what Triton asked the H200 for, and the
precision contract (float32 at float32) holds for the references."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels import decode_matmul, tiling, tree_attention
from ddtree_kernels.decode_matmul import (
    NARROW_GROUPED_TILES,
    PREFILL_GROUPED_TILES,
    SHORT_K_GROUPED_TILES,
    GroupedTiles,
    default_grouped_tiles,
    fit_grouped_tiles,
    fit_tiling,
    resident_tiles,
    stage_tiles,
)
from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight

ACTIVATIONS = (jnp.bfloat16, jnp.float32)
WEIGHTS = {  # kind -> (stored weight dtype, scale dtype) of every format the loaders produce
    "dense-bf16": ("dense", jnp.bfloat16, jnp.float32),
    "dense-f32": ("dense", jnp.float32, jnp.float32),
    "int4-bf16-scales": ("int4", jnp.int32, jnp.bfloat16),
    "int4-f32-scales": ("int4", jnp.int32, jnp.float32),
    "fp8": ("fp8", jnp.float8_e4m3fn, jnp.float32),
}
BLOCK_M = (16, 32, 64)


def _grouped_bytes(kind, x_dtype, w_dtype, s_dtype, block_m, tiles):
    return tiling.pipelined_bytes(
        stage_tiles(kind, x_dtype, w_dtype, s_dtype, block_m, tiles.block_n, tiles.block_k),
        tiles.num_stages,
        resident_tiles(kind, x_dtype, tiles.block_n, tiles.block_k, tiles.one_dot),
    )


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("x_dtype", ACTIVATIONS)
def test_every_default_grouped_tiling_fits_the_shared_memory(weight, x_dtype):
    kind, w_dtype, s_dtype = WEIGHTS[weight]
    base = GroupedTiles(block_k=128) if kind == "fp8" else GroupedTiles()
    for block_m in BLOCK_M:
        tiles = fit_grouped_tiles(base, kind, x_dtype, w_dtype, s_dtype, block_m)
        tiles.check(kind)  # still a valid tiling of the format
        assert _grouped_bytes(kind, x_dtype, w_dtype, s_dtype, block_m, tiles) <= tiling.SMEM_LIMIT_BYTES, (
            block_m,
            tiles,
        )


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("x_dtype", ACTIVATIONS)
def test_every_default_plain_tiling_fits_the_shared_memory(weight, x_dtype):
    kind, w_dtype, s_dtype = WEIGHTS[weight]
    block_k0 = 128 if kind == "fp8" else decode_matmul.BLOCK_K
    for block_m in BLOCK_M:
        block_k, stages = fit_tiling(
            kind, x_dtype, w_dtype, s_dtype, block_m, decode_matmul.BLOCK_N, block_k0, decode_matmul.NUM_STAGES
        )
        nbytes = tiling.pipelined_bytes(
            stage_tiles(kind, x_dtype, w_dtype, s_dtype, block_m, decode_matmul.BLOCK_N, block_k), stages
        )
        assert nbytes <= tiling.SMEM_LIMIT_BYTES
        assert block_k % {"int4": 256, "fp8": 128, "dense": 16}[kind] == 0


def test_the_bf16_and_int4_defaults_are_left_as_measured():
    """Only 4-byte operands are cut down: the tilings the H200 sweeps chose stay for bf16 / INT4 / FP8."""
    for kind, w_dtype, s_dtype in (("dense", jnp.bfloat16, jnp.float32), ("int4", jnp.int32, jnp.bfloat16)):
        assert fit_grouped_tiles(GroupedTiles(), kind, jnp.bfloat16, w_dtype, s_dtype, 16) == GroupedTiles()
        assert fit_tiling(kind, jnp.bfloat16, w_dtype, s_dtype, 64, 64, 256, 3) == (256, 3)
    assert fit_grouped_tiles(
        GroupedTiles(block_k=128), "fp8", jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32, 16
    ) == GroupedTiles(block_k=128)
    # float32 dense weights at 128 columns: 128 x 256 x 4 bytes a stage alone is 128 KiB; cut to fit
    cut = fit_grouped_tiles(GroupedTiles(), "dense", jnp.float32, jnp.float32, jnp.float32, 16)
    assert (cut.block_k, cut.num_stages) != (GroupedTiles().block_k, GroupedTiles().num_stages)


def test_the_estimate_bounds_what_triton_asked_the_h200_for():
    """Requests that failed on one H200 (RESOURCE_EXHAUSTED, jax 0.11.2, float32 grouped dense kernel):
    GroupedTiles(block_n=128, block_k=512, splits=2) at 16 rows asked for 589,824 bytes; the 128 x 256
    default for 262,144. The planning estimate must not under-count either."""
    f32 = jnp.float32
    assert _grouped_bytes("dense", f32, f32, f32, 16, GroupedTiles(block_n=128, block_k=512)) >= 589_824
    assert _grouped_bytes("dense", f32, f32, f32, 16, GroupedTiles()) >= 262_144


def test_default_grouped_tiles_per_format():
    fp8 = Fp8BlockWeight(jnp.zeros((2, 128, 128), jnp.float8_e4m3fn), jnp.ones((2, 1, 1), jnp.float32))
    assert default_grouped_tiles(fp8).block_k == 128

    def int4(n, k, experts=384):  # shapes only: the choice reads nothing else
        return Int4Weight(
            jax.ShapeDtypeStruct((experts, n, k // 8), jnp.int32),
            jax.ShapeDtypeStruct((experts, n, k // 32), jnp.bfloat16),
        )

    # K2.6 whole, one TP8 shard's gate / up and down, tiny experts
    assert default_grouped_tiles(int4(2048, 7168), 136) == GroupedTiles()
    assert default_grouped_tiles(int4(256, 7168), 136) == NARROW_GROUPED_TILES
    assert default_grouped_tiles(int4(7168, 256), 136) == SHORT_K_GROUPED_TILES
    assert default_grouped_tiles(int4(128, 128)) == GroupedTiles()  # a tiny model's: not the measured shapes
    assert default_grouped_tiles(int4(256, 1024)) == GroupedTiles()
    assert default_grouped_tiles(int4(256, 7168), 16384) == PREFILL_GROUPED_TILES  # 43 rows an expert: prefill


@pytest.mark.parametrize("dtype,itemsize", [(jnp.bfloat16, 2), (jnp.float32, 4)])
def test_attention_tiling_fits_for_every_shape_and_dtype(dtype, itemsize):
    shapes = {"gqa": ((128,), 128), "mla": ((512, 64), 512)}
    for (name, (key_dims, value_dim)), block_m in itertools.product(shapes.items(), BLOCK_M):
        config = tree_attention.default_block_config(block_m, key_dims, value_dim, itemsize)
        assert (
            tree_attention.shared_memory_bytes(block_m, key_dims, value_dim, config, itemsize)
            <= tiling.SMEM_LIMIT_BYTES
        )
    # float32 halves what fits: the MLA shape at 64 rows must drop to fewer keys per block than bf16's
    bf16 = tree_attention.default_block_config(64, (512, 64), 512, 2)
    f32 = tree_attention.default_block_config(64, (512, 64), 512, 4)
    assert f32.block_s * f32.num_stages < bf16.block_s * bf16.num_stages


def test_dot_precision_contract():
    from jax import lax

    assert tiling.dot_precision(jnp.float32) == lax.Precision.HIGHEST
    assert tiling.dot_precision(jnp.bfloat16) == lax.Precision.DEFAULT


def test_references_run_float32_at_float32():
    """The twins at float32 agree with a float64 numpy product to float32 rounding (a TF32 product would
    miss by ~1e-3 relative on the GPU; on the CPU this pins the declared precision of the call)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    got = np.asarray(decode_matmul.matmul_reference(jnp.asarray(x), jnp.asarray(w)), np.float64)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_the_one_dot_estimate_bounds_what_triton_asked_the_h200_for():
    """One-dot INT4 tilings that failed on one H200 (RESOURCE_EXHAUSTED, jax 0.11.2, b1a8ad7, bf16, a prefill
    chunk's 64-row tiles) each asked for 294,912 bytes; the one that ran (PREFILL_GROUPED_TILES) fits."""
    bf16, i32 = jnp.bfloat16, jnp.int32
    for tiles in (
        GroupedTiles(block_n=128, block_k=512, num_warps=8, num_stages=2, one_dot=True),
        GroupedTiles(block_n=256, block_k=256, num_warps=8, one_dot=True),
    ):
        assert _grouped_bytes("int4", bf16, i32, bf16, 64, tiles) >= 294_912
        cut = fit_grouped_tiles(tiles, "int4", bf16, i32, bf16, 64)
        assert _grouped_bytes("int4", bf16, i32, bf16, 64, cut) <= tiling.SMEM_LIMIT_BYTES
    assert fit_grouped_tiles(PREFILL_GROUPED_TILES, "int4", bf16, i32, bf16, 64) == PREFILL_GROUPED_TILES
    # float32 activations at one-dot tilings (the GPU test's 64 x 512 at 16 rows): cut down until they fit
    for x_dtype, block_m in itertools.product(ACTIVATIONS, BLOCK_M):
        for tiles in (PREFILL_GROUPED_TILES, GroupedTiles(block_n=64, block_k=512, splits=2, one_dot=True)):
            cut = fit_grouped_tiles(tiles, "int4", x_dtype, i32, bf16, block_m)
            cut.check("int4")
            assert _grouped_bytes("int4", x_dtype, i32, bf16, block_m, cut) <= tiling.SMEM_LIMIT_BYTES


def test_int4_prefill_chunks_default_to_the_one_dot_tiling():
    """PREFILL_GROUPED_TILES where the assignments fill 64-row tiles (> 32 an expert on average), the decode
    tiling below: one token, a 64-node tree (520 assignments), a 2,048-token chunk over 384 experts."""
    int4 = Int4Weight(  # K2.6's whole gate (shapes only): neither narrow nor short-K
        jax.ShapeDtypeStruct((384, 2048, 7168 // 8), jnp.int32),
        jax.ShapeDtypeStruct((384, 2048, 7168 // 32), jnp.bfloat16),
    )
    assert default_grouped_tiles(int4, 8) == GroupedTiles()
    assert default_grouped_tiles(int4, 520) == GroupedTiles()
    assert default_grouped_tiles(int4, 384 * 32) == GroupedTiles()
    assert default_grouped_tiles(int4, 384 * 33) == PREFILL_GROUPED_TILES
    assert default_grouped_tiles(int4, 16_384) == PREFILL_GROUPED_TILES
    fp8 = Fp8BlockWeight(jnp.zeros((2, 128, 128), jnp.float8_e4m3fn), jnp.ones((2, 1, 1), jnp.float32))
    assert default_grouped_tiles(fp8, 16_384) == GroupedTiles(block_k=128)
