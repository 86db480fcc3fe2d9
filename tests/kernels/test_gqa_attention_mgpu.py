"""The Mosaic GPU GQA tree attention (`ddtree_kernels.gqa_attention_mgpu`) against its XLA twin, in Mosaic
GPU interpret mode on the CPU, plus its plans, argument checks and a CPU lowering for "cuda".

Interpret mode runs a CTA's warpgroups as threads that block inside host callbacks (barrier waits); with
XLA's CPU thread pool at its default size (the core count) blocked warpgroups can starve the others on a
2-core machine and the kernel hangs. The cases therefore run in one subprocess with a larger pool
(NPROC=64, read when the CPU client starts), and each test checks its case's result.
"""

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.mosaic_interpret import compare, run_in_subprocess, run_jitted, tree_mask

# name: (B, T, Hq, Hkv, D, S, kv_lengths (None: visible_lengths(mask)), kwargs).
# Rows G * T = 68, 18, 4, 9, 17, 136, 132, 36: none a multiple of 64, 68 / 18 / 4 / 9 / 17 / 36 not of 8; 136
# and 132 take 3 row tiles (the second CTA's second warpgroup is all padding and only observes the blocks);
# S = 200 and 300 are padded to whole key blocks by the wrapper; ragged lengths with 0 and 1; a split of 6
# blocks (the pipeline's steady state, 4 stages); T = 33: two mask words. poison: the kernel's cache holds NaN
# from the first key block a row never reads (the reference sees the clean cache); dense: a random bool mask
# (each key visible to each query with probability 1/2, below kv_lengths) instead of a tree mask.
CASES = {
    "t17_g4_d128_splits": (2, 17, 8, 2, 128, 320, (300, 1), dict(num_splits=3, poison=True)),
    "t9_g2_d64_empty_row": (2, 9, 4, 2, 64, 200, (0, 190), dict(num_splits=2, poison=True)),
    "t1_g4_d128_decode": (2, 1, 8, 2, 128, 256, (256, 37), dict()),
    "t9_g1_d64_scale": (2, 9, 2, 2, 64, 192, (150, 40), dict(num_splits=2, scale=0.05)),
    "t17_g1_d128_one_split_dense": (2, 17, 4, 4, 128, 384, (383, 129), dict(num_splits=1, dense=True)),
    "t17_g8_d64_padding_wg": (1, 17, 8, 1, 64, 256, (250,), dict(num_splits=2)),
    "t33_g4_d64_two_words_bkv128": (1, 33, 4, 1, 64, 300, (290,), dict(block_kv=128, num_splits=2)),
    "t9_g4_d128_default_lengths": (2, 9, 8, 2, 128, 128, None, dict()),
}
TOLERANCE = 1e-2  # ||out - ref|| / ||ref||, bf16 outputs and probabilities (measured ~3e-3)
# the same over the worst row that sees a key (as the MLA kernel's test): a bug in a few rows (one query row's mask
# bits, one mask word) moves the global error only ~1.5-2x its bound
ROW_TOLERANCE = 3e-2


def run_case(name: str) -> dict:
    from ddtree_kernels.gqa_attention_mgpu import gqa_tree_attention, gqa_tree_attention_reference

    batch, steps, q_heads, kv_heads, head_dim, capacity, lengths, kwargs = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    q = jax.random.normal(keys[0], (batch, steps, q_heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, capacity, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, capacity, kv_heads, head_dim), jnp.bfloat16)
    if lengths is None:  # a ragged tree mask, the lengths left to the kernel's default
        mask = jnp.asarray(tree_mask(rng, steps, capacity, [capacity - 5, capacity // 2][:batch]))
        kv_lengths = None
    else:
        mask = tree_mask(rng, steps, capacity, lengths)
        if kwargs.get("dense"):
            mask = (rng.random(mask.shape) < 0.5) & (np.arange(capacity) < np.asarray(lengths)[:, None, None])
        mask = jnp.asarray(mask)
        kv_lengths = jnp.asarray(lengths, jnp.int32)
    kwargs = dict(kwargs)
    kwargs.pop("dense", None)
    k_in, v_in = k, v
    if kwargs.pop("poison", False):
        block_kv = kwargs.get("block_kv", 64)
        unread = -(-np.asarray(lengths) // block_kv) * block_kv  # [B] the first key never read
        poisoned = jnp.arange(capacity)[None, :, None, None] >= jnp.asarray(unread)[:, None, None, None]
        k_in, v_in = jnp.where(poisoned, jnp.nan, k), jnp.where(poisoned, jnp.nan, v)
    out = run_jitted(gqa_tree_attention, q, k_in, v_in, mask, kv_lengths=kv_lengths, **kwargs)
    scale = kwargs.get("scale")
    ref = gqa_tree_attention_reference(q, k, v, mask, scale=scale, kv_lengths=kv_lengths)
    return compare(out, ref, mask)


def _main():  # the subprocess: every case, one JSON line
    print(json.dumps({name: run_case(name) for name in CASES}))


@pytest.fixture(scope="module")
def results():
    return run_in_subprocess("from tests.kernels.test_gqa_attention_mgpu import _main; _main()")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(results, name):
    batch, steps, q_heads, _, head_dim, *_ = CASES[name]
    result = results[name]
    assert result["shape"] == [batch, steps, q_heads, head_dim]
    assert result["finite"]
    assert result["empty_rows_zero"], result
    assert result["rel_err"] < TOLERANCE and result["max_row_err"] < ROW_TOLERANCE, result


def test_cases_cover_the_brief():
    lengths = [length for case in CASES.values() if case[6] is not None for length in case[6]]
    assert 0 in lengths and 1 in lengths
    assert {case[1] for case in CASES.values()} >= {1, 9, 17}
    assert {case[2] // case[3] for case in CASES.values()} >= {1, 2, 4}
    assert {case[4] for case in CASES.values()} == {64, 128}
    assert any(case[1] * case[2] // case[3] % 8 for case in CASES.values())
    assert any(case[5] % case[7].get("block_kv", 64) for case in CASES.values())


def test_plans():
    from ddtree_kernels.gqa_attention_mgpu import row_plan, smem_plan, split_plan

    assert row_plan(4) == (1, 1) and row_plan(64) == (1, 1)
    assert row_plan(68) == (2, 1) and row_plan(260) == (2, 3)  # Qwen3-8B G = 4: T = 17 and 65
    # Qwen3-8B, B = 1: 8 KV heads x 1 row block x 15 splits = 120 CTAs; 1k context: >= 2 blocks a split
    assert split_plan(1, 8, 68, 8256, 64, None) == (15, 9)  # 16 asked, 129 blocks in runs of 9
    assert split_plan(1, 8, 68, 1088, 64, None) == (6, 3)  # 8 asked (17 blocks // 2), runs of 3
    assert split_plan(8, 8, 68, 8256, 64, None)[0] == 2
    assert split_plan(1, 8, 68, 8256, 64, 1) == (1, 129)
    assert split_plan(1, 2, 4, 128, 64, 100) == (2, 1)  # never more splits than key blocks
    stages, nbytes = smem_plan(128, 64, 2, 1, interpret=False)
    assert stages == 4 and nbytes == 2 * 64 * (256 + 12) + 4 * (2 * 64 * 256 + 256)
    assert smem_plan(128, 128, 2, 3, interpret=True)[0] >= 2


def test_split_ranges_deal_every_block_once():
    from ddtree_kernels.gqa_attention_mgpu import _split_range

    lengths = np.array([-3, 0, 1, 64, 65, 1000, 8257, 9000])
    for splits in (1, 3, 16):
        first, count = _split_range(
            jnp.asarray(lengths, jnp.int32)[:, None],
            jnp.arange(splits, dtype=jnp.int32)[None, :],
            splits=splits,
            block_kv=64,
            key_blocks=130,
        )
        first, count = np.asarray(first), np.asarray(count)
        for b, length in enumerate(lengths):
            blocks = np.concatenate([np.arange(f, f + c) for f, c in zip(first[b], count[b])])
            np.testing.assert_array_equal(blocks, np.arange(min(130, -(-max(length, 0) // 64))))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=(1, 3, 4)), "q must be"),
        (dict(k=(1, 40, 2, 128)), "k must be"),
        (dict(v=(1, 40, 2, 32)), "v must be"),
        (dict(q=(1, 3, 5, 64)), "Hq = 5 must be a multiple of Hkv = 2"),
        (dict(mask=(1, 3, 39)), "mask must be"),
        (dict(dtype=jnp.float32), "must be bfloat16, got float32"),
        (dict(q=(1, 3, 4, 256), k=(1, 40, 2, 256), v=(1, 40, 2, 256)), "head dim D must be one of .* got 256"),
        (dict(q=(1, 3, 4, 32), k=(1, 40, 2, 32), v=(1, 40, 2, 32)), "head dim D must be one of .* got 32"),
        (dict(block_kv=32), "block_kv must be one of .* got 32"),
        (dict(num_splits=0), "num_splits must be >= 1, got 0"),
        (dict(kv_lengths=(2,)), "kv_lengths must be"),
        # empty trees or caches were a division by zero or a zero-size reduction deep in the plan
        (dict(q=(1, 0, 4, 64), mask=(1, 0, 40)), "B, T and S must be >= 1, got B = 1, T = 0, S = 40"),
        (dict(k=(1, 0, 2, 64), v=(1, 0, 2, 64), mask=(1, 3, 0)), "B, T and S must be >= 1, got B = 1, T = 3, S = 0"),
    ],
)
def test_rejects_bad_arguments(change, message):
    from ddtree_kernels.gqa_attention_mgpu import gqa_tree_attention

    dtype = change.get("dtype", jnp.bfloat16)
    shapes = dict(q=(1, 3, 4, 64), k=(1, 40, 2, 64), v=(1, 40, 2, 64))
    shapes.update({name: shape for name, shape in change.items() if name in shapes})
    arrays = {name: jnp.zeros(shape, jnp.bfloat16 if name == "q" else dtype) for name, shape in shapes.items()}
    mask = jnp.ones(change.get("mask", (1, 3, 40)), bool)
    kwargs = {name: change[name] for name in ("block_kv", "num_splits") if name in change}
    if "kv_lengths" in change:
        kwargs["kv_lengths"] = jnp.zeros(change["kv_lengths"], jnp.int32)
    with pytest.raises(ValueError, match=message):
        gqa_tree_attention(**arrays, mask=mask, **kwargs)


@pytest.mark.parametrize(
    "batch, steps, q_heads, kv_heads, head_dim, capacity, kwargs",
    [
        (1, 17, 32, 8, 128, 8192, {}),  # Qwen3-8B, N = 17: 68 rows, 2 compute warpgroups
        (1, 65, 32, 8, 128, 8192, {}),  # N = 65: 260 rows, 3 CTAs, the last one's second warpgroup padding
        (8, 17, 32, 8, 128, 8192, {}),
        (1, 1, 32, 8, 128, 8192, {}),  # decode: 4 rows, one compute warpgroup
        (2, 65, 4, 2, 64, 512, {}),  # the embedded pair
        (2, 7, 6, 2, 64, 300, {}),  # odd: T 7, G 3, rows 21; S padded to whole blocks
        (1, 40, 8, 8, 128, 1024, dict(block_kv=128, num_splits=3)),  # two mask words, 3 stages
    ],
)
def test_lowers_for_gpu(batch, steps, q_heads, kv_heads, head_dim, capacity, kwargs):
    """The compiled kernel (not the interpreter) lowers to Mosaic GPU for "cuda" on this CPU machine, TMA
    tiling and the wgmma shapes included (block_kv = 32 fails here: the value wgmma's K, the keys, must be a
    multiple of 64 at a 128-byte swizzle)."""
    from ddtree_kernels.gqa_attention_mgpu import gqa_tree_attention

    args = (
        jax.ShapeDtypeStruct((batch, steps, q_heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, capacity, kv_heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, capacity, kv_heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, steps, capacity), jnp.bool_),
    )
    attend = jax.jit(lambda *a: gqa_tree_attention(*a, interpret=False, **kwargs))
    assert "mosaic_gpu" in attend.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_split_range_of_a_length_near_the_int32_limit_is_the_whole_cache():
    """A traced kv_length near 2^31 overflowed the rounding add: a negative block count, no key read, zeros out."""
    from ddtree_kernels.gqa_attention_mgpu import _split_range

    for length in (2**31 - 1, 2**31 - 64, 10**9, 256):
        first, count = _split_range(jnp.int32(length), jnp.int32(0), splits=1, block_kv=64, key_blocks=4)
        assert (int(first), int(count)) == (0, 4), length
    assert [int(c) for c in _split_range(jnp.int32(-3), jnp.int32(0), splits=1, block_kv=64, key_blocks=4)] == [0, 0]
    halves = [_split_range(jnp.int32(2**31 - 1), jnp.int32(s), splits=2, block_kv=64, key_blocks=4) for s in (0, 1)]
    assert [(int(f), int(c)) for f, c in halves] == [(0, 2), (2, 2)]
