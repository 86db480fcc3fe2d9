"""The Mosaic GPU causal prefill attention (`ddtree_kernels.prefill_attention_mgpu`) against its XLA twin, in
Mosaic GPU interpret mode on the CPU.

Interpret mode runs a CTA's three warpgroups as threads that block inside host callbacks; with XLA's CPU
thread pool at its default size (the core count) two blocked warpgroups can starve the third on a 2-core
machine and the kernel hangs. The cases therefore run in a subprocess with a larger pool (NPROC=64, read
when the CPU client starts): one for the quick cases, one for the `slow` ones, both under the interpreter's
race detector (`detect_races`, jax private: `get_races`).

Every case poisons the cache past what its rows may read: K is NaN from start[b] + T on (the first
invisible key), V NaN from the next multiple of block_kv on (the first block never read) and a large
finite value between (read with weight 0). The kernel's output on the poisoned cache must be finite, equal
bit for bit to its output on the clean cache, and within TOLERANCE of the reference on the clean cache.
"""

import json
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.mosaic_interpret import run_in_subprocess, run_jitted

# name: (B, T, Hq, Hkv, Dk, Dv, S, starts, kwargs)
CASES = {
    # T = 100: not a multiple of 8 (padded) nor of the 128-query tile; rows at 0 and a non-multiple of the
    # block, 7 key blocks of the second row through 4 stages; GQA group 2
    "b2_gqa_ragged": (2, 100, 4, 2, 128, 128, 512, (0, 333), dict(block_kv=64)),
    # block_kv 128 (2 stages, steady state), group 2, T = 200: the last tile's second warpgroup has 8 rows
    "kv128_offset": (1, 200, 2, 1, 128, 128, 512, (131,), dict(block_kv=128)),
    # T = 5 < 8, one partial tile; a custom scale; one row at offset 0, one deep in the cache
    "short_chunk_scale": (2, 5, 2, 2, 128, 128, 256, (0, 200), dict(scale=0.3)),
    # T = 128, a whole tile; the start a multiple of the key block; group 4
    "tile_aligned_group4": (1, 128, 8, 2, 128, 128, 256, (64,), dict(block_kv=64)),
}
SLOW_CASES = {
    # expanded-MLA head dims (Dk 192 != Dv 128: separate output tile)
    "mla_dims": (2, 67, 2, 1, 192, 128, 320, (0, 150), dict(block_kv=64)),
    # a longer chunk deep in the cache: 3 query tiles, 10 key blocks through 2 stages
    "long_chunk": (1, 300, 2, 1, 128, 128, 1280, (961,), dict(block_kv=128)),
    # head dim 64
    "head_dim_64": (2, 70, 2, 2, 64, 64, 256, (5, 120), dict(block_kv=64)),
}
ALL_CASES = {**CASES, **SLOW_CASES}
TOLERANCE = 1e-2  # ||out - ref|| / ||ref||: bf16 outputs and probabilities (measured ~3e-3)


def inputs(name: str):
    """(q, k, v, start, poisoned k, poisoned v): fresh normal bf16 inputs, the cache poisoned as the module
    docstring says."""
    import jax

    batch, steps, q_heads, kv_heads, key_dim, value_dim, capacity, starts, kwargs = ALL_CASES[name]
    block_kv = kwargs.get("block_kv", 128)
    keys = jax.random.split(jax.random.key(zlib.crc32(name.encode())), 3)
    q = jax.random.normal(keys[0], (batch, steps, q_heads, key_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, capacity, kv_heads, key_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, capacity, kv_heads, value_dim), jnp.bfloat16)
    end = np.asarray(starts)[:, None] + steps  # [B, 1] first invisible key
    position = np.arange(capacity)[None, :]
    invisible = jnp.asarray(position >= end)[:, :, None, None]
    unread = jnp.asarray(position >= -(-end // block_kv) * block_kv)[:, :, None, None]
    k_poisoned = jnp.where(invisible, jnp.nan, k).astype(k.dtype)
    v_poisoned = jnp.where(unread, jnp.nan, jnp.where(invisible, 3e4, v)).astype(v.dtype)
    return q, k, v, jnp.asarray(starts, jnp.int32), k_poisoned, v_poisoned


def run_case(name: str) -> dict:
    from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention, causal_prefill_attention_reference

    q, k, v, start, k_poisoned, v_poisoned = inputs(name)
    kwargs = ALL_CASES[name][-1]
    out = np.asarray(run_jitted(causal_prefill_attention, q, k_poisoned, v_poisoned, start, **kwargs), np.float32)
    clean = np.asarray(run_jitted(causal_prefill_attention, q, k, v, start, **kwargs), np.float32)
    ref = np.asarray(causal_prefill_attention_reference(q, k, v, start, scale=kwargs.get("scale")), np.float32)
    return {
        "shape": list(out.shape),
        "rel_err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
        "finite": bool(np.isfinite(out).all()),
        "poison_free": bool(np.array_equal(out, clean)),
    }


def _main(names: str):  # the subprocess: the named cases under the race detector, one JSON line
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from ddtree_kernels import prefill_attention_mgpu

    prefill_attention_mgpu.INTERPRET_PARAMS = plgpu.InterpretGPUParams(detect_races=True)
    results = {name: run_case(name) for name in names.split(",")}
    results["races_found"] = bool(get_races().races_found)
    print(json.dumps(results))


def _run_subprocess(names) -> dict:
    return run_in_subprocess(f"from tests.kernels.test_prefill_attention_mgpu import _main; _main({','.join(names)!r})")


@pytest.fixture(scope="module")
def results():
    return _run_subprocess(CASES)


@pytest.fixture(scope="module")
def slow_results():
    return _run_subprocess(SLOW_CASES)


def check(name: str, result: dict) -> None:
    batch, steps, q_heads, _, _, value_dim, *_ = ALL_CASES[name]
    assert result["shape"] == [batch, steps, q_heads, value_dim]
    assert result["finite"], result
    assert result["poison_free"], result
    assert result["rel_err"] < TOLERANCE, result


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(results, name):
    check(name, results[name])


def test_no_shared_memory_races(results):
    """The interpreter's happens-before race detector saw no unordered shared-memory access (the K/V
    ring's reuse, the output written over the query tile, the schedule barrier's ping-pong)."""
    assert not results["races_found"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_matches_reference_slow(slow_results, name):
    check(name, slow_results[name])
    assert not slow_results["races_found"]


def test_reference_is_causal_with_offset():
    from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention_reference
    from ddtree_kernels.tree_attention import attention_reference

    q, k, v, start, *_ = inputs("short_chunk_scale")
    steps, capacity = q.shape[1], k.shape[1]
    mask = np.arange(capacity)[None, None, :] <= np.asarray(start)[:, None, None] + np.arange(steps)[None, :, None]
    expected = attention_reference(q, k, v, jnp.asarray(mask), scale=0.3)
    got = causal_prefill_attention_reference(q, k, v, start, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=(3, 2, 128)), r"q must be \[B, T, Hq, Dk\]"),
        (dict(k=(1, 128, 1, 64)), r"k must be \[B, S, Hkv, Dk\]"),
        (dict(v=(1, 64, 1, 128)), r"v must be \[B, S, Hkv, Dv\]"),
        (dict(q=(1, 3, 3, 128), k=(1, 128, 2, 128), v=(1, 128, 2, 128)), "Hq = 3 must be a multiple of Hkv = 2"),
        (dict(dtype=jnp.float16), "k must be bfloat16, got float16"),
        (dict(q=(1, 3, 2, 96), k=(1, 128, 1, 96)), r"Dk must be one of \(64, 128, 192, 256\), got 96"),
        (dict(v=(1, 128, 1, 256)), r"Dv must be one of \(64, 128\), got 256"),
        (dict(start=((2,), jnp.int32)), r"start must be an integer \[B\] = \(1,\), got int32\[2\]"),
        (dict(start=((1,), jnp.float32)), r"start must be an integer \[B\] = \(1,\), got float32\[1\]"),
        (dict(block_q=128), "block_q must be 64 .*, got 128"),
        (dict(scale=-1.0), "scale must be > 0, got -1.0"),
        (dict(block_kv=32), r"block_kv must be one of \(64, 128\), got 32"),
        (dict(k=(1, 192, 1, 128), v=(1, 192, 1, 128)), "S = 192 must be a multiple of block_kv = 128"),
        (dict(q=(1, 3, 2, 256), k=(1, 128, 1, 256)), "Dk = 256, Dv = 128 leave 1 K/V stage"),
        (dict(k=(1, 128, 0, 128), v=(1, 128, 0, 128)), "B, T, S and Hkv must be >= 1, got 1, 3, 128, 0"),
    ],
)
def test_rejects_bad_input(change, message):
    from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention

    shapes = dict(q=(1, 3, 2, 128), k=(1, 128, 1, 128), v=(1, 128, 1, 128))
    shapes.update({name: change[name] for name in shapes if name in change})
    arrays = {name: jnp.zeros(shape, jnp.bfloat16) for name, shape in shapes.items()}
    if "dtype" in change:
        arrays["k"] = arrays["k"].astype(change["dtype"])
    start_shape, start_dtype = change.get("start", ((1,), jnp.int32))
    kwargs = {name: change[name] for name in ("scale", "block_q", "block_kv") if name in change}
    with pytest.raises(ValueError, match=message):
        causal_prefill_attention(**arrays, start=jnp.zeros(start_shape, start_dtype), **kwargs)


@pytest.mark.parametrize("block_kv, key_dim, steps", [(128, 128, 2048), (128, 128, 5), (64, 128, 100), (64, 192, 2048)])
def test_lowers_for_gpu(block_kv, key_dim, steps):
    """The compiled kernel (not the interpreter) lowers to Mosaic GPU for "cuda" on this CPU machine: layout
    and lowering errors show up here, not first on the GPU (ptxas still runs only there)."""
    import jax

    from ddtree_kernels.prefill_attention_mgpu import causal_prefill_attention

    args = (
        jax.ShapeDtypeStruct((1, steps, 32, key_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 8192, 8, key_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    attend = jax.jit(
        lambda q, k, v, start: causal_prefill_attention(q, k, v, start, block_kv=block_kv, interpret=False)
    )
    assert "mosaic_gpu" in attend.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
