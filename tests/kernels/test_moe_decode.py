"""kernels/moe_decode.py (interpret mode on CPU) against its reference twins on fresh random INT4 experts (and raw
random words: every code in every nibble): bf16 / f32 activations, one and several tokens, repeated experts
(across tokens and within one token's choice: the router never repeats one, the kernels must not care),
unsorted assignments and a token with none,
several column blocks, K steps and K splits, edges that are not multiples of the tiles, the layer-stacked
form at a traced layer, the models' "gather" path, the errors; and the Triton lowering at Kimi K2.6 shapes.

Tolerances (max |err| / max |ref|): float32 1e-5 (float32 sums in another order); bf16 8e-3 (the outputs'
bf16 rounding, 2^-8 of an element at most; the inputs and dequantised weights are exact in float32 in both)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_kernels.moe_decode import (
    MAX_ASSIGNMENTS,
    DecodeTiles,
    flat_assignments,
    gate_up_plan,
    moe_decode,
    moe_decode_down,
    moe_decode_down_reference,
    moe_decode_gate_up,
    moe_decode_gate_up_reference,
    moe_decode_reference,
)
from ddtree_kernels.quant import Int4Weight, quantize_int4

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}
E, H, I, TOP_K = 16, 256, 64, 4
SPLIT = DecodeTiles(block_n=32, block_k=64, splits=2)  # 2 column tiles, 4 K steps in 2 splits (f32 partials)
FUSED = DecodeTiles(block_n=32, block_k=64, splits=1)  # silu in the kernel
DOWN = DecodeTiles(block_n=32, block_k=32, splits=1)  # 8 column tiles, 2 K steps per assignment


def experts_of(rng, e, h, i, layers=None):
    lead = (e,) if layers is None else (layers, e)

    def make(shape):
        q = quantize_int4((rng.standard_normal(lead + shape) * 0.1).astype(np.float32))
        return Int4Weight(q.packed, q.scale.astype(jnp.bfloat16))  # bf16 scales, as K2.6 stores them

    return make((i, h)), make((i, h)), make((h, i))


def routing(rng, tokens, e=E, top_k=TOP_K):
    """Assignments with repeats: expert 3 for every token, and twice in token 0's choice; shuffled order."""
    experts = rng.integers(0, e, (tokens, top_k))
    experts[:, 0] = 3
    experts[0, 1] = 3
    flat, toks, weights = flat_assignments(jnp.asarray(experts), jnp.asarray(rng.random((tokens, top_k)) + 0.1))
    order = rng.permutation(flat.shape[0])
    return flat[order], toks[order], weights[order]


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape and np.isfinite(got).all()
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("tiles", [SPLIT, FUSED], ids=["split", "fused"])
def test_gate_up_matches_the_reference(dtype, tokens, tiles):
    rng = np.random.default_rng(tokens * 10 + tiles.splits)
    gate, up, _ = experts_of(rng, E, H, I)
    experts, toks, _ = routing(rng, tokens)
    x = jnp.asarray(rng.standard_normal((tokens, H)), dtype)
    got = moe_decode_gate_up(x, gate, up, experts, toks, tiles=tiles)
    assert got.shape == (tokens * TOP_K, I) and got.dtype == dtype
    assert rel_err(got, moe_decode_gate_up_reference(x, gate, up, experts, toks)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_down_matches_the_reference(dtype, tokens):
    rng = np.random.default_rng(tokens)
    _, _, down = experts_of(rng, E, H, I)
    experts, toks, weights = routing(rng, tokens)
    if tokens == 3:  # token 1 gets no assignment: its row is 0
        toks = jnp.where(toks == 1, 2, toks)
    act = jnp.asarray(rng.standard_normal((experts.shape[0], I)), dtype)
    got = moe_decode_down(act, down, experts, toks, weights, tokens, tiles=DOWN)
    ref = moe_decode_down_reference(act, down, experts, toks, weights, tokens)
    assert got.shape == (tokens, H) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    if tokens == 3:
        assert not np.asarray(got[1]).any()


def test_the_routed_part_matches_the_twin_and_the_models_gather_path():
    """moe_decode (default tiles) = moe_decode_reference = ddtree_jax.models.moe.routed_gather's result."""
    from ddtree_jax.models.moe import routed_gather

    rng = np.random.default_rng(5)
    tokens = 2
    gate, up, down = experts_of(rng, E, H, I)
    chosen = jnp.asarray(np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(tokens)]), jnp.int32)
    route_weights = jnp.asarray(rng.random((tokens, TOP_K)), jnp.float32)
    experts, toks, weights = flat_assignments(chosen, route_weights)
    x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
    got = moe_decode(x, gate, up, down, experts, toks, weights)
    assert rel_err(got, moe_decode_reference(x, gate, up, down, experts, toks, weights)) < TOL[jnp.float32]
    p = {"expert_gate": gate, "expert_up": up, "expert_down": down}
    assert rel_err(got, routed_gather(p, x, chosen, route_weights)) < 1e-4


def test_every_code_in_every_nibble():
    """Raw random words: all 16 codes in each of the 8 nibbles (quantize_int4 never makes code 0), negative
    words (nibble 7 >= 8: the arithmetic shift), random group scales."""
    rng = np.random.default_rng(19)

    def raw(n, k):
        packed = rng.integers(-(2**31), 2**31, (E, n, k // 8), dtype=np.int64).astype(np.int32)
        return Int4Weight(jnp.asarray(packed), jnp.asarray(rng.uniform(0.5, 1.5, (E, n, k // 32)), jnp.float32))

    gate, up, down = raw(I, H), raw(I, H), raw(H, I)
    codes = (np.asarray(gate.packed)[..., None] >> (4 * np.arange(8))) & 0xF
    assert all(len(np.unique(codes[..., j])) == 16 for j in range(8))
    experts, toks, weights = routing(rng, 2)
    x = jnp.asarray(rng.standard_normal((2, H)) * 0.01, jnp.float32)
    got = moe_decode(x, gate, up, down, experts, toks, weights, gate_up_tiles=SPLIT, down_tiles=DOWN)
    assert rel_err(got, moe_decode_reference(x, gate, up, down, experts, toks, weights)) < TOL[jnp.float32]


def test_edges_that_are_not_multiples_of_the_tiles():
    """H = 352 (44 words: the last K step of gate / up half empty), I = 96 (down: 12 words in 16-word steps;
    gate / up: 96 columns in 64-wide tiles), T = 3 (4 accumulator rows)."""
    rng = np.random.default_rng(7)
    h, i, tokens = 352, 96, 3
    gate, up, down = experts_of(rng, E, h, i)
    experts, toks, weights = routing(rng, tokens)
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    tiles = DecodeTiles(block_n=64, block_k=128, splits=2)
    act = moe_decode_gate_up(x, gate, up, experts, toks, tiles=tiles)
    assert rel_err(act, moe_decode_gate_up_reference(x, gate, up, experts, toks)) < TOL[jnp.float32]
    out = moe_decode_down(act, down, experts, toks, weights, tokens, tiles=DecodeTiles(block_n=64, block_k=128))
    assert rel_err(out, moe_decode_down_reference(act, down, experts, toks, weights, tokens)) < TOL[jnp.float32]


def test_the_layer_stacked_form_reads_the_traced_layer():
    rng = np.random.default_rng(11)
    layers, tokens = 3, 2
    gate, up, down = experts_of(rng, E, H, I, layers=layers)
    experts, toks, weights = routing(rng, tokens)
    x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.bfloat16)
    run = jax.jit(lambda layer: moe_decode(x, gate, up, down, experts, toks, weights, layer, gate_up_tiles=SPLIT))
    got = run(jnp.int32(1))
    ref = moe_decode_reference(x, gate, up, down, experts, toks, weights, layer=1)
    assert rel_err(got, ref) < TOL[jnp.bfloat16]
    one = [jax.tree.map(lambda a: a[1], w) for w in (gate, up, down)]
    flat = moe_decode(x, *one, experts, toks, weights, gate_up_tiles=SPLIT)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(flat, np.float32))
    assert rel_err(run(jnp.int32(2)), ref) > 0.1  # another layer is another result
    # out of range, kernel and twin agree: the layer read as lax.dynamic_index_in_dim reads it (-1: the last;
    # past the end: the last), expert and token ids clamped (the kernel read layer 0 for -1, the twin wrapped ids)
    last = moe_decode_reference(x, gate, up, down, experts, toks, weights, layer=2)
    for layer in (-1, 7):
        assert rel_err(run(jnp.int32(layer)), last) < TOL[jnp.bfloat16]
        assert rel_err(moe_decode_reference(x, gate, up, down, experts, toks, weights, layer=layer), last) == 0
    wild_experts = experts.at[0].set(-1).at[1].set(E + 5)
    wild_tokens = toks.at[2].set(tokens + 3)
    got = moe_decode(x, gate, up, down, wild_experts, wild_tokens, weights, jnp.int32(1), gate_up_tiles=SPLIT)
    want = moe_decode_reference(x, gate, up, down, wild_experts, wild_tokens, weights, layer=1)
    assert rel_err(got, want) < TOL[jnp.bfloat16]


def test_a_wrong_expert_is_caught():
    """The comparison can fail: the kernel at other expert ids disagrees with the twin."""
    rng = np.random.default_rng(13)
    gate, up, _ = experts_of(rng, E, H, I)
    experts, toks, _ = routing(rng, 1)
    x = jnp.asarray(rng.standard_normal((1, H)), jnp.float32)
    got = moe_decode_gate_up(x, gate, up, (experts + 1) % E, toks, tiles=FUSED)
    assert rel_err(got, moe_decode_gate_up_reference(x, gate, up, experts, toks)) > 0.1


def test_the_plan_fills_the_gpu_at_k26_shapes():
    tiles = DecodeTiles()
    assert gate_up_plan(8, 256, 7168, tiles) == (512, 4, 2048)  # TP8 shard, T = 1: 8 x 8 tiles x 4 splits
    assert gate_up_plan(8, 2048, 7168, tiles) == (512, 1, 7168)  # full width: 64 x 8 tiles, silu in the kernel
    assert gate_up_plan(32, 256, 7168, tiles) == (512, 1, 7168)  # TP8, 4 tokens: 8 x 32 tiles
    assert gate_up_plan(4, 64, 256, FUSED) == (64, 1, 256)


def test_bad_inputs_are_named():
    rng = np.random.default_rng(17)
    gate, up, down = experts_of(rng, E, H, I)
    experts, toks, weights = routing(rng, 1)
    x = jnp.zeros((1, H), jnp.float32)
    act = jnp.zeros((TOP_K, I), jnp.float32)
    with pytest.raises(ValueError, match="Int4Weight"):
        moe_decode_gate_up(x, gate.dequantize(), up, experts, toks)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        moe_decode_gate_up(x.astype(jnp.float16), gate, up, experts, toks)
    with pytest.raises(ValueError, match="features"):
        moe_decode_gate_up(jnp.zeros((1, H + 32), jnp.float32), gate, up, experts, toks)
    with pytest.raises(ValueError, match="up must have gate's shape"):
        moe_decode_gate_up(x, gate, down, experts, toks)
    many = jnp.zeros((MAX_ASSIGNMENTS + 1,), jnp.int32)
    with pytest.raises(ValueError, match="assignments"):
        moe_decode_gate_up(x, gate, up, many, many)
    with pytest.raises(ValueError, match="tokens must match"):
        moe_decode_gate_up(x, gate, up, experts, toks[:2])
    with pytest.raises(ValueError, match="integer vector"):
        moe_decode_gate_up(x, gate, up, experts.astype(jnp.float32), toks)
    with pytest.raises(ValueError, match="pass layer="):
        moe_decode_gate_up(x, *(jax.tree.map(lambda a: a[None], w) for w in (gate, up)), experts, toks)
    with pytest.raises(ValueError, match=r"\[L, E, N, K\]"):
        moe_decode_gate_up(x, gate, up, experts, toks, 0)
    with pytest.raises(ValueError, match="block_n"):
        moe_decode_gate_up(x, gate, up, experts, toks, tiles=DecodeTiles(block_n=48))
    with pytest.raises(ValueError, match="weights must be"):
        moe_decode_down(act, down, experts, toks, weights[:1], 1)
    with pytest.raises(ValueError, match=r"act must be \[A, I\]"):
        moe_decode_down(act[:, :32], down, experts, toks, weights, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        moe_decode_down(act, down, experts, toks, weights, 0)
    with pytest.raises(ValueError, match="no K splits"):
        moe_decode_down(act, down, experts, toks, weights, 1, tiles=DecodeTiles(splits=2))


# --- the Triton lowering, on CPU (as tests/kernels/test_gpu_lowering.py) -------------------------------------


def spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "width, tokens, layers, dtype",
    [
        (256, 1, None, jnp.bfloat16),  # K2.6 TP8 shard, one token (split-K gate / up)
        (256, 4, 60, jnp.bfloat16),  # the shard, 4 tokens, every layer stacked (read in place)
        (2048, 1, 60, jnp.bfloat16),  # full width
        (2048, 4, None, jnp.float32),
    ],
)
def test_the_kernels_lower_for_triton(hopper, width, tokens, layers, dtype):
    experts, hidden, count = 384, 7168, tokens * 8
    lead = (experts,) if layers is None else (layers, experts)

    def weight(n, k):
        return Int4Weight(spec(lead + (n, k // 8), jnp.int32), spec(lead + (n, k // 32), jnp.bfloat16))

    ids = spec((count,), jnp.int32)
    layer = None if layers is None else spec((), jnp.int32)
    text = (
        moe_decode.trace(
            spec((tokens, hidden), dtype),
            weight(width, hidden),
            weight(width, hidden),
            weight(hidden, width),
            ids,
            ids,
            spec((count,)),
            layer,
            interpret=False,
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "moe_decode_gate_up" in text and "moe_decode_down" in text
