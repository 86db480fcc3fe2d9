"""The Pallas kernels lower for the Triton GPU backend, checked on a CPU-only machine.

Interpret mode (what the other kernel tests run) accepts every JAX primitive; Triton lowering does not
(e.g. reduce_or, tensors whose size is not a power of two). This test lowers each public kernel entry
for platform "cuda" with a stand-in for the GPU query (compute capability 9.0, the H200), so such
failures show up in CI, not first on the GPU. It reaches into jax._src (private); it skips if that
moves.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")

pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")  # no Triton lowering: nothing to test here


def spec(shape, dtype=jnp.float32):
    """An abstract array: lowering needs shapes only (the K2.6 expert stack would be 11 GB)."""
    return jax.ShapeDtypeStruct(shape, dtype)


KERNELS_BY_LAYOUT = {  # the pallas_call names of each layout of ddtree_kernels.tree_sampling
    "spans": (
        ("partial_stats", "search_count", "search_mass", "kept_mass", "walk_logits", "residual_logits", "final_logits"),
        ("walk_probs", "residual_probs", "final_probs"),
    ),
    "single": (("single_row_stats", "walk_logits", "final_single_logits"), ("walk_probs", "final_single_probs")),
}


@pytest.mark.parametrize("layout, vocab", [("spans", 163840), ("single", 8192)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tree_sampling_kernels_lower_for_triton(hopper, dtype, layout, vocab):
    from ddtree_kernels.tree_sampling import _from_logits_jit, _from_probs_jit

    batch, slots = 2, 17
    lists = (spec((batch, slots), jnp.int32),) * 3
    coins = (spec((batch, slots)), spec((batch,)))
    static = dict(max_accept=8, threshold_single=1.0, threshold_acc=1.0, interpret=False, layout=layout)
    from_logits, from_probs = KERNELS_BY_LAYOUT[layout]
    text = (
        _from_logits_jit.trace(
            *lists, spec((batch, slots, vocab), dtype), spec((batch, 4)), *coins, **static, skip_with_cond=True
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    for name in from_logits:
        assert f"tree_sampling_{name}" in text, name
    assert ("tree_sampling_partial_stats" in text) == (layout == "spans")
    text = (
        _from_probs_jit.trace(*lists, spec((batch, slots, vocab), jnp.float32), *coins, **static)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    for name in from_probs:
        assert f"tree_sampling_{name}" in text, name


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
def test_decode_matmul_lowers_for_triton(hopper, kind):
    from ddtree_kernels.decode_matmul import _matmul_2d
    from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight

    m, k, n = 17, 4096, 12288
    weight = {
        "dense": spec((n, k), jnp.bfloat16),
        "int4": Int4Weight(spec((n, k // 8), jnp.int32), spec((n, k // 32), jnp.bfloat16)),
        "fp8": Fp8BlockWeight(spec((n, k), jnp.float8_e4m3fn), spec((n // 128, k // 128), jnp.float32)),
    }[kind]
    text = (
        _matmul_2d.trace(spec((m, k), jnp.bfloat16), weight, interpret=False)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "decode_matmul" in text


@pytest.mark.parametrize("kind", ["dense", "int4", "fp8"])
def test_grouped_matmul_lowers_for_triton(hopper, kind):
    from ddtree_kernels.decode_matmul import GroupedTiles, _grouped_2d, default_grouped_tiles
    from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight

    experts, n, k = 384, 2048, 7168  # Kimi K2.6 experts
    layers = 60  # every MoE layer's experts stacked; the kernel reads one in place
    weight = {
        "dense": spec((layers, experts, n, k), jnp.bfloat16),
        "int4": Int4Weight(
            spec((layers, experts, n, k // 8), jnp.int32), spec((layers, experts, n, k // 32), jnp.bfloat16)
        ),
        "fp8": Fp8BlockWeight(
            spec((layers, experts, n, k), jnp.float8_e4m3fn), spec((layers, experts, n // 128, k // 128), jnp.float32)
        ),
    }[kind]
    tilings = [
        None
    ]  # the default for the call's size (`default_grouped_tiles(weight, rows)`: the prefill one at 16,384)
    if kind == "int4":  # the one-dot form (8 nibble planes side by side), at a prefill chunk's tiling too
        tilings += [GroupedTiles(one_dot=True), GroupedTiles(block_n=128, block_k=1024, num_warps=8, one_dot=True)]
    cases = [(weight, rows, tiles) for rows, tiles in itertools.product((8, 136, 16384), tilings)]
    if kind == "int4":  # one TP8 shard's gate / up [256, 7168] and down [7168, 256]: their own decode defaults
        cases += [
            (
                Int4Weight(
                    spec((layers, experts, n_, k_ // 8), jnp.int32), spec((layers, experts, n_, k_ // 32), jnp.bfloat16)
                ),
                rows,
                None,
            )
            for n_, k_ in ((256, 7168), (7168, 256))
            for rows in (72, 136, 520)
        ]
        gate = cases[-6][0]  # the shard's gate at 72 rows under the other dequantisation
        cases += [(gate, 72, dataclasses.replace(default_grouped_tiles(gate, 72), dequant="convert"))]
    for weight, rows, tiles in cases:  # one token (split-K), a tree, a prefill chunk
        tiles = tiles or default_grouped_tiles(weight, rows)
        text = (
            _grouped_2d.trace(
                spec((rows, weight.shape[-1]), jnp.bfloat16),
                weight,
                spec((experts,), jnp.int32),
                spec((), jnp.int32),
                interpret=False,
                tiles=tiles,
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert "grouped_matmul" in text
        if rows > 520:
            continue
        # the rows read in place through a row index (a MoE layer's rows / 8 tokens, each over its top-8 experts)
        text = (
            _grouped_2d.trace(
                spec((max(1, rows // 8), weight.shape[-1]), jnp.bfloat16),
                weight,
                spec((experts,), jnp.int32),
                spec((), jnp.int32),
                spec((rows,), jnp.int32),
                interpret=False,
                tiles=tiles,
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert "grouped_matmul_" in text and "_gathered" in text


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_tree_attention_lowers_for_triton(hopper, case):
    from ddtree_kernels.tree_attention import _tree_attention, block_rows, default_block_config

    batch, steps, q_heads, kv_heads, dims, dv = {
        "gqa": (8, 65, 32, 8, (128,), 128),  # Qwen3-8B, budget 64
        "mla": (1, 17, 64, 1, (512, 64), 512),
    }[case]  # K2.6 on one GPU
    capacity = 4096
    mla = case == "mla"  # values = the latent key part (v=None), as deepseek_v3 calls it
    q = tuple(spec((batch, steps, q_heads, d), jnp.bfloat16) for d in dims)
    k = tuple(spec((batch, capacity, kv_heads, d), jnp.bfloat16) for d in dims)
    v = None if mla else spec((batch, capacity, kv_heads, dv), jnp.bfloat16)
    config = default_block_config(block_rows(q_heads // kv_heads, steps), dims, dv)
    text = (
        _tree_attention.trace(
            q,
            k,
            v,
            spec((batch, steps, capacity), jnp.bool_),
            spec((batch,), jnp.int32),
            scale=0.1,
            config=config,
            interpret=False,
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "tree_attention" in text


@pytest.mark.parametrize("method", ["extract", "search", "resident"])
def test_tree_build_kernels_lower_for_triton(hopper, method):
    """Every top-K method and both selection kernels (`tree_select`, `tree_slots`) at the embedded pair's V."""
    from ddtree_kernels.tree_build import _tree_select_jit, _tree_slots_jit, _tree_topk_jit

    text = (
        _tree_topk_jit.trace(spec((15, 8192)), k=64, interpret=False, method=method)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "tree_topk" in text
    if method != "search":  # the fused log-softmax form from bf16 logits (no streamed form)
        text = (
            _tree_topk_jit.trace(spec((15, 8192), jnp.bfloat16), k=64, interpret=False, method=method, log_softmax=True)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert "tree_topk_logits" in text
    if method != "extract":
        return
    lp, ids = spec((2, 15, 64)), spec((2, 15, 64), jnp.int32)
    text = _tree_select_jit.trace(lp, budget=64, interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "tree_select" in text
    text = (
        _tree_slots_jit.trace(
            lp,
            ids,
            spec((2, 15), jnp.bool_),
            spec((2,), jnp.int32),
            spec((2,), jnp.bool_),
            budget=64,
            pads=(0, -1, 0, -1),
            interpret=False,
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "tree_slots" in text


@pytest.mark.parametrize("steps, heads, splits, stacked", [(1, 8, 66, True), (17, 8, 8, True), (65, 64, 2, False)])
def test_merge_up_lowers_for_triton(hopper, steps, heads, splits, stacked):
    """`head_projections.merge_up` at the K2.6 shapes it serves: the TP8 shard's 8 heads (AR, DDTree 16) reading the
    stacked kv_b_proj in place, 64 heads (one GPU) unstacked; the MLA kernel's padded rows."""
    from ddtree_kernels.head_projections import merge_up

    rows = steps * heads
    weight = spec(((61,) if stacked else ()) + (heads * 256, 512), jnp.bfloat16)
    text = (
        merge_up.trace(
            spec((1, splits, -(-rows // 8) * 8, 512), jnp.bfloat16),
            spec((1, splits, -(-rows // 64) * 64), jnp.float32),
            weight,
            spec((), jnp.int32) if stacked else None,
            rows=rows,
            heads=heads,
            offset=128,
            width=128,
            interpret=False,
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "merge_up" in text


@pytest.mark.parametrize("steps, heads, stacked", [(1, 8, True), (65, 64, False)])
def test_absorb_lowers_for_triton(hopper, steps, heads, stacked):
    """`head_projections.absorb` at K2.6's W_UK: q [B, T x H, 192] read at offset 0, width 128."""
    from ddtree_kernels.head_projections import absorb

    weight = spec(((61,) if stacked else ()) + (heads * 256, 512), jnp.bfloat16)
    text = (
        absorb.trace(
            spec((1, steps * heads, 192), jnp.bfloat16),
            weight,
            spec((), jnp.int32) if stacked else None,
            heads=heads,
            q_offset=0,
            width=128,
            w_offset=0,
            interpret=False,
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "absorb" in text
