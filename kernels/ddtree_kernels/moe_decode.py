"""MoE decode with few (token, expert) assignments: INT4 experts read in place, dequantised in registers.

At decode a step routes A = tokens x top_k assignments (K2.6: top-8, so A = 8 at one token, <= 32 here)
to a few of E = 384 experts. The models' "gather" path (`ddtree_jax.models.moe.routed_gather`) has XLA
gather the chosen experts' INT4 codes into a copy and reduce it in fusions; the grouped kernel
(`decode_matmul.grouped_matmul`) is built for many rows sorted by expert. Here each assignment reads its
expert's stored words straight out of the stacked [E, N, K] arrays (or every layer's [L, E, N, K], at a
`layer` read in place, like `grouped_matmul(layer=)`): the expert id is read inside the kernel from an
int32 ref and offsets the weight refs. No gather, no sort, no copy.

  moe_decode_gate_up(x [T, H], gate, up [E, I, H], experts [A], tokens [A]) -> act [A, I]
      act[a] = silu(x[t] @ gate[e]^T) * (x[t] @ up[e]^T),  e = experts[a], t = tokens[a]   (float32 sums)
  moe_decode_down(act [A, I], down [E, H, I], experts, tokens, weights [A], num_tokens=T) -> out [T, H]
      out[t] = sum over a with tokens[a] = t of weights[a] * act[a] @ down[e]^T              (float32 sums)
  moe_decode = both;  the `*_reference` twins dequantise the chosen experts (`quant.dense`) and use jnp.
  `flat_assignments(experts [T, k], weights [T, k])` gives the (experts, tokens, weights) [A] the kernels take.

Design. Rows of one output are matrix-vector products (M = 1 per assignment): no tensor cores, the
weights are multiplied on the CUDA cores in float32, and the cost to beat is the instruction count per
INT4 code, not the FLOPs. A plain int -> float conversion runs at 16 per clock per SM on Hopper (a
quarter of a 4 TB/s stream of codes), so codes become floats by the "magic number" trick instead: OR-ing
an integer c < 2^23 into the mantissa of 2^23 (bits 0x4B000000) gives the float 2^23 + c exactly, and
subtracting 2^23 + 8 (exact) gives the signed code. Nibble j of a word sits at bits 4j: for j < 5 it is
masked in place (value (c - 8) * 16^j), for j >= 5 in the word shifted by 16 (value (c - 8) * 16^(j-4));
the activation element it meets is pre-multiplied by the power of 16 (exact). Per code: one LOP3
(and + or), one FADD, one FFMA; one shift per 8 codes; the group scale (per 4 words) is one FFMA per
word. Activations come in their natural [R, K] layout, viewed [R, K / 8, 8]: nibble plane j of a tile
of words meets the strided vector x[r, 8w + j] (8 small cached loads per K step, shared by the rows a
thread holds).

  gate_up: grid (I / BN column tiles, S K splits, A assignments). A program streams a [BN, K / S] stripe
    of its expert's gate and up words in [BN, BK / 8] tiles (+ [BN, BK / 32] scales), accumulating
    [BN, BK / 8] float32 per-word partial sums, summed over words at the end. S = 1: silu(g) * u in the
    kernel, act stored in x's dtype (one launch). S > 1 (chosen so that the grid fills the GPU, when
    I / BN x A is small, e.g. the TP8 shard at one token): float32 partials [S, A, I] of gate and up,
    summed (and silu-ed) by one small XLA fusion.
  down: grid (H / BN column tiles). A program loops over every assignment and K tile (one flattened
    loop, A x ceil(I / BK) steps, Triton-pipelined), reads assignment a's expert, token and routing
    weight from refs, and adds weights[a] x its [BN] partial into row tokens[a] of a [T_pad, BN] float32
    accumulator (T_pad: T rounded up to a power of two); one launch, no atomics, no [A, H] intermediate.

Bytes read per call (each chosen expert once; a repeated one again, from L2 if lucky):
  gate_up: A x 2 x I x (H / 2 + H / 32 x scale bytes), down: A x H x (I / 2 + I / 32 x scale bytes);
  Kimi K2.6 TP8 shard (I = 256, H = 7168, bf16 scales), A = 8: 16.5 + 8.3 MB (codes alone 22.0 MB):
  ~5.8 us at a 4.3 TB/s copy roof; full width (I = 2048): 132 + 66 MB (~46 us).
Default tiles (`GATE_UP_TILES`, `DOWN_TILES`; chosen by `benchmarks/bench_moe_decode.py --quick --sweep` on
the H200, device time at the TP8 shard's width): gate_up BN = 16, BK = 1024, the best summed over one and four
tokens (one token: 16 column tiles x 8 assignments x 2 K splits = 256 programs, 16.9 us against 18.1 for BN = 32 /
BK = 512, 15.1 for the best there, BN = 64 / BK = 512; four tokens: 16 x 32 = 512 programs, S = 1, 34.7 against
56.8 us, the best); down BN = 32 (224 programs), BK = 512 (<= I): the best swept at four tokens (41.1 us, the
others 49-52), within 9% of the best at one.

Constraints: INT4 `quant.Int4Weight` experts (group 32), H and I multiples of 32; x bf16 or float32
(float32 is computed in float32 throughout; bf16 loads are widened to float32, no bf16 rounding of the
dequantised weights); 1 <= A <= MAX_ASSIGNMENTS = 32; experts / tokens are clamped into range inside the
kernels, and the layer is read as `lax.dynamic_index_in_dim` reads it (negative from the end, then clamped), the
twins alike (a traced id cannot be checked; an out-of-range one reads a wrong expert, never out of bounds).
Interpret mode off GPU (`tiling.default_interpret`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_kernels.decode_matmul import _split_k
from ddtree_kernels.mosaic_common import layer_index
from ddtree_kernels.quant import INT4_GROUP, Int4Weight, dense
from ddtree_kernels.tiling import TARGET_PROGRAMS, default_interpret, dot_precision, fits, pipelined_bytes

MAX_ASSIGNMENTS = 32  # A = tokens x top_k the kernels are meant for (decode, small trees)
MAGIC = 0x4B000000  # float32 bits of 2^23: OR an integer c < 2^23 into it -> the float 2^23 + c
WORD_SHIFT = 16  # nibbles 5..7 are read from the word shifted right by this (their bits then lie below 2^23)


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """One kernel's tiling. block_n: output columns per program (a power of two); block_k: contraction
    elements per step (a power of two >= 32, cut to the smallest power of two >= K); splits: K splits of
    the gate_up kernel (None: fill the GPU, `gate_up_plan`; the down kernel has none: 1 or None);
    num_warps / num_stages: Triton's (stages cut until the tiles fit the shared memory)."""

    block_n: int = 32
    block_k: int = 512
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def check(self, name: str) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise ValueError(f"{name}: block_n must be a power of two, got {self.block_n}")
        if self.block_k < INT4_GROUP or self.block_k & (self.block_k - 1):
            raise ValueError(f"{name}: block_k must be a power of two >= {INT4_GROUP}, got {self.block_k}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"{name}: splits must be >= 1 or None, got {self.splits}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"{name}: num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}")


GATE_UP_TILES = DecodeTiles(block_n=16, block_k=1024, splits=None, num_warps=4, num_stages=3)
DOWN_TILES = DecodeTiles(block_n=32, block_k=512, splits=1, num_warps=4, num_stages=4)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_k(tiles: DecodeTiles, k: int) -> int:
    return min(tiles.block_k, max(INT4_GROUP, _pow2_at_least(k)))


def _stages(tiles: DecodeTiles, block_k: int, matrices: int, x_dtype, scale_dtype) -> int:
    """num_stages cut (down to 1) until `matrices` weight tiles + scales + the activation planes fit."""
    words = block_k // 8
    stage = [((tiles.block_n, words), jnp.int32), ((tiles.block_n, block_k // INT4_GROUP), scale_dtype)] * matrices
    stage += [((8, words), x_dtype)]
    stages = tiles.num_stages
    while stages > 1 and not fits(pipelined_bytes(stage, stages)):
        stages -= 1
    return stages


def gate_up_plan(assignments: int, n: int, k: int, tiles: DecodeTiles) -> tuple[int, int, int]:
    """(block_k, splits, k_per_split) of the gate_up kernel: `tiles.splits`, or (None) as many K splits
    as bring the grid to TARGET_PROGRAMS (at most one per K tile; 1 once the column tiles x assignments
    alone reach it)."""
    block_k = _block_k(tiles, k)
    k_tiles = pl.cdiv(k, block_k)
    programs = pl.cdiv(n, tiles.block_n) * assignments
    splits = tiles.splits if tiles.splits is not None else max(1, TARGET_PROGRAMS // programs)
    return (block_k,) + _split_k(k_tiles, max(1, min(splits, k_tiles)), block_k)


# --- the kernels --------------------------------------------------------------------------------------------


def _plane(packed, high, j: int):
    """Nibble plane j of int32 words [BN, W] as float32 (code - 8) * 16^s, s = j (j < 5) or j - 4 (high =
    the words >> 16), exact: the magic-number conversion (module docstring)."""
    src, s = (packed, j) if j < 5 else (high, j - 4)
    bits = (src & (0xF << (4 * s))) | MAGIC
    return lax.bitcast_convert_type(bits, jnp.float32) - float((1 << 23) + 8 * 16**s)


def _plane_factor(j: int) -> float:
    """What the activation element of plane j is multiplied by, undoing the plane's 16^s."""
    return 16.0 ** -(j if j < 5 else j - 4)


def _act_planes(x_ref, row, w0, words: int, nwords: int):
    """The 8 activation vectors [W] meeting a tile of words w0 .. w0 + W - 1 of row `row`: plane j holds
    x[row, 8w + j] x 16^-s (float32); words past the end read as 0. x_ref: [R, K / 8, 8]."""
    ok = (w0 + jnp.arange(words)) < nwords
    return [
        plgpu.load(x_ref.at[row, pl.ds(w0, words), jnp.int32(j)], mask=ok, other=0).astype(jnp.float32)
        * _plane_factor(j)
        for j in range(8)
    ]


def _tile_matvec(packed_ref, scale_ref, layer, expert, n0, w0, xs, *, n: int, k: int, block_n: int, block_k: int):
    """[BN, BK / 8] float32 per-word partial dots of rows n0 .. n0 + BN - 1 of (layer, expert)'s weights,
    words w0 .. w0 + BK / 8 - 1 (K elements 8 w0 ..), against the activation planes xs (scaled per group).
    w0 is a multiple of BK / 8 (so its group w0 / 4 is exact). Rows / words past
    the ends read as code 0, scale 0 (contribute 0). packed_ref: i32 [L, E, N, K / 8]; scale_ref: [L, E,
    N, K / 32]."""
    words, groups = block_k // 8, block_k // INT4_GROUP
    row_ok = ((n0 + jnp.arange(block_n)) < n)[:, None]
    g0 = lax.div(w0, INT4_GROUP // 8)  # w0 >= 0: truncating division (no floor fix-ups in the kernel)
    packed = plgpu.load(
        packed_ref.at[layer, expert, pl.ds(n0, block_n), pl.ds(w0, words)],
        mask=row_ok & ((w0 + jnp.arange(words)) < k // 8)[None, :],
        other=0,
    )
    scale = plgpu.load(
        scale_ref.at[layer, expert, pl.ds(n0, block_n), pl.ds(g0, groups)],
        mask=row_ok & ((g0 + jnp.arange(groups)) < k // INT4_GROUP)[None, :],
        other=0,
    ).astype(jnp.float32)
    scale = jnp.broadcast_to(scale[:, :, None], (block_n, groups, INT4_GROUP // 8)).reshape(block_n, words)
    high = packed >> WORD_SHIFT
    acc = _plane(packed, high, 0) * xs[0][None, :]
    for j in range(1, 8):
        acc = acc + _plane(packed, high, j) * xs[j][None, :]
    return acc * scale


def _ids(experts_ref, tokens_ref, layer_ref, a, *, num_experts: int, num_tokens: int, num_layers: int):
    # ids clamped into range (the twins clamp alike: `_clamped`); the layer read as lax.dynamic_index_in_dim
    # reads it (negative from the end, then clamped), as every stacked-layer kernel here
    expert = jnp.clip(experts_ref[a], 0, num_experts - 1)
    token = jnp.clip(tokens_ref[a], 0, num_tokens - 1)
    return expert, token, layer_index(layer_ref[0], num_layers)


def _gate_up_kernel(
    experts_ref,
    tokens_ref,
    layer_ref,
    x_ref,
    gate_packed_ref,
    gate_scale_ref,
    up_packed_ref,
    up_scale_ref,
    *out_refs,
    n: int,
    k: int,
    block_n: int,
    block_k: int,
    k_per_split: int,
    num_experts: int,
    num_tokens: int,
    num_layers: int,
):
    # experts_ref, tokens_ref: i32 [A]; layer_ref: i32 [1]
    # x_ref: [T, H / 8, 8] the tokens' hidden states (x's dtype), viewed by word
    # gate / up: packed i32 [L, E, I, H / 8], scale [L, E, I, H / 32] (every layer's stack; L = 1 unstacked)
    # out_refs, S = 1: act [BN] (x's dtype) of this assignment's columns;
    #           S > 1: gate, up float32 partial sums [BN] of this split
    n_tile, split, a = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert, token, layer = _ids(
        experts_ref, tokens_ref, layer_ref, a, num_experts=num_experts, num_tokens=num_tokens, num_layers=num_layers
    )
    n0 = n_tile * block_n
    words = block_k // 8
    tile = functools.partial(_tile_matvec, n=n, k=k, block_n=block_n, block_k=block_k)

    def body(i, accs):
        acc_gate, acc_up = accs
        w0 = split * (k_per_split // 8) + i * words  # first word of this K step
        xs = _act_planes(x_ref, token, w0, words, k // 8)
        acc_gate = acc_gate + tile(gate_packed_ref, gate_scale_ref, layer, expert, n0, w0, xs)
        acc_up = acc_up + tile(up_packed_ref, up_scale_ref, layer, expert, n0, w0, xs)
        return acc_gate, acc_up

    zeros = jnp.zeros((block_n, words), jnp.float32)
    acc_gate, acc_up = lax.fori_loop(0, k_per_split // block_k, body, (zeros, zeros))
    g, u = acc_gate.sum(axis=1), acc_up.sum(axis=1)
    if len(out_refs) == 1:
        out_refs[0][...] = (g * jax.nn.sigmoid(g) * u).astype(out_refs[0].dtype)
    else:
        out_refs[0][...] = g
        out_refs[1][...] = u


def _down_kernel(
    experts_ref,
    tokens_ref,
    layer_ref,
    weights_ref,
    act_ref,
    packed_ref,
    scale_ref,
    o_ref,
    *,
    n: int,
    k: int,
    block_n: int,
    block_k: int,
    num_experts: int,
    num_tokens: int,
    num_layers: int,
    token_rows: int,
):
    # experts_ref, tokens_ref: i32 [A]; layer_ref: i32 [1]; weights_ref: f32 [A] routing weights
    # act_ref: [A, I / 8, 8] the assignments' activations (x's dtype), viewed by word
    # packed_ref: i32 [L, E, H, I / 8]; scale_ref: [L, E, H, I / 32]
    # o_ref: [T_pad, BN] (x's dtype) this program's columns of every token
    n_tile = pl.program_id(0)
    n0 = n_tile * block_n
    words = block_k // 8
    k_steps = pl.cdiv(k, block_k)
    token_row = jnp.arange(token_rows)[:, None]

    def body(i, acc):
        a = lax.div(i, k_steps)  # i >= 0: truncating division, no floor-mod fix-ups for Triton
        w0 = (i - a * k_steps) * words  # first word of this K step
        expert, token, layer = _ids(
            experts_ref, tokens_ref, layer_ref, a, num_experts=num_experts, num_tokens=num_tokens, num_layers=num_layers
        )
        xs = _act_planes(act_ref, a, w0, words, k // 8)
        part = _tile_matvec(
            packed_ref, scale_ref, layer, expert, n0, w0, xs, n=n, k=k, block_n=block_n, block_k=block_k
        )
        part = part.sum(axis=1) * weights_ref[a]  # [BN]
        return acc + jnp.where(token_row == token, part[None, :], 0.0)

    steps = act_ref.shape[0] * k_steps
    acc = lax.fori_loop(0, steps, body, jnp.zeros((token_rows, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# --- checks and wrappers -----------------------------------------------------------------------------------


def _stacked(weight, layer, name: str):
    """(weight as [L, E, N, K] stacks, layer int32 [1], L) after checking the form."""
    if not isinstance(weight, Int4Weight):
        raise ValueError(
            f"{name} must be a quant.Int4Weight (INT4 pack-quantized experts), got {type(weight).__name__}"
        )
    shape = weight.shape
    if layer is None:
        if len(shape) != 3:
            raise ValueError(
                f"{name} must be stacked experts [E, N, K], got shape {shape} (every layer's [L, E, N, K]: pass layer=)"
            )
        weight, layer = jax.tree.map(lambda a: a[None], weight), jnp.zeros((1,), jnp.int32)
    else:
        if len(shape) != 4:
            raise ValueError(f"with layer= {name} must be every layer's experts [L, E, N, K], got shape {shape}")
        layer = jnp.asarray(layer)
        if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got shape {layer.shape} dtype {layer.dtype}")
        layer = layer.astype(jnp.int32).reshape(1)
    weight.check_layout(name)
    return weight, layer, weight.packed.shape[0]


def _check_assignments(experts, tokens, weights=None) -> int:
    for label, ids in (("experts", experts), ("tokens", tokens)):
        if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{label} must be an integer vector [A], got shape {ids.shape} dtype {ids.dtype}")
    count = experts.shape[0]
    if tokens.shape != (count,):
        raise ValueError(f"tokens must match experts ({count},), got {tokens.shape}")
    if not 1 <= count <= MAX_ASSIGNMENTS:
        raise ValueError(f"the kernels take 1 .. {MAX_ASSIGNMENTS} assignments (A = tokens x top_k), got A = {count}")
    if weights is not None and (weights.shape != (count,) or not jnp.issubdtype(weights.dtype, jnp.floating)):
        raise ValueError(f"weights must be a float vector ({count},), got shape {weights.shape} dtype {weights.dtype}")
    return count


def _check_activation(x, label: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{label} must be 2-D, got shape {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"{label} must be bfloat16 or float32, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_decode_gate_up(
    x: jax.Array,
    gate: Int4Weight,
    up: Int4Weight,
    experts: jax.Array,
    tokens: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    tiles: DecodeTiles | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """act [A, I] (x's dtype) = silu(x[tokens] @ gate[experts]^T) * (x[tokens] @ up[experts]^T), float32
    sums. x [T, H] bf16 / f32; gate, up: Int4Weight [E, I, H] (or [L, E, I, H] with layer = an int32
    scalar, may be traced: read in place); experts, tokens: int [A], A <= MAX_ASSIGNMENTS."""
    _check_activation(x, "x")
    gate, layer_ids, num_layers = _stacked(gate, layer, "gate")
    up, _, _ = _stacked(up, layer, "up")
    count = _check_assignments(experts, tokens)
    num_experts, n, k = gate.shape[1:]
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {gate.shape}, got {up.shape}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the experts' gate / up take H = {k}")
    tiles = tiles or GATE_UP_TILES
    tiles.check("gate_up tiles")
    block_k, splits, k_per_split = gate_up_plan(count, n, k, tiles)
    stages = _stages(tiles, block_k, 2, x.dtype, gate.scale.dtype)
    n_tiles = pl.cdiv(n, tiles.block_n)
    n_pad = n_tiles * tiles.block_n
    kernel = functools.partial(
        _gate_up_kernel,
        n=n,
        k=k,
        block_n=tiles.block_n,
        block_k=block_k,
        k_per_split=k_per_split,
        num_experts=num_experts,
        num_tokens=x.shape[0],
        num_layers=num_layers,
    )
    inputs = (
        experts.astype(jnp.int32),
        tokens.astype(jnp.int32),
        layer_ids,
        x.reshape(x.shape[0], k // 8, 8),
        gate.packed,
        gate.scale,
        up.packed,
        up.scale,
    )
    if splits == 1:
        out_specs = pl.BlockSpec((None, tiles.block_n), lambda j, s, a: (a, j))
        out_shape = jax.ShapeDtypeStruct((count, n_pad), x.dtype)
    else:
        out_specs = [pl.BlockSpec((None, None, tiles.block_n), lambda j, s, a: (s, a, j))] * 2
        out_shape = [jax.ShapeDtypeStruct((splits, count, n_pad), jnp.float32)] * 2
    out = pl.pallas_call(
        kernel,
        grid=(n_tiles, splits, count),
        in_specs=[_whole(a.shape) for a in inputs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=stages),
        interpret=default_interpret(interpret),
        name="moe_decode_gate_up",
    )(*inputs)
    if splits > 1:
        g, u = out[0].sum(axis=0), out[1].sum(axis=0)
        out = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
    return out[:, :n]


@functools.partial(jax.jit, static_argnames=("num_tokens", "tiles", "interpret"))
def moe_decode_down(
    act: jax.Array,
    down: Int4Weight,
    experts: jax.Array,
    tokens: jax.Array,
    weights: jax.Array,
    num_tokens: int,
    layer: jax.Array | int | None = None,
    *,
    tiles: DecodeTiles | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """out [num_tokens, H] (act's dtype): out[t] = sum over assignments a with tokens[a] = t of
    weights[a] * act[a] @ down[experts[a]]^T (float32 sums; tokens no assignment names get 0). act [A, I]
    bf16 / f32; down: Int4Weight [E, H, I] (or [L, E, H, I] with layer); weights: float [A]."""
    _check_activation(act, "act")
    down, layer_ids, num_layers = _stacked(down, layer, "down")
    count = _check_assignments(experts, tokens, weights)
    num_experts, n, k = down.shape[1:]
    if act.shape != (count, k):
        raise ValueError(f"act must be [A, I] = ({count}, {k}) for down of shape {down.shape}, got {act.shape}")
    if not 1 <= num_tokens <= MAX_ASSIGNMENTS:
        raise ValueError(f"num_tokens must be 1 .. {MAX_ASSIGNMENTS}, got {num_tokens}")
    tiles = tiles or DOWN_TILES
    tiles.check("down tiles")
    if tiles.splits not in (None, 1):
        raise ValueError(
            f"the down kernel has no K splits (one launch, no atomics): splits must be 1, got {tiles.splits}"
        )
    block_k = _block_k(tiles, k)
    stages = _stages(tiles, block_k, 1, act.dtype, down.scale.dtype)
    n_tiles = pl.cdiv(n, tiles.block_n)
    token_rows = _pow2_at_least(num_tokens)
    inputs = (
        experts.astype(jnp.int32),
        tokens.astype(jnp.int32),
        layer_ids,
        weights.astype(jnp.float32),
        act.reshape(count, k // 8, 8),
        down.packed,
        down.scale,
    )
    out = pl.pallas_call(
        functools.partial(
            _down_kernel,
            n=n,
            k=k,
            block_n=tiles.block_n,
            block_k=block_k,
            num_experts=num_experts,
            num_tokens=num_tokens,
            num_layers=num_layers,
            token_rows=token_rows,
        ),
        grid=(n_tiles,),
        in_specs=[_whole(a.shape) for a in inputs],
        out_specs=pl.BlockSpec((token_rows, tiles.block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((token_rows, n_tiles * tiles.block_n), act.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=stages),
        interpret=default_interpret(interpret),
        name="moe_decode_down",
    )(*inputs)
    return out[:num_tokens, :n]


@functools.partial(jax.jit, static_argnames=("gate_up_tiles", "down_tiles", "interpret"))
def moe_decode(
    x: jax.Array,
    gate: Int4Weight,
    up: Int4Weight,
    down: Int4Weight,
    experts: jax.Array,
    tokens: jax.Array,
    weights: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    gate_up_tiles: DecodeTiles | None = None,
    down_tiles: DecodeTiles | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The routed part of a MoE layer, x [T, H] -> [T, H] (x's dtype): `moe_decode_gate_up` then
    `moe_decode_down` (two kernel launches, three when the gate_up kernel splits K)."""
    act = moe_decode_gate_up(x, gate, up, experts, tokens, layer, tiles=gate_up_tiles, interpret=interpret)
    return moe_decode_down(
        act, down, experts, tokens, weights, x.shape[0], layer, tiles=down_tiles, interpret=interpret
    )


def flat_assignments(experts: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A router's (experts, weights) [T, k] -> (experts int32 [A], tokens int32 [A], weights float32 [A]),
    A = T x k, assignment a = t x k + j."""
    count, top_k = experts.shape
    tokens = jnp.repeat(jnp.arange(count, dtype=jnp.int32), top_k)
    return experts.reshape(-1).astype(jnp.int32), tokens, weights.reshape(-1).astype(jnp.float32)


# --- the twins ----------------------------------------------------------------------------------------------


def _clamped(ids, size: int) -> jax.Array:
    """ids clamped into [0, size) as the kernels clamp them (`_ids`): an out-of-range id reads the nearest end."""
    return jnp.clip(jnp.asarray(ids), 0, size - 1)


def _chosen(weight: Int4Weight, experts, layer):
    """The chosen experts' weights dequantised to float32, [A, N, K] (only those gathered, in stored form)."""
    if layer is not None:
        layer = layer_index(layer, weight.packed.shape[0])
        return dense(jax.tree.map(lambda a: a[layer, _clamped(experts, a.shape[1])], weight), jnp.float32)
    return dense(jax.tree.map(lambda a: a[_clamped(experts, a.shape[0])], weight), jnp.float32)


def moe_decode_gate_up_reference(x, gate, up, experts, tokens, layer=None) -> jax.Array:
    """The twin of `moe_decode_gate_up`: float32 dequantised experts (`quant.dense`), float32 jnp."""
    rows = x[_clamped(tokens, x.shape[0])].astype(jnp.float32)  # [A, H]
    hi = dot_precision(jnp.float32)
    g = jnp.einsum("ah,aih->ai", rows, _chosen(gate, experts, layer), precision=hi)
    u = jnp.einsum("ah,aih->ai", rows, _chosen(up, experts, layer), precision=hi)
    return (jax.nn.silu(g) * u).astype(x.dtype)


def moe_decode_down_reference(act, down, experts, tokens, weights, num_tokens: int, layer=None) -> jax.Array:
    """The twin of `moe_decode_down`."""
    y = jnp.einsum(
        "ai,ahi->ah", act.astype(jnp.float32), _chosen(down, experts, layer), precision=dot_precision(jnp.float32)
    )
    y = y * weights.astype(jnp.float32)[:, None]
    return jnp.zeros((num_tokens, y.shape[1]), jnp.float32).at[_clamped(tokens, num_tokens)].add(y).astype(act.dtype)


def moe_decode_reference(x, gate, up, down, experts, tokens, weights, layer=None) -> jax.Array:
    """The twin of `moe_decode` (act rounded to x's dtype in between, as the kernels do)."""
    act = moe_decode_gate_up_reference(x, gate, up, experts, tokens, layer)
    return moe_decode_down_reference(act, down, experts, tokens, weights, x.shape[0], layer)
