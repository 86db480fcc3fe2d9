"""The Mosaic GPU grouped INT4 matmul (`ddtree_kernels.grouped_int4_mgpu`) against its twin in Mosaic GPU
interpret mode on the CPU (fresh random inputs and routings), its tile tables, argument checks, a CPU lowering
for "cuda", and (on a GPU only) the compiled kernel at K2.6 expert shapes.

The interpreted cases run in one subprocess with NPROC=64 (`mosaic_interpret`: the warpgroups are threads that
block in host callbacks, which a 2-core pool can starve).
"""

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.mosaic_interpret import assert_close, run_in_subprocess, run_jitted

# name: (group sizes, N, K, scale dtype, kwargs). Empty experts (first, middle, last), an expert over several
# row blocks, experts sharing a block, A not a multiple of the block (zeros past A), one row, the ring's steady
# state (4 K steps through 2 slots), more slots than K steps, block_m 128, float32 scales, stacked layers, the
# deferred slot release, small tiles with K split over CTAs (float32 partial sums).
CASES = {
    "ragged_bm64": ([5, 0, 70, 9, 1, 0], 128, 512, "bfloat16", dict()),
    "steady_ring": ([0, 33, 31, 64], 128, 1024, "bfloat16", dict(stages=2)),
    "one_row": ([0, 1, 0], 128, 256, "bfloat16", dict()),
    "bm128_f32_scales": ([40, 100, 3], 128, 256, "float32", dict(block_m=128)),
    "more_stages_than_steps": ([17, 18], 128, 256, "bfloat16", dict(block_m=16, stages=4)),
    "layer_of_three": ([12, 0, 52], 128, 512, "bfloat16", dict(layer=2)),
    # each step's slot released one step later (2 and 3 slots over 4 and 3 K steps)
    "deferred_two_slots": ([0, 33, 31, 64], 128, 1024, "bfloat16", dict(stages=2, deferred_release=True)),
    "deferred_three_slots": ([9, 60], 128, 768, "bfloat16", dict(stages=3, deferred_release=True)),
    "bm16_k_splits": ([3, 0, 20, 7], 128, 1024, "bfloat16", dict(block_m=16, k_splits=2)),
    "bm8_four_splits_f32": ([1, 2, 0, 9], 256, 1024, "float32", dict(block_m=8, k_splits=4)),
    "deferred_with_splits": (
        [5, 20, 0],
        128,
        1024,
        "bfloat16",
        dict(block_m=32, k_splits=2, stages=2, deferred_release=True),
    ),
}
# the decode form (`gathered_int4_matmul`): name: (experts of the rows (E = max + 1 unless stated), N, K, scale
# dtype, kwargs). A repeated expert, A not a multiple of 8, an out-of-range id (clamped, as the twin), the
# default K splits, a stacked layer.
GATHERED = {
    "gathered_8_default_splits": ([5, 1, 5, 3, 0, 2, 7, 6], 256, 1024, "bfloat16", dict(layer=1)),
    "gathered_11_one_split_f32": ([2, 0, 1, 3, 3, 1, 0, 2, 9, 1, 2], 128, 512, "float32", dict(k_splits=1, experts=4)),
}
TOLERANCE = 1e-2  # ||y - ref|| / ||ref|| and max |y - ref| / max |ref|: bf16 output (interpret: ~1e-7)


def _inputs(name, sizes, n, k, scale_dtype, layers=None):
    from ddtree_kernels.quant import Int4Weight

    seed = zlib.crc32(name.encode())
    rng = np.random.default_rng(seed)
    experts = len(sizes)
    lead = (layers,) if layers else ()
    packed = rng.integers(-(2**31), 2**31, size=lead + (experts, n, k // 8), dtype=np.int64).astype(np.int32)
    scale = rng.uniform(0.5, 1.5, size=lead + (experts, n, k // 32)) * k**-0.5
    weight = Int4Weight(jnp.asarray(packed), jnp.asarray(scale, scale_dtype))
    x = jnp.asarray(rng.normal(size=(int(sum(sizes)), k)), jnp.bfloat16)
    return x, weight, jnp.asarray(sizes, jnp.int32)


def run_case(name: str) -> dict:
    from ddtree_kernels.grouped_int4_mgpu import (
        gathered_int4_matmul,
        gathered_int4_matmul_reference,
        grouped_int4_matmul,
        grouped_int4_matmul_reference,
    )

    if name in GATHERED:
        ids, n, k, scale_dtype, kwargs = GATHERED[name]
        kwargs = dict(kwargs)
        layer = kwargs.pop("layer", None)
        num_experts = kwargs.pop("experts", max(ids) + 1)
        x, weight, _ = _inputs(name, [1] * num_experts, n, k, scale_dtype, layers=2 if layer is not None else None)
        x = jnp.asarray(np.random.default_rng(zlib.crc32(name.encode()) + 1).normal(size=(len(ids), k)), jnp.bfloat16)
        experts = jnp.asarray(ids, jnp.int32)
        out = run_jitted(gathered_int4_matmul, x, weight, experts, layer=layer, interpret=True, **kwargs)
        ref = np.asarray(gathered_int4_matmul_reference(x, weight, experts, layer=layer), np.float32)
    else:
        sizes, n, k, scale_dtype, kwargs = CASES[name]
        kwargs = dict(kwargs)
        layer = kwargs.pop("layer", None)
        x, weight, group_sizes = _inputs(name, sizes, n, k, scale_dtype, layers=3 if layer is not None else None)
        out = run_jitted(grouped_int4_matmul, x, weight, group_sizes, layer=layer, interpret=True, **kwargs)
        ref = np.asarray(grouped_int4_matmul_reference(x, weight, group_sizes, layer=layer), np.float32)
    y = np.asarray(out, np.float32)
    return {
        "shape": list(y.shape),
        "dtype": str(out.dtype),
        "finite": bool(np.isfinite(y).all()),
        "max_err": float(np.abs(y - ref).max() / np.abs(ref).max()),
        "rel_err": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
    }


def _main():  # the subprocess: every case, one JSON line
    print(json.dumps({name: run_case(name) for name in [*CASES, *GATHERED]}))


@pytest.fixture(scope="module")
def results():
    return run_in_subprocess("from tests.kernels.test_grouped_int4_mgpu import _main; _main()")


@pytest.mark.parametrize("name", [*CASES, *GATHERED])
def test_matches_reference(results, name):
    """Both forms against their twins: the sorted form's rows are its group sizes' sum, the decode form's its ids."""
    rows = sum(CASES[name][0]) if name in CASES else len(GATHERED[name][0])
    n = (CASES if name in CASES else GATHERED)[name][1]
    result = results[name]
    assert result["shape"] == [rows, n] and result["dtype"] == "bfloat16"
    assert result["finite"]
    assert result["max_err"] < TOLERANCE and result["rel_err"] < TOLERANCE, result


def test_decode_k_splits_fill_the_sms():
    """The decode form's default split: the fewest dividing K's steps with >= 132 CTAs, else every step."""
    from ddtree_kernels.grouped_int4_mgpu import decode_k_splits

    assert decode_k_splits(8, 256, 7168) == 14  # K2.6 TP8 gate at one token: 16 CTAs x 14 splits of 2 steps
    assert decode_k_splits(8, 7168, 256) == 1  # down: 8 x 56 = 448 CTAs already
    assert decode_k_splits(136, 256, 7168) == 1  # a 17-token tree: 272 CTAs
    assert decode_k_splits(8, 256, 1024) == 4  # 64 CTAs at most: every step its own split


def _check_tiles(sizes, block_m):
    """Every row covered by exactly one tile of its expert, at its place in the tile; tiles start on a multiple of
    8 rows; the tile count is what each expert's span needs and within `max_row_tiles`."""
    from ddtree_kernels.decode_matmul import max_row_tiles, row_tile_index, row_tiles

    sizes = np.asarray(sizes)
    experts, rows = len(sizes), int(sizes.sum())
    num_tiles = max_row_tiles(rows, experts, block_m)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    # one compiled program a shape (eager, each op is compiled alone for every new shape: 3x the test's time)
    tables = jax.jit(lambda g: (row_tiles(g, block_m, num_tiles, align=8), row_tile_index(g, rows, block_m, align=8)))
    tile_table, index = tables(group_sizes)
    expert, start, count = np.asarray(tile_table)
    index = np.asarray(index)
    owner = np.repeat(np.arange(experts), sizes)
    tile, offset = index // block_m, index % block_m
    assert (count[tile] > 0).all()
    assert (expert[tile] == owner).all()
    assert (start[tile] + offset == np.arange(rows)).all()  # the tile holds the row in place
    assert count.sum() == rows and (start % 8 == 0).all()
    firsts = np.cumsum(sizes) - sizes
    needed = sum(-(-(n + f % 8) // block_m) for n, f in zip(sizes, firsts) if n)
    assert (count > 0).sum() == needed <= num_tiles
    tiles_of = np.bincount(expert[count > 0], minlength=experts)
    assert (tiles_of[(sizes > 0) & (sizes <= block_m - 7)] == 1).all()  # weights streamed once


def test_tile_table_and_row_index():
    rng = np.random.default_rng(3)
    for block_m in (64, 128):
        for _ in range(20):
            experts = int(rng.integers(1, 12))
            sizes = rng.integers(0, 3 * block_m, experts) * rng.integers(0, 2, experts)
            if sizes.sum():
                _check_tiles(sizes, block_m)
        # adversarial: every expert starting 7 rows into an 8-row tile, or spanning one row past a tile
        _check_tiles([7] + [block_m] * 9, block_m)
        _check_tiles([1] + [block_m - 1] * 12 + [1], block_m)
        _check_tiles([7, block_m - 6] * 6, block_m)
        _check_tiles([1] * 40, block_m)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=48), "block_m must be one of"),
        (dict(block_k=128), "block_k = 128 must be a multiple of 256"),
        (dict(k_splits=2), "a multiple of block_k x k_splits = 256 x 2"),
        (dict(k_splits=0), "k_splits must be >= 1"),
        (dict(stages=0), "stages must be >= 1"),
        (dict(stages=9), "bytes of shared memory"),
    ],
)
def test_bad_arguments(kwargs, message):
    from ddtree_kernels.grouped_int4_mgpu import grouped_int4_matmul

    x, weight, sizes = _inputs("bad", [3, 5], 128, 256, "bfloat16")
    with pytest.raises(ValueError, match=message):
        grouped_int4_matmul(x, weight, sizes, **kwargs)


def test_bad_shapes():
    from ddtree_kernels.grouped_int4_mgpu import grouped_int4_matmul

    x, weight, sizes = _inputs("shapes", [3, 5], 128, 256, "bfloat16")
    with pytest.raises(ValueError, match="x must be bfloat16"):
        grouped_int4_matmul(x.astype(jnp.float32), weight, sizes)
    with pytest.raises(ValueError, match="one entry per expert"):
        grouped_int4_matmul(x, weight, sizes[:1])
    # group sizes that do not tile the rows (NaN or shifted rows out) and a scale layout that does not match the
    # words (finite garbage out): named, as decode_matmul.grouped_matmul names them
    rows = x.shape[0]
    for bad in ([rows - 1, 0], [rows + 2, -2]):
        with pytest.raises(ValueError, match=f"group_sizes must be >= 0 and sum to the {rows} rows"):
            grouped_int4_matmul(x, weight, jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match="scale shape .* does not match the packed words"):
        grouped_int4_matmul(x, type(weight)(weight.packed, weight.scale[..., ::2]), sizes)
    with pytest.raises(ValueError, match="take an Int4Weight"):
        grouped_int4_matmul(x, weight.dequantize(jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="pass layer="):
        grouped_int4_matmul(x, jax.tree.map(lambda a: a[None], weight), sizes)
    _, narrow, _ = _inputs("narrow", [3, 5], 64, 256, "bfloat16")
    with pytest.raises(ValueError, match="N = 64 must be a multiple of 128"):
        grouped_int4_matmul(x, narrow, sizes)
    from ddtree_kernels.grouped_int4_mgpu import gathered_int4_matmul

    with pytest.raises(ValueError, match=r"experts must be int32 \[A\] = \(8,\)"):
        gathered_int4_matmul(x, weight, jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize(
    "rows, n, k, kwargs",
    [
        (16384, 2048, 7168, {}),  # K2.6 gate / up at a 2,048-token chunk
        (16384, 7168, 2048, {}),  # down
        (16384, 2048, 7168, dict(block_m=128)),
        (16384, 2048, 7168, dict(deferred_release=True)),
        (100, 256, 512, dict(stages=2, block_m=16, k_splits=2)),
        (8, 256, 7168, dict(gathered=True)),  # the decode form at the K2.6 TP8 shard's gate / up
        (8, 7168, 256, dict(gathered=True)),  # and down
        (100, 256, 1024, dict(scale_dtype=jnp.float32, k_splits=2)),  # float32 scales: 32-byte scale boxes
    ],
)
def test_lowers_for_gpu(rows, n, k, kwargs):
    """The compiled kernel lowers to Mosaic GPU for "cuda" on this CPU machine: the int4 TMA boxes, the
    UPCAST_4X loads and the register A operand, the scales read as stored and transposed in shared memory, the
    transposed output store (float32 partial sums with K splits), the shared memory."""
    from ddtree_kernels.grouped_int4_mgpu import gathered_int4_matmul, grouped_int4_matmul
    from ddtree_kernels.quant import Int4Weight

    kwargs = dict(kwargs)
    gathered = kwargs.pop("gathered", False)
    scale_dtype = kwargs.pop("scale_dtype", jnp.bfloat16)
    experts = 384 if rows > 1000 or gathered else 4

    def call(x, packed, scale, ids):
        if gathered:
            return gathered_int4_matmul(x, Int4Weight(packed, scale), ids, interpret=False, **kwargs)
        return grouped_int4_matmul(x, Int4Weight(packed, scale), ids, interpret=False, **kwargs)

    args = (
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((experts, n, k // 8), jnp.int32),
        jax.ShapeDtypeStruct((experts, n, k // 32), scale_dtype),
        jax.ShapeDtypeStruct((rows if gathered else experts,), jnp.int32),
    )
    assert "mosaic_gpu" in jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a Hopper GPU")


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, n, k, kwargs",
    [
        ("gate", 2048, 7168, {}),
        ("down", 7168, 2048, {}),
        ("gate_bm128", 2048, 7168, dict(block_m=128)),
        ("down_split2", 7168, 2048, dict(k_splits=2)),
        ("gate_deferred", 2048, 7168, dict(deferred_release=True)),
    ],
)
def test_compiled_on_gpu(name, n, k, kwargs):
    """The compiled kernel at K2.6 expert shapes (a 512-token chunk x top-8 over 64 experts, uniform routing),
    stacked layers read in place, against the twin."""
    from ddtree_kernels.grouped_int4_mgpu import grouped_int4_matmul

    experts = 64
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    sizes = np.bincount(rng.integers(0, experts, 512 * 8), minlength=experts)
    sizes[5] = 0  # an expert without rows
    x, weight, group_sizes = _inputs(name, list(sizes), n, k, "bfloat16", layers=2)
    y = np.asarray(grouped_int4_matmul(x, weight, group_sizes, layer=1, **kwargs), np.float32)
    # the reference on the device as one XLA ragged_dot over the layer's dequantised experts (the twin's per-row
    # weights [A, N, K] would take 100+ GB; the twin itself is compared on the CPU cases above)
    dense_w = weight.dequantize(jnp.bfloat16)[1].transpose(0, 2, 1)  # [E, K, N]
    ref = np.asarray(jax.lax.ragged_dot(x, dense_w, group_sizes, preferred_element_type=jnp.float32), np.float32)
    assert_close(y, ref, TOLERANCE)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, assignments, n, k",
    [
        ("tp8_gate_one_token", 8, 256, 7168),  # K2.6 TP8 shard: gate / up at one token (14 K splits)
        ("tp8_down_one_token", 8, 7168, 256),  # down
        ("tp8_gate_tree_17", 136, 256, 7168),  # a 17-token tree step
    ],
)
def test_gathered_compiled_on_gpu(name, assignments, n, k):
    """The decode form compiled at the K2.6 TP8 shard's expert shapes (384 experts, random ids with repeats,
    a stacked layer read in place) against its twin."""
    from ddtree_kernels.grouped_int4_mgpu import gathered_int4_matmul, gathered_int4_matmul_reference

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    _, weight, _ = _inputs(name, [1] * 384, n, k, "bfloat16", layers=2)
    x = jnp.asarray(rng.normal(size=(assignments, k)), jnp.bfloat16)
    experts = jnp.asarray(rng.integers(0, 384, assignments), jnp.int32)
    y = np.asarray(gathered_int4_matmul(x, weight, experts, layer=1), np.float32)
    ref = np.asarray(gathered_int4_matmul_reference(x, weight, experts, layer=1), np.float32)
    assert_close(y, ref, TOLERANCE)
