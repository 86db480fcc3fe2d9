"""kernels/decode_matmul.py (interpret mode on CPU) against `matmul_reference` on fresh random inputs:
bf16 / f32 activations, plain, INT4 and block-FP8 weights, ragged M and K / N that are not multiples
of the tiles (masked edges), leading batch dimensions, and the errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels.decode_matmul import (
    BLOCK_K,
    BLOCK_N,
    NARROW_GROUPED_TILES,
    SHORT_K_GROUPED_TILES,
    GroupedTiles,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_plan,
    matmul,
    matmul_reference,
    max_row_tiles,
    row_tiles,
)
from ddtree_kernels.quant import Fp8BlockWeight, quantize_int4


def _weights(rng, n, k, kind, dtype):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if kind == "dense":
        return jnp.asarray(w, dtype)
    if kind == "int4":
        q = quantize_int4(w)
        return type(q)(q.packed, q.scale.astype(dtype))
    scale = (rng.random((-(-n // 128), -(-k // 128))) + 0.5).astype(np.float32)
    return Fp8BlockWeight(jnp.asarray(w, jnp.float8_e4m3fn), jnp.asarray(scale))


TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}  # max |err| / max |ref|: float32 sums; bf16 output rounding


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17, 65, 130])
def test_matches_the_reference(kind, dtype, rows):
    rng = np.random.default_rng(rows * 7 + len(kind))
    n, k = BLOCK_N * 3 + 5, BLOCK_K + 96  # neither a multiple of its tile
    w = _weights(rng, n, k, kind, dtype)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    got = np.asarray(matmul(x, w), np.float32)
    ref = np.asarray(matmul_reference(x, w), np.float32)
    assert got.shape == (rows, n)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOL[dtype]


def test_split_k_and_leading_dimensions():
    rng = np.random.default_rng(1)
    n, k = 100, 8 * BLOCK_K + 32  # several K tiles: split-K sums partials
    w = _weights(rng, n, k, "int4", jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.float32)
    got = np.asarray(matmul(x, w))
    assert got.shape == (2, 3, n)
    np.testing.assert_allclose(got, np.asarray(matmul_reference(x, w)), rtol=1e-5, atol=1e-5)


def test_a_wrong_weight_is_caught():
    """The comparison can fail: a kernel run against another weight disagrees."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w, other = _weights(rng, 40, 64, "dense", jnp.float32), _weights(rng, 40, 64, "dense", jnp.float32)
    assert np.abs(np.asarray(matmul(x, w)) - np.asarray(matmul_reference(x, other))).max() > 1e-2


def test_bad_inputs_are_named():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="input features"):
        matmul(x, jnp.zeros((8, 32), jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        matmul(x.astype(jnp.float16), jnp.zeros((8, 64), jnp.float16))
    with pytest.raises(ValueError, match="one \\[N, K\\] weight"):
        matmul(x, jnp.zeros((2, 8, 64), jnp.float32))


# --- grouped (MoE) ------------------------------------------------------------------------------------------


def _expert_weights(rng, experts, n, k, kind):
    w = (rng.standard_normal((experts, n, k)) * 0.05).astype(np.float32)
    if kind == "dense":
        return jnp.asarray(w)
    if kind == "int4":
        return quantize_int4(w)
    scale = (rng.random((experts, -(-n // 128), -(-k // 128))) + 0.5).astype(np.float32)
    return Fp8BlockWeight(jnp.asarray(w, jnp.float8_e4m3fn), jnp.asarray(scale))


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 8, 40, 150])
def test_grouped_matches_the_reference(kind, rows):
    rng = np.random.default_rng(rows + len(kind))
    experts, n, k = 6, 2 * BLOCK_N + 2, BLOCK_K + 32
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    if rows >= 40:
        sizes[0] += sizes[1:3].sum()  # one crowded expert (several row tiles), two empty ones
        sizes[1:3] = 0
    w = _expert_weights(rng, experts, n, k, kind)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes)))
    ref = np.asarray(grouped_matmul_reference(x, w, jnp.asarray(sizes)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
@pytest.mark.parametrize(
    "tiles",
    [
        GroupedTiles(block_n=32, splits=3),
        GroupedTiles(block_n=128, block_k=512, splits=2),
        GroupedTiles(block_n=16, splits=1),
    ],
)
def test_grouped_tilings_and_split_k_match_the_reference(kind, tiles):
    """Other tile widths and explicit K splits (partial sums over splits; K = 3 tiles + a ragged edge, so
    3 splits put one tile in each and 2 splits leave the second one short)."""
    if kind == "fp8":
        tiles = dataclasses.replace(tiles, block_k=128, block_n=min(tiles.block_n, 64))
    rng = np.random.default_rng(tiles.block_n + (tiles.splits or 0) + len(kind))
    experts, n, k, rows = 5, 2 * tiles.block_n + 3, 3 * tiles.block_k - 96, 11
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    w = _expert_weights(rng, experts, n, k, kind)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes), tiles=tiles))
    ref = np.asarray(grouped_matmul_reference(x, w, jnp.asarray(sizes)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6
    _, _, splits, _ = grouped_plan(rows, experts, n, k, tiles)
    assert splits == min(tiles.splits, 3)


@pytest.mark.parametrize("shape", ["narrow", "short_k"])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_grouped_narrow_and_short_k_defaults_match_the_reference(shape, rows):
    """The decode tilings of a TP shard's experts (`default_grouped_tiles` picks them at the shard's shapes, checked
    in test_tiling) on small shapes: NARROW_GROUPED_TILES (one 512-wide K step a split: K = 3 steps - 96, so 3
    splits, the last short) and SHORT_K_GROUPED_TILES (one K step, 2 stages); bf16 and float32 activations,
    crowded and empty experts."""
    rng = np.random.default_rng(rows + len(shape))
    experts, n, k = {"narrow": (6, 200, 3 * 512 - 96), "short_k": (6, 300, 256)}[shape]
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    if rows >= 17:
        sizes[0] += sizes[1:3].sum()
        sizes[1:3] = 0
    w = _expert_weights(rng, experts, n, k, "int4")
    tiles = {"narrow": NARROW_GROUPED_TILES, "short_k": SHORT_K_GROUPED_TILES}[shape]
    assert grouped_plan(rows, experts, n, k, tiles)[2] == (3 if shape == "narrow" else 1)
    for dtype, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes), tiles=tiles), np.float32)
        ref = np.asarray(grouped_matmul_reference(x, w, jnp.asarray(sizes)), np.float32)
        assert np.abs(got - ref).max() / np.abs(ref).max() < tol, dtype


@pytest.mark.parametrize("rows", [1, 17, 70])
def test_grouped_int4_magic_bf16_matches_the_reference(rows):
    """The conversion-free dequantisation (magic_bf16) on bf16 activations: split K with a short last split, crowded
    and empty experts, every layer of a stacked weight read in place. It rounds each weight as "convert" does, so
    its output is the default's bits (and matches the twin); float32 activations or float32 scales take "convert"
    whatever is asked."""
    rng = np.random.default_rng(rows)
    layers, experts, n, k = 2, 6, 150, 3 * 512 - 96
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    if rows >= 17:
        sizes[0] += sizes[1:3].sum()
        sizes[1:3] = 0
    sizes = jnp.asarray(sizes)
    per_layer = [_expert_weights(rng, experts, n, k, "int4") for _ in range(layers)]
    w = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    w = type(w)(w.packed, w.scale.astype(jnp.bfloat16))  # bf16 scales, as the checkpoints store them
    base = GroupedTiles(block_n=64, block_k=512, splits=3)
    tiles = dataclasses.replace(base, dequant="magic_bf16")
    call = jax.jit(lambda x, i, t: grouped_matmul(x, w, sizes, layer=i, tiles=t), static_argnums=2)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    for layer in range(layers):
        got = np.asarray(call(x, jnp.int32(layer), tiles), np.float32)
        ref = np.asarray(grouped_matmul_reference(x, w, sizes, layer=layer), np.float32)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2, layer
        np.testing.assert_array_equal(got, np.asarray(call(x, jnp.int32(layer), base), np.float32))
    # float32 scales (quantize_int4's): magic_bf16 would round each scale to bf16 first, so "convert" runs instead
    w_f32 = type(w)(w.packed, jax.random.uniform(jax.random.key(rows), w.scale.shape, jnp.float32, 0.001, 0.02))
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(x, w_f32, sizes, layer=1, tiles=tiles), np.float32),
        np.asarray(grouped_matmul(x, w_f32, sizes, layer=1, tiles=base), np.float32),
    )
    x32 = x.astype(jnp.float32)
    got32 = np.asarray(call(x32, jnp.int32(1), tiles))
    ref32 = np.asarray(grouped_matmul_reference(x32, w, sizes, layer=1))
    assert np.abs(got32 - ref32).max() / np.abs(ref32).max() < 2e-6
    np.testing.assert_array_equal(got32, np.asarray(call(x32, jnp.int32(1), base)))


def test_grouped_dequant_modes_are_checked():
    with pytest.raises(ValueError, match="dequant must be one of .* got 'fast'"):
        GroupedTiles(dequant="fast").check("int4")
    with pytest.raises(ValueError, match="dequant 'magic_bf16' applies to INT4 weights with per-plane dots .* fp8"):
        GroupedTiles(block_k=128, dequant="magic_bf16").check("fp8")
    with pytest.raises(ValueError, match="one_dot=True"):
        GroupedTiles(dequant="magic_bf16", one_dot=True).check("int4")


@pytest.mark.parametrize("rows", [1, 40, 150])
@pytest.mark.parametrize(
    "tiles",
    [GroupedTiles(block_n=32, splits=1, one_dot=True), GroupedTiles(block_n=64, block_k=512, splits=2, one_dot=True)],
)
def test_grouped_one_dot_int4_matches_the_reference(rows, tiles):
    """one_dot: each K step one dot over the 8 nibble planes side by side (activations relaid plane-major within
    each K tile): crowded and empty experts, a ragged K edge (K = 3 tiles - 96), split K."""
    rng = np.random.default_rng(rows + tiles.block_n)
    experts, n, k = 6, 2 * tiles.block_n + 3, 3 * tiles.block_k - 96
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    if rows >= 40:
        sizes[0] += sizes[1:3].sum()
        sizes[1:3] = 0
    w = _expert_weights(rng, experts, n, k, "int4")
    for dtype, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes), tiles=tiles), np.float32)
        ref = np.asarray(grouped_matmul_reference(x, w, jnp.asarray(sizes)), np.float32)
        assert np.abs(got - ref).max() / np.abs(ref).max() < tol, dtype


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
def test_grouped_reads_one_layer_of_stacked_weights_in_place(kind):
    """layer=: every layer's experts stacked [L, E, N, K], the layer a traced scalar (as in a scan)."""
    rng = np.random.default_rng(len(kind))
    layers, experts, n, k, rows = 3, 4, 70, 2 * BLOCK_K, 9
    per_layer = [_expert_weights(rng, experts, n, k, kind) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    sizes = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    run = jax.jit(lambda x, w, i: grouped_matmul(x, w, sizes, layer=i))
    for layer in range(layers):
        got = np.asarray(run(x, stacked, jnp.int32(layer)))
        ref = np.asarray(grouped_matmul_reference(x, per_layer[layer], sizes))
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6, layer
        np.testing.assert_array_equal(ref, np.asarray(grouped_matmul_reference(x, stacked, sizes, layer=layer)))
    with pytest.raises(
        ValueError, match=r"with layer= grouped_matmul takes every layer's expert weights \[L, E, N, K\]"
    ):
        grouped_matmul(x, per_layer[0], sizes, layer=0)
    with pytest.raises(ValueError, match="pass layer="):
        grouped_matmul(x, stacked, sizes)
    # out of range, the layer reads as lax.dynamic_index_in_dim reads it (negative from the end, then clamped),
    # the twin alike: the kernel read past the stack (non-finite out) before
    last = np.asarray(run(x, stacked, jnp.int32(2)))
    for layer in (-1, 7):
        np.testing.assert_array_equal(np.asarray(run(x, stacked, jnp.int32(layer))), last)
        np.testing.assert_array_equal(np.asarray(grouped_matmul(x, stacked, sizes, layer=layer)), last)
        ref = np.asarray(grouped_matmul_reference(x, stacked, sizes, layer=layer))
        assert np.abs(last - ref).max() / np.abs(ref).max() < 2e-6


def _tokens_and_row_index(rng, tokens: int, top_k: int, experts: int):
    """A MoE layer's routing on random experts: (row_index int32 [A] = each sorted assignment's token, group_sizes
    int32 [E]); A = tokens x top_k, sorted stably by expert as `moe.sort_by_expert` does (tokens repeat)."""
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    order = np.argsort(chosen, kind="stable")
    return jnp.asarray(order // top_k, jnp.int32), jnp.asarray(np.bincount(chosen, minlength=experts), jnp.int32)


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_grouped_reads_rows_through_row_index(kind, dtype, tokens):
    """row_index: the kernel reads each sorted row from x [tokens, K] in place (the MoE layer's tokens, each
    repeated over its top-k experts): bit for bit the call on the rows gathered first, and the reference's."""
    rng = np.random.default_rng(tokens + 7 * len(kind))
    experts, n, k, top_k = 7, BLOCK_N + 5, BLOCK_K + 64, 3
    row_index, sizes = _tokens_and_row_index(rng, tokens, top_k, experts)
    w = _expert_weights(rng, experts, n, k, kind)
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    got = np.asarray(grouped_matmul(x, w, sizes, row_index=row_index), np.float32)
    gathered_first = np.asarray(grouped_matmul(x[row_index], w, sizes), np.float32)
    np.testing.assert_array_equal(got, gathered_first)
    ref = np.asarray(grouped_matmul_reference(x[row_index], w, sizes), np.float32)
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOL[dtype]


@pytest.mark.parametrize(
    "tiles",
    [
        GroupedTiles(block_n=64, block_k=512, splits=2, one_dot=True),
        dataclasses.replace(NARROW_GROUPED_TILES, splits=3),
        SHORT_K_GROUPED_TILES,
    ],
)
def test_grouped_row_index_with_stacked_layers_and_int4_tilings(tiles):
    """row_index with the INT4 layouts (one_dot's tiled columns, magic_bf16, split-K) and one layer of a stack read
    in place, under jit with the layer traced; 40 tokens x top-4 over 9 experts (several row tiles an expert)."""
    rng = np.random.default_rng(tiles.block_k + tiles.one_dot)
    layers, experts, n, k, tokens, top_k = 2, 9, 96, 3 * tiles.block_k, 40, 4
    per_layer = [_expert_weights(rng, experts, n, k, "int4") for _ in range(layers)]
    per_layer = [type(w)(w.packed, w.scale.astype(jnp.bfloat16)) for w in per_layer]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    row_index, sizes = _tokens_and_row_index(rng, tokens, top_k, experts)
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
    run = jax.jit(lambda x, w, i, rows: grouped_matmul(x, w, sizes, layer=i, row_index=rows, tiles=tiles))
    for layer in range(layers):
        got = np.asarray(run(x, stacked, jnp.int32(layer), row_index), np.float32)
        want = np.asarray(grouped_matmul(x[row_index], per_layer[layer], sizes, tiles=tiles), np.float32)
        np.testing.assert_array_equal(got, want)


def test_grouped_row_index_errors_are_named():
    w = _expert_weights(np.random.default_rng(1), 2, 64, 256, "int4")
    sizes = jnp.asarray([2, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"row_index entries must lie in \[0, 3\) \(x's rows\), got 3"):
        grouped_matmul(jnp.ones((3, 256)), w, sizes, row_index=jnp.asarray([0, 3, 1]))
    with pytest.raises(ValueError, match="row_index must be integer"):
        grouped_matmul(jnp.ones((3, 256)), w, sizes, row_index=jnp.zeros((3,), jnp.float32))


def test_grouped_plan_fills_the_gpu_at_decode_and_bad_tilings_are_named():
    # decode and tree-verify sizes: 4 K splits (fewer where K has fewer than 8 tiles); prefill sizes: none
    assert grouped_plan(8, 384, 2048, 7168, GroupedTiles())[2] == 4
    assert grouped_plan(512, 384, 7168, 2048, GroupedTiles())[2] == 4
    assert grouped_plan(8, 4, 64, 768, GroupedTiles())[2] == 1  # 3 K tiles
    assert grouped_plan(513, 384, 2048, 7168, GroupedTiles())[2] == 1
    w = _expert_weights(np.random.default_rng(0), 2, 64, 256, "int4")
    with pytest.raises(ValueError, match="block_k 128 does not suit int4"):
        grouped_matmul(jnp.zeros((3, 256)), w, jnp.asarray([3, 0], jnp.int32), tiles=GroupedTiles(block_k=128))
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 48"):
        grouped_matmul(jnp.zeros((3, 256)), w, jnp.asarray([3, 0], jnp.int32), tiles=GroupedTiles(block_n=48))
    with pytest.raises(ValueError, match="splits must be >= 1 or None, got 0"):
        grouped_matmul(jnp.zeros((3, 256)), w, jnp.asarray([3, 0], jnp.int32), tiles=GroupedTiles(splits=0))
    dense_w = _expert_weights(np.random.default_rng(0), 2, 64, 256, "dense")
    with pytest.raises(ValueError, match="one_dot applies to INT4 weights only, got dense weights"):
        grouped_matmul(jnp.zeros((3, 256)), dense_w, jnp.asarray([3, 0], jnp.int32), tiles=GroupedTiles(one_dot=True))


def test_row_tiles_cover_each_group_once():
    sizes = jnp.asarray([0, 5, 40, 0, 17, 1], jnp.int32)
    tiles = np.asarray(row_tiles(sizes, 16, 12))
    covered = []
    for expert, first, count in tiles.T:
        covered += [(int(expert), r) for r in range(first, first + count)]
    starts = np.cumsum(sizes) - sizes
    want = [(e, int(starts[e]) + i) for e in range(6) for i in range(int(sizes[e]))]
    assert sorted(covered) == want


def test_row_tiles_on_random_group_sizes_match_numpy():
    """The tile table's prefix sums (one masked row sum, not a cumsum) on random sizes at K2.6's 384 experts: every
    row covered once by its own expert's tiles, the used tiles first, each starting at its group's first row."""
    from ddtree_kernels.decode_matmul import _exclusive_prefix_sum

    rng = np.random.default_rng(5)
    for rows, block_m in ((136, 16), (520, 16), (3000, 64)):
        sizes = np.bincount(rng.integers(0, 384, rows), minlength=384).astype(np.int32)
        np.testing.assert_array_equal(_exclusive_prefix_sum(jnp.asarray(sizes)), np.cumsum(sizes) - sizes)
        tiles = np.asarray(
            jax.jit(row_tiles, static_argnums=(1, 2))(jnp.asarray(sizes), block_m, max_row_tiles(rows, 384, block_m))
        )
        used = tiles[2] > 0
        assert used[: used.sum()].all() and not used[used.sum() :].any()
        starts = np.cumsum(sizes) - sizes
        covered = sorted((int(e), r) for e, first, count in tiles.T for r in range(first, first + count))
        assert covered == [(e, int(starts[e]) + i) for e in range(384) for i in range(int(sizes[e]))]


def test_grouped_bad_inputs_are_named():
    w = jnp.zeros((4, 8, 64), jnp.float32)
    # concrete group sizes must tile the rows (a short sum left rows NaN, a negative size shifted the groups)
    for sizes in ([1, 1, 0, 0], [4, -1, 0, 0], [3, 1, 0, 0]):
        with pytest.raises(ValueError, match=r"group_sizes must be >= 0 and sum to the 3 rows"):
            grouped_matmul(jnp.zeros((3, 64)), w, jnp.asarray(sizes, jnp.int32))
    with pytest.raises(ValueError, match="one entry per expert"):
        grouped_matmul(jnp.zeros((3, 64)), w, jnp.asarray([3, 0], jnp.int32))
    with pytest.raises(ValueError, match="stacked expert weights"):
        grouped_matmul(jnp.zeros((3, 64)), jnp.zeros((8, 64)), jnp.asarray([3], jnp.int32))
