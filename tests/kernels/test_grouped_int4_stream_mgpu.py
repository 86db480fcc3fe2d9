"""The streamed Mosaic GPU grouped INT4 matmul (`ddtree_kernels.grouped_int4_stream_mgpu`) against its twin in
Mosaic GPU interpret mode on the CPU (fresh random inputs and routings), its plan and argument checks, a CPU
lowering for "cuda", and (on a GPU only) the compiled kernel at the K2.6 TP8 shard's expert shapes.

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
from tests.kernels.test_grouped_int4_mgpu import _inputs

# name: (group sizes, N, K, scale dtype, kwargs). Few CTAs, so that each walks several items and its ring wraps
# across them; an expert over several tiles (13 rows at block_m 8 and 16), empty experts (first, middle, last), A
# not a multiple of 8, one step a chunk and several, float32 scales, a stacked layer, more CTAs than items.
CASES = {
    "bm16_one_chunk": ([1, 2, 0, 1, 3, 1, 13, 2, 0], 256, 512, "bfloat16", dict(chunks=1, num_ctas=3, stages=2)),
    "bm8_two_chunks": ([0, 2, 5, 1, 0, 9, 1], 128, 1024, "bfloat16", dict(block_m=8, chunks=2, num_ctas=4, stages=3)),
    "bm16_every_step_a_chunk_f32": ([3, 0, 1, 1, 2], 256, 768, "float32", dict(chunks=3, num_ctas=5, stages=4)),
    "layer_of_three_planned": ([2, 1, 0, 4, 1, 1], 128, 512, "bfloat16", dict(layer=2)),
    "more_ctas_than_items": ([0, 1, 0], 128, 256, "bfloat16", dict(num_ctas=16)),
    "one_token_default_block_m": ([1, 0, 1, 1, 1, 0, 1, 1, 1, 1], 128, 512, "bfloat16", dict(num_ctas=4)),
}
TOLERANCE = 1e-2  # max |y - ref| / max |ref| and ||y - ref|| / ||ref||: bf16 output (interpret: ~0)


def run_case(name: str) -> dict:
    from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul, streamed_int4_matmul_reference

    sizes, n, k, scale_dtype, kwargs = CASES[name]
    kwargs = dict(kwargs)
    layer = kwargs.pop("layer", None)
    x, weight, group_sizes = _inputs(name, sizes, n, k, scale_dtype, layers=3 if layer is not None else None)
    out = run_jitted(streamed_int4_matmul, x, weight, group_sizes, layer=layer, interpret=True, **kwargs)
    ref = np.asarray(streamed_int4_matmul_reference(x, weight, group_sizes, layer=layer), np.float32)
    y = np.asarray(out, np.float32)
    return {
        "shape": list(y.shape),
        "dtype": str(out.dtype),
        "finite": bool(np.isfinite(y).all()),
        "max_err": float(np.abs(y - ref).max() / np.abs(ref).max()),
        "rel_err": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
    }


def _main():  # the subprocess: every case, one JSON line
    print(json.dumps({name: run_case(name) for name in CASES}))


@pytest.fixture(scope="module")
def results():
    return run_in_subprocess("from tests.kernels.test_grouped_int4_stream_mgpu import _main; _main()")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(results, name):
    sizes, n = CASES[name][0], CASES[name][1]
    result = results[name]
    assert result["shape"] == [sum(sizes), n] and result["dtype"] == "bfloat16"
    assert result["finite"]
    assert result["max_err"] < TOLERANCE and result["rel_err"] < TOLERANCE, result


@pytest.mark.parametrize("rows, block_m", [(1, 8), (8, 8), (9, 16), (136, 16)])
def test_block_m_default_follows_the_rows(monkeypatch, rows, block_m):
    """block_m's default: 8-row tiles up to one token's top-8 (each expert one row), 16 above."""
    from ddtree_kernels import grouped_int4_stream_mgpu as stream

    seen = {}
    monkeypatch.setattr(stream, "_streamed", lambda *args, **kwargs: seen.update(kwargs))
    sizes = [rows // 2, 0, rows - rows // 2]
    x, weight, group_sizes = _inputs("default_block_m", sizes, 128, 256, "bfloat16")
    stream.streamed_int4_matmul(x, weight, group_sizes, interpret=True)
    assert seen["block_m"] == block_m


def test_stream_plan_gives_every_cta_items():
    """The default K chunks: the fewest (dividing K's 256-wide steps) with >= 4 items a CTA for the table's most
    tiles, else one step a chunk."""
    from ddtree_kernels.grouped_int4_stream_mgpu import stream_plan

    # the K2.6 TP8 shard (384 experts): gate / up [256, 7168] (28 steps, 2 column blocks), down [7168, 256]
    assert stream_plan(136, 384, 256, 7168, 16) == 2  # a 17-token tree: <= 144 tiles x 2 x 2 >= 528 items
    assert stream_plan(8, 384, 256, 7168, 8) == 28  # one token: 8 tiles x 2 column blocks, every step a chunk
    assert stream_plan(136, 384, 7168, 256, 16) == 1  # down: 56 column blocks give the items
    assert stream_plan(8, 4, 256, 1024, 16, num_ctas=2) == 1  # 4 tiles x 2 blocks = 8 items for 2 CTAs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=32), "block_m must be one of"),
        (dict(chunks=3), "chunks must divide K's 2 steps"),
        (dict(stages=0), r"stages must be in \[1, "),
        (dict(stages=40), r"stages must be in \[1, "),
        (dict(num_ctas=0), "num_ctas must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul

    x, weight, sizes = _inputs("bad", [3, 5], 128, 512, "bfloat16")
    with pytest.raises(ValueError, match=message):
        streamed_int4_matmul(x, weight, sizes, **kwargs)


def test_bad_shapes():
    from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul

    x, weight, sizes = _inputs("shapes", [3, 5], 128, 256, "bfloat16")
    with pytest.raises(ValueError, match="x must be bfloat16"):
        streamed_int4_matmul(x.astype(jnp.float32), weight, sizes)
    with pytest.raises(ValueError, match="one entry per expert"):
        streamed_int4_matmul(x, weight, sizes[:1])
    # group sizes that do not tile the rows (NaN or shifted rows out) and a scale layout that does not match the
    # words (finite garbage out): named, as decode_matmul.grouped_matmul names them
    rows = x.shape[0]
    for bad in ([rows - 1, 0], [rows + 2, -2]):
        with pytest.raises(ValueError, match=f"group_sizes must be >= 0 and sum to the {rows} rows"):
            streamed_int4_matmul(x, weight, jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match="scale shape .* does not match the packed words"):
        streamed_int4_matmul(x, type(weight)(weight.packed, weight.scale[..., ::2]), sizes)
    with pytest.raises(ValueError, match="take an Int4Weight"):
        streamed_int4_matmul(x, weight.dequantize(jnp.bfloat16), sizes)
    _, narrow, _ = _inputs("narrow", [3, 5], 64, 256, "bfloat16")
    with pytest.raises(ValueError, match="N = 64 must be a multiple of 128"):
        streamed_int4_matmul(x, narrow, sizes)


@pytest.mark.parametrize(
    "rows, n, k, kwargs",
    [
        (136, 256, 7168, {}),  # the K2.6 TP8 shard's gate / up at a 17-token tree (default plan)
        (136, 7168, 256, {}),  # down
        (8, 256, 7168, dict(block_m=8)),  # one token: every step a chunk
        (520, 256, 7168, dict(scale_dtype=jnp.float32, stages=4)),  # 65 tokens, float32 scales
    ],
)
def test_lowers_for_gpu(rows, n, k, kwargs):
    """The compiled kernel lowers to Mosaic GPU for "cuda" on this CPU machine: the persistent item loop with
    traced bounds, the ring across items, the double-buffered output stores."""
    from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul
    from ddtree_kernels.quant import Int4Weight

    kwargs = dict(kwargs)
    scale_dtype = kwargs.pop("scale_dtype", jnp.bfloat16)
    experts, layers = 384, 2

    def call(x, packed, scale, sizes, layer):
        return streamed_int4_matmul(x, Int4Weight(packed, scale), sizes, layer=layer, interpret=False, **kwargs)

    args = (
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, experts, n, k // 8), jnp.int32),
        jax.ShapeDtypeStruct((layers, experts, n, k // 32), scale_dtype),
        jax.ShapeDtypeStruct((experts,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    assert "mosaic_gpu" in jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a Hopper GPU")


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, tokens, n, k, kwargs",
    [
        ("tp8_gate_tree_17", 17, 256, 7168, {}),
        ("tp8_down_tree_17", 17, 7168, 256, {}),
        ("tp8_gate_one_token", 1, 256, 7168, {}),  # block_m's default: 8 at 8 rows
        ("tp8_gate_one_token_bm16", 1, 256, 7168, dict(block_m=16)),  # TMA reads 16 rows of an 8-row x (zeros)
        ("tp8_down_one_token", 1, 7168, 256, {}),
        ("tp8_gate_tree_65_four_stages", 65, 256, 7168, dict(stages=4)),
        ("tp8_gate_tree_65", 65, 256, 7168, {}),  # the most stages that fit (float32 scales: ~11 KB to spare)
    ],
)
def test_compiled_on_gpu(name, tokens, n, k, kwargs):
    """The compiled kernel at the K2.6 TP8 shard's expert shapes (384 experts, tokens x top-8 drawn uniformly,
    stacked layers read in place) against the twin."""
    from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul, streamed_int4_matmul_reference

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    sizes = np.bincount(rng.integers(0, 384, tokens * 8), minlength=384)
    x, weight, group_sizes = _inputs(name, list(sizes), n, k, "bfloat16", layers=2)
    y = np.asarray(streamed_int4_matmul(x, weight, group_sizes, layer=1, **kwargs), np.float32)
    ref = np.asarray(streamed_int4_matmul_reference(x, weight, group_sizes, layer=1), np.float32)
    assert_close(y, ref, TOLERANCE)
