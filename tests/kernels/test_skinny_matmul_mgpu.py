"""The Mosaic GPU skinny matmul (`ddtree_kernels.skinny_matmul_mgpu`) against its XLA twin in Mosaic GPU
interpret mode on the CPU (fresh random bf16 inputs), its plans, argument checks, a CPU lowering for "cuda",
the benchmark's CPU smoke mode, and (on a GPU only) the compiled kernel on the Qwen3-8B shapes.

Interpret mode runs a CTA's warpgroups as threads that block inside host callbacks; on a 2-core machine XLA's
CPU pool can starve them, so the interpreted cases run in one subprocess with NPROC=64 (`mosaic_interpret`).
"""

import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.mosaic_interpret import assert_close, run_in_subprocess, run_jitted

# name: (M, N, K, kwargs). Rows 1 / 17 / 65 / 33 / 130 are not multiples of 8 (padded to M_pad); the ring runs
# its steady state (8 K steps of a split through 2 slots), has more slots than K steps, a single K step per
# split; block_n 64 (one compute warpgroup), 128 (two) and 256 (two of 128 rows); M = 256, the most rows.
CASES = {
    "m1_default": (1, 128, 256, {}),
    "m17_splits2": (17, 128, 512, dict(splits=2)),
    "m65_default": (65, 256, 256, {}),
    "m65_bn64": (65, 256, 256, dict(block_n=64)),
    "m33_bn256": (33, 256, 512, dict(block_n=256, block_k=128)),
    "m8_more_stages_than_steps": (8, 128, 256, dict(block_k=64, stages=6)),
    "m16_steady_ring_splits": (16, 128, 1024, dict(block_k=64, stages=2, splits=2)),
    "m24_one_step_splits": (24, 128, 512, dict(block_k=128, splits=4)),
    "m130_rows": (130, 128, 256, {}),
    "m256_max": (256, 64, 128, dict(block_n=64, block_k=64)),
    # stacked weights [L, N, K] read at `layer` in place (layers: L, a test-only key): a middle layer, the last
    # by a negative index (as lax.dynamic_index_in_dim reads it), with K splits
    "m1_stacked_layer1": (1, 128, 256, dict(layers=3, layer=1)),
    "m17_stacked_last_splits2": (17, 128, 512, dict(layers=4, layer=-1, splits=2)),
    # past the last layer: clamped to it inside the kernel (as lax.dynamic_index_in_dim clamps)
    "m9_stacked_past_end": (9, 128, 256, dict(layers=2, layer=7)),
}
TOLERANCE = 1e-2  # max |y - ref| / max |ref| and ||y - ref|| / ||ref||: bf16 output rounding (measured <= 4e-3)


def _inputs(name: str, m: int, n: int, k: int, layers: int | None = None):
    """x bf16 [M, K] and w bf16 [N, K] (every layer different, [L, N, K], with layers)."""
    seed = zlib.crc32(name.encode())
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w_shape = (n, k) if layers is None else (layers, n, k)
    w = (jax.random.normal(kw, w_shape, jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    return x, w


def run_case(name: str, interpret: bool = True) -> dict:
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul, skinny_matmul_reference

    m, n, k, kwargs = CASES[name]
    kwargs = dict(kwargs)
    x, w = _inputs(name, m, n, k, kwargs.pop("layers", None))
    out = run_jitted(skinny_matmul, x, w, interpret=interpret, **kwargs)
    y = np.asarray(out, np.float32)
    ref = np.asarray(skinny_matmul_reference(x, w, layer=kwargs.get("layer")), np.float32)
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
    return run_in_subprocess("from tests.kernels.test_skinny_matmul_mgpu import _main; _main()")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(results, name):
    m, n, *_ = CASES[name]
    result = results[name]
    assert result["shape"] == [m, n] and result["dtype"] == "bfloat16"
    assert result["finite"]
    assert result["max_err"] < TOLERANCE and result["rel_err"] < TOLERANCE, result


def test_cases_cover_the_brief():
    from ddtree_kernels.skinny_matmul_mgpu import plan

    kwargs = [case[3] for case in CASES.values()]
    assert any(kw.get("splits", 1) > 1 for kw in kwargs)
    assert {kw.get("block_n", 128) for kw in kwargs} == {64, 128, 256}
    assert any(kw.get("stages", 0) > case[2] // kw.get("block_k", 128) for case, kw in zip(CASES.values(), kwargs))
    assert any(case[0] % 8 for case in CASES.values())
    # the default plans of the small cases
    assert plan(1, 128, 256) == (128, 128, 2, 1)
    assert plan(65, 256, 256)[0] in (64, 128)


QWEN3_8B = {"qo_proj": (4096, 4096), "kv_proj": (1024, 4096), "gate_up": (12288, 4096), "down": (4096, 12288)}
QWEN3_8B["lm_head"] = (151936, 4096)
ROWS = (1, 8, 16, 17, 33, 65, 128)


@pytest.mark.parametrize("weight", list(QWEN3_8B))
@pytest.mark.parametrize("m", ROWS)
def test_plan_divides_and_fits(weight, m):
    from ddtree_kernels.skinny_matmul_mgpu import (
        BLOCK_KS,
        BLOCK_NS,
        MAX_ACC_ELEMENTS,
        SMEM_BUDGET,
        compute_wgs,
        padded_rows,
        plan,
        smem_bytes,
    )
    from ddtree_kernels.tiling import SMEM_LIMIT_BYTES

    n, k = QWEN3_8B[weight]
    block_n, block_k, stages, splits = plan(m, n, k)
    assert block_n in BLOCK_NS and block_k in BLOCK_KS
    assert n % block_n == 0 and k % (block_k * splits) == 0
    assert 1 <= stages <= k // (block_k * splits)
    assert smem_bytes(m, block_n, block_k, stages, splits) <= SMEM_BUDGET < SMEM_LIMIT_BYTES - 4096
    assert (block_n // compute_wgs(block_n)) * padded_rows(m) <= MAX_ACC_ELEMENTS
    assert stages >= 2 or k // (block_k * splits) == 1  # a pipeline, unless the split is one K step


def test_plan_qwen3_defaults():
    """The tilings the H200 sweep measured fastest (`estimate_seconds` is fitted to it)."""
    from ddtree_kernels.skinny_matmul_mgpu import plan

    assert plan(65, 4096, 4096) == (64, 128, 5, 1)  # q/o: 64 stripes, no split-K sum (15.1 us)
    assert plan(128, 4096, 4096) == (64, 128, 4, 2)  # 64 CTAs would be wgmma-bound (14.2 us)
    assert plan(65, 12288, 4096) == (128, 128, 4, 1)  # gate/up: 96 stripes (30.3 us)
    assert plan(17, 151936, 4096)[::3] == (128, 1)  # the LM head: 1187 stripes
    assert plan(65, 4096, 12288)[::3] == (64, 2)  # down


# (M, N, K, block_n, block_k, stages, splits): device us measured on the H200 (the first sweep)
MEASURED_US = {
    (65, 4096, 4096, 64, 128, 5, 1): 15.1,
    (65, 4096, 4096, 128, 128, 4, 2): 16.1,
    (65, 4096, 4096, 128, 64, 8, 4): 17.0,
    (65, 4096, 4096, 128, 128, 4, 1): 18.1,
    (65, 4096, 4096, 64, 128, 4, 8): 23.4,
    (128, 4096, 4096, 64, 128, 4, 2): 14.2,
    (128, 4096, 4096, 64, 128, 4, 1): 22.2,
    (65, 12288, 4096, 128, 128, 4, 1): 30.3,
    (65, 12288, 4096, 64, 128, 5, 1): 34.8,
    (65, 12288, 4096, 128, 128, 4, 2): 41.4,
    (1, 151936, 4096, 128, 128, 5, 1): 274.6,
    (65, 4096, 12288, 128, 64, 8, 4): 36.2,
}


def test_cost_model_tracks_the_sweep():
    from ddtree_kernels.skinny_matmul_mgpu import estimate_seconds

    for config, us in MEASURED_US.items():
        model = estimate_seconds(*config) * 1e6
        assert 0.5 < model / us < 1.5, (config, model, us)
    # the measured fastest q/o (M = 65, 128) and gate/up tilings are the modelled fastest of the measured ones
    for shape in ((65, 4096, 4096), (128, 4096, 4096), (65, 12288, 4096)):
        points = sorted((us, c) for c, us in MEASURED_US.items() if c[:3] == shape)
        modelled = [estimate_seconds(*c) for _, c in points]
        assert modelled[0] <= 1.03 * min(modelled), shape


def _zeros(shape, dtype=jnp.bfloat16):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype, kwargs, message",
    [
        ((4,), (128, 4), None, {}, r"x must be 2-D \[M, K\], got shape \(4,\)"),
        ((1, 128), (2, 128, 128), None, {}, r"w must be 2-D \[N, K\] \(stacked .* take layer=\), got shape \(2, 128"),
        ((1, 128), (128, 128), None, dict(layer=0), r"with layer= w must be every layer's weights \[L, N, K\]"),
        (
            (1, 128),
            (2, 128, 128),
            None,
            dict(layer=jnp.zeros(2, jnp.int32)),
            r"layer must be a scalar, got shape \(2,\)",
        ),
        ((1, 128), (2, 128, 128), None, dict(layer=1.0), "layer must be an integer, got float"),
        ((1, 128), (128, 128), "x", {}, "x must be bfloat16, got float32"),
        ((1, 128), (128, 128), "w", {}, "w must be bfloat16, got float32"),
        ((1, 128), (128, 256), None, {}, r"x has K = 128 but w \[N, K\] has K = 256"),
        ((0, 128), (128, 128), None, {}, r"M \(x rows\) must be in 1 .. 256, got 0"),
        ((257, 128), (128, 128), None, {}, r"M \(x rows\) must be in 1 .. 256, got 257"),
        ((1, 128), (128, 128), None, dict(block_n=96), r"block_n must be one of \(64, 128, 256\), got 96"),
        ((1, 128), (128, 128), None, dict(block_k=32), r"block_k must be one of \(64, 128, 256\), got 32"),
        ((1, 128), (128, 128), None, dict(splits=0), "splits must be >= 1, got 0"),
        ((1, 128), (128, 128), None, dict(stages=0), "stages must be >= 1, got 0"),
        ((1, 128), (192, 128), None, dict(block_n=128), "N = 192 must be a multiple of block_n = 128"),
        ((1, 320), (128, 320), None, dict(block_k=128), r"K = 320 must be a multiple of block_k x splits = 128 x 1"),
        ((1, 256), (128, 256), None, dict(block_k=128, splits=3), "K = 256 must be a multiple of block_k x splits"),
        ((200, 128), (256, 128), None, dict(block_n=256), "block_n = 256 at M = 200 needs 128 x 200 accumulators"),
        ((65, 512), (256, 512), None, dict(block_n=256, block_k=256, stages=2), "stages = 2 .* shared memory"),
    ],
)
def test_rejects_bad_arguments(x_shape, w_shape, dtype, kwargs, message):
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul

    x = _zeros(x_shape, jnp.float32 if dtype == "x" else jnp.bfloat16)
    w = _zeros(w_shape, jnp.float32 if dtype == "w" else jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        skinny_matmul(x, w, **kwargs)


@pytest.mark.parametrize(
    "m, n, k, kwargs",
    [
        (65, 4096, 4096, {}),  # q/o proj at the DDTree verify width: 64 stripes of 64 rows, one split
        (1, 12288, 4096, {}),  # gate/up at decode: one split, M_pad 8 (wgmma N = 8)
        (128, 4096, 12288, {}),  # down at 128 rows: 3 splits
        (17, 1024, 4096, {}),  # k/v proj: 4 splits
        (65, 4096, 4096, dict(block_n=128, block_k=64, stages=8, splits=4)),  # the first plan: f32 partials
        (33, 151936, 4096, {}),  # the LM head: 1187 stripes
        (65, 4096, 4096, dict(block_n=64, block_k=128, stages=4, splits=2)),  # one compute warpgroup
        (65, 4096, 4096, dict(block_n=256, block_k=128, stages=2, splits=8)),  # two warpgroups of 128 rows
        (256, 4096, 4096, {}),  # the most rows
    ],
)
def test_lowers_for_gpu(m, n, k, kwargs):
    """The compiled kernel (not the interpreter) lowers to Mosaic GPU for "cuda" on this CPU machine: TMA
    boxes, the transposed wgmma B operand of M_pad columns, the transposed output store, the smem union."""
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16))
    matmul = jax.jit(lambda x, w: skinny_matmul(x, w, interpret=False, **kwargs))
    assert "mosaic_gpu" in matmul.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_stacked_layer_lowers_for_gpu_under_a_scan():
    """A layer scan's traced counter reaches the kernel as the TMA's layer index: the stacked weights are one
    operand of the Mosaic call (no slice of them in the program)."""
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul

    def scan(x, w):
        def step(h, layer):
            return skinny_matmul(h, w, layer=layer, interpret=False), None

        return jax.lax.scan(step, x, jnp.arange(w.shape[0], dtype=jnp.int32))[0]

    args = (jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), jax.ShapeDtypeStruct((3, 256, 256), jnp.bfloat16))
    text = jax.jit(scan).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    slices = [line for line in text.splitlines() if ("slice %" in line or "gather" in line) and "3x256x256" in line]
    assert not slices, slices


def test_benchmark_small_runs(tmp_path):
    """benchmarks/bench_skinny_mgpu.py --small (tiny shapes, interpret mode) runs end to end and writes its JSON."""
    out = run_in_subprocess(
        "import json, sys\n"
        "from benchmarks import bench_skinny_mgpu as b\n"
        f"code = b.main(['--small', '--commit', 'test', '--out', {str(tmp_path)!r}])\n"
        f"rows = json.load(open({os.path.join(str(tmp_path), 'skinny_mgpu_test_small.json')!r}))['rows']\n"
        f"stacked_code = b.main(['--small', '--stacked', '2', '--commit', 'test', '--out', {str(tmp_path)!r}])\n"
        f"stacked = json.load(open({os.path.join(str(tmp_path), 'skinny_mgpu_test_small_stacked2.json')!r}))['rows']\n"
        "print(json.dumps({'code': code, 'rows': rows, 'stacked_code': stacked_code, 'stacked': stacked}))"
    )
    assert out["code"] == 0 and out["stacked_code"] == 0
    assert len(out["rows"]) == 4 and len(out["stacked"]) == 4
    for row in out["rows"] + out["stacked"]:
        assert row["mgpu_max_err"] < TOLERANCE and row["xla_max_err"] < TOLERANCE, row
        assert row["mgpu_us"] > 0 and row["xla_us"] > 0 and "mgpu_error" not in row
    assert {row["stacked_layers"] for row in out["stacked"]} == {2}


requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a Hopper GPU")


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("weight", list(QWEN3_8B))
@pytest.mark.parametrize("m", (1, 17, 65, 128))
def test_compiled_on_gpu(weight, m):
    """The compiled kernel at its default plan on the Qwen3-8B shapes, against the XLA twin."""
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul, skinny_matmul_reference

    n, k = QWEN3_8B[weight]
    x, w = _inputs(f"{weight}{m}", m, n, k)
    y = np.asarray(skinny_matmul(x, w), np.float32)
    ref = np.asarray(skinny_matmul_reference(x, w), np.float32)
    assert y.shape == (m, n)
    assert_close(y, ref, TOLERANCE)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", [name for name in CASES if "stacked" in name])
def test_compiled_stacked_cases_on_gpu(name):
    result = run_case(name, interpret=False)
    assert result["finite"] and result["max_err"] < TOLERANCE and result["rel_err"] < TOLERANCE, result


# the K2.6 TP8 shard's dense projections the layer scan reads in place (`dispatch.IN_PLACE_PROJECTIONS`): N, K
K26_SHARD_PROJECTIONS = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (1536, 1536),
    "o_proj": (7168, 1024),
    "shared_gate_up": (256, 7168),
    "shared_down": (7168, 256),
    "dense_gate_up": (2304, 7168),
    "dense_down": (7168, 2304),
}


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("weight", list(K26_SHARD_PROJECTIONS))
def test_compiled_k26_shard_projections_stacked_on_gpu(weight):
    """Each projection the shard reads in place, stacked (3 layers), at 17 rows and the last layer, on the GPU."""
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul, skinny_matmul_reference

    n, k = K26_SHARD_PROJECTIONS[weight]
    x, w = _inputs(f"k26_{weight}", 17, n, k, layers=3)
    y = np.asarray(skinny_matmul(x, w, layer=2), np.float32)
    assert y.shape == (17, n)
    assert_close(y, np.asarray(skinny_matmul_reference(x, w, layer=2), np.float32), TOLERANCE)


@pytest.mark.parametrize("weight", list(K26_SHARD_PROJECTIONS))
def test_k26_shard_projections_stacked_lower_for_gpu(weight):
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul

    n, k = K26_SHARD_PROJECTIONS[weight]
    args = (jax.ShapeDtypeStruct((17, k), jnp.bfloat16), jax.ShapeDtypeStruct((3, n, k), jnp.bfloat16))
    matmul = jax.jit(lambda x, w: skinny_matmul(x, w, layer=jnp.int32(1), interpret=False))
    assert "mosaic_gpu" in matmul.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 17, 65))
def test_compiled_k26_q_a_proj_in_a_layer_scan_on_gpu(m):
    """K2.6's q_a_proj (1,536 x 7,168, every layer stacked) at the scan's traced layer, against the twin."""
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul, skinny_matmul_reference

    x, w = _inputs(f"q_a{m}", m, 1536, 7168, layers=3)

    def scan(matmul):
        def step(_, layer):
            return None, matmul(x, w, layer=layer)

        return jax.jit(lambda: jax.lax.scan(step, None, jnp.arange(3, dtype=jnp.int32))[1])()

    y, ref = np.asarray(scan(skinny_matmul), np.float32), np.asarray(scan(skinny_matmul_reference), np.float32)
    assert y.shape == (3, m, 1536)
    for layer in range(3):
        assert_close(y[layer], ref[layer], TOLERANCE)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, kwargs",
    [
        (65, dict(block_n=64, block_k=128, stages=4, splits=2)),
        (33, dict(block_n=256, block_k=128, stages=2, splits=8)),
        (8, dict(block_n=128, block_k=64, stages=8, splits=1)),
        (200, {}),
    ],
)
def test_compiled_tilings_on_gpu(m, kwargs):
    from ddtree_kernels.skinny_matmul_mgpu import skinny_matmul, skinny_matmul_reference

    x, w = _inputs(f"tiling{m}", m, 4096, 4096)
    y = np.asarray(skinny_matmul(x, w, **kwargs), np.float32)
    ref = np.asarray(skinny_matmul_reference(x, w), np.float32)
    assert np.abs(y - ref).max() / np.abs(ref).max() < TOLERANCE
