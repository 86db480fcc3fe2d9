"""The DeepSeek-V3 / Kimi K2.x MoE block: noaux_tc routing and three exact routed-expert dispatches.

`moe(config, p, x, impl=...)` = routed experts + the shared expert, x [..., D] -> [..., D]. With M tokens
and k experts per token there are N = M * k (token, expert) assignments:

- "reference": every expert on every token, combined by a dense [M, E] routing matrix; all E experts
  dequantised (an E-expert transient: ~32 GiB per K2.6 layer in bf16). The parity path (`forward_logits`).
- "gather": each assignment's expert read in its stored form (INT4 packed words and scales, FP8 values
  and block scales, float) and contracted by a float32 reduction that XLA fuses with the gather and the
  dequantisation: no gathered or dequantised copy is written. Cost ~ N experts' bytes.
- "ragged": assignments sorted by expert, `lax.ragged_dot` (one group per expert) over dequantised
  weights, unsorted and combined. When N < E only the distinct chosen experts are gathered and
  dequantised (N slots, spare ones empty); else all E are dequantised in XLA. This is the interface the
  Pallas INT4 grouped kernel fills in: XLA on GPU expands ragged_dot into a dense product over every
  group (G * N rows), k times the reference's work once N >= E.
- "decode": kernels that read the chosen experts' INT4 codes in place (the expert id read inside the kernel;
  a LayerOf's layer too). `ddtree_kernels.moe_decode` (Triton): gate / up + SiLU, then the weighted down
  projection summed per token, for at most `moe_decode.MAX_ASSIGNMENTS` assignments. With
  `dispatch.AUTO_MOSAIC_DECODE` on (off: slower on the H200), on GPU, bf16, up to
  `dispatch.MOSAIC_DECODE_MAX_ASSIGNMENTS` assignments (`dispatch.decode_moe_kernel`), the Mosaic GPU decode form
  instead (`grouped_int4_mgpu.gathered_int4_matmul`: one tile an assignment, scales read in place, K split over
  the SMs) for gate, up and down, SiLU and the weighted sum in XLA (`routed_gathered_mosaic`). Other weights or
  more assignments take "gather". "auto" takes it on GPU up to 16 assignments (`dispatch.AUTO_MOE_DECODE`: the
  61-layer K2.6 shard's AR step 8.49 -> 7.75 ms against "gather").
- "auto" (prefill / tree-forward default), static from the shapes (`dispatch.moe_impl`): off GPU "gather" while
  N <= n_routed_experts, else "reference"; on GPU "decode" while N <= 16, else "pallas" (the grouped
  kernel; under a mesh it runs on the TP split, so an EP-sharded model should say "ep"). Inside "pallas",
  INT4 experts at prefill sizes run the Mosaic GPU kernel (`grouped_int4_mgpu`, `dispatch.grouped_int4_kernel`).

The costs that set the "auto" rule (gather against the dense reference and ragged_dot, per layer at
N assignments) are measured in BENCHMARKS.md ("Matmul and MoE"); the rule and its thresholds live in
`dispatch.moe_impl`. All impls are equal up to float reassociation
(tests/models/test_moe.py; in bf16 "gather" also skips the reference's rounding of dequantised weights
to bf16, accumulating in float32); static shapes, no host sync.

On a mesh (`jax.set_mesh`, tests/sharding/test_regions.py):
- "ep": expert parallel, the routed experts split over "model" (rule table "ep": 384 / 8 = 48 per
  device). A `shard_map` region: the tokens, already on every device of "model" (attention's output
  projection ends in an all-reduce), meet the device's own experts; assignments to other devices' experts
  weigh 0; a psum over "model" combines. Inside (`dispatch.local_expert_impl`), "gather" while the step's
  assignments are at most the device's experts (GPU: at most 16), else the grouped kernel on GPU and
  the dense product over its experts elsewhere. Without a mesh "ep" is "gather".
- "pallas" / "decode": kernels XLA cannot partition, so under a mesh they run in a region too, on the TP
  table's split (each expert's FFN columns over "model"), partial sums psum-ed.
- "gather" / "ragged" / "reference" are left to the XLA partitioner (right for TP, where each device
  reads its column slice of the chosen experts; under the EP table it would gather expert weights
  across devices: use "ep").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ddtree_jax import dispatch
from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.dispatch import MOE_IMPLS
from ddtree_jax.models.layers import LayerOf, contract, linear, swiglu  # noqa: F401  (LayerOf re-exported)
from ddtree_jax.sharding.regions import context_mesh, rows, shard_call
from ddtree_jax.sharding.rules import MODEL, partition_spec
from ddtree_kernels.decode_matmul import grouped_matmul
from ddtree_kernels.grouped_int4_mgpu import gathered_int4_matmul, grouped_int4_matmul
from ddtree_kernels.grouped_int4_stream_mgpu import streamed_int4_matmul
from ddtree_kernels.moe_decode import MAX_ASSIGNMENTS, flat_assignments, moe_decode
from ddtree_kernels.quant import INT4_GROUP, Int4Weight, dense
from ddtree_kernels.tiling import dot_precision

# logical axes of one layer's routed-expert weights (deepseek_v3.param_shapes uses these; the rule tables
# of sharding/rules.py map them to mesh axes, here and for the manual regions below)
EXPERT_AXES = {
    "expert_gate": ("experts", "expert_mlp", "embed"),
    "expert_up": ("experts", "expert_mlp", "embed"),
    "expert_down": ("experts", "embed", "expert_mlp"),
}


def _layer(weight):
    """A layer's expert weights as a value (slices a LayerOf)."""
    return weight.get() if isinstance(weight, LayerOf) else weight


def _stored(weight):
    """The expert weights as stored: a LayerOf's whole stack (not sliced), else the weight itself."""
    return weight.stack if isinstance(weight, LayerOf) else weight


def route(config: DeepSeekV3Config, router: jax.Array, bias: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """noaux_tc routing: sigmoid scores, the correction bias only for the choice, group-limited top-k.

    x [..., D] -> (expert ids int32 [..., k], weights float32 [..., k]) with weights = scores of the
    chosen experts, normalised when norm_topk_prob, times routed_scaling_factor.
    """
    c = config
    if dispatch.router_bf16_gemm(math.prod(x.shape[:-1]), x.dtype, router.dtype):
        # bf16 x bf16 products are exact in float32: one bf16 GEMM accumulating in float32 computes the float32 logits
        # (up to summation order) without a float32 copy of the router (11 MB a K2.6 layer) or a float32 GEMM
        logits = jnp.einsum("...d,ed->...e", x, router, preferred_element_type=jnp.float32)
    else:
        logits = linear(x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)  # [..., E]
    choice = scores + bias.astype(jnp.float32)
    if c.topk_group < c.n_group:  # else every group is allowed (Kimi K2: one group): no group top-k to run
        per_group = c.n_routed_experts // c.n_group
        grouped = choice.reshape(choice.shape[:-1] + (c.n_group, per_group))
        group_score = lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [..., G]
        _, best_groups = lax.top_k(group_score, c.topk_group)
        allowed = jax.nn.one_hot(best_groups, c.n_group, dtype=bool).any(-2)  # [..., G]
        choice = jnp.where(jnp.repeat(allowed, per_group, axis=-1), choice, -jnp.inf)
    if dispatch.router_topk(math.prod(choice.shape[:-1])) == "rank":
        experts, weights = top_k_by_rank(choice, c.num_experts_per_tok, scores)
    else:
        _, experts = lax.top_k(choice, c.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * c.routed_scaling_factor


def stable_rank(keys: jax.Array, descending: bool = False) -> jax.Array:
    """keys [..., N] -> int32 [..., N]: each entry's position in the stable sort of its row (ascending, or
    descending), counted by comparisons: the entries before it in that order, or equal to it at a lower index
    ([..., N, N] comparisons, one reduction; no sort kernel)."""
    index = jnp.arange(keys.shape[-1], dtype=jnp.int32)
    other, this = keys[..., None, :], keys[..., :, None]  # [..., i, j]: entry j against entry i
    first = other > this if descending else other < this
    return (first | ((other == this) & (index[None, :] < index[:, None]))).sum(axis=-1, dtype=jnp.int32)


def top_k_by_rank(values: jax.Array, k: int, carried: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(values, k)`'s indices, and `carried` at them, by counting: values, carried float [..., E] ->
    (indices int32 [..., k], carried [..., k]). Expert i's rank is the number of experts with a larger value, or an
    equal one at a lower index ([..., E, E] comparisons, one reduction); slot r takes the expert of rank r ([..., k,
    E]: one reduction for the index, one for the carried value, which XLA may fuse). The same indices in the same
    order as lax.top_k: largest first, ties to the lower index, NaN above every number (as lax.top_k; NaN and +inf
    count as equal here), except that -0.0 and +0.0 count as equal (lax.top_k puts +0.0 first; routing's sigmoid
    scores are never -0.0). For routing's few tokens, where XLA's top-k is a sort-like kernel and a slice
    (`dispatch.router_topk`)."""
    num = values.shape[-1]
    if not 1 <= k <= num:
        raise ValueError(f"k must be 1 .. {num} (the last axis), got {k}")
    index = jnp.arange(num, dtype=jnp.int32)
    values = jnp.where(jnp.isnan(values), jnp.inf, values)  # else a NaN ranks 0 beside the maximum: ids out of range
    rank = stable_rank(values, descending=True)  # [..., E]
    picked = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, E]: one expert a slot
    indices = jnp.where(picked, index, 0).sum(axis=-1, dtype=jnp.int32)
    chosen = jnp.where(picked, carried[..., None, :], jnp.zeros((), carried.dtype)).sum(axis=-1)
    return indices, chosen


def _shared(p: dict, x: jax.Array) -> jax.Array:
    return swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"])


def routed_dense(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """x [..., D], experts / weights [..., k] -> [..., D]: every expert of p on every token, combined by a
    dense [..., E] routing matrix (INT4 / FP8 experts dequantised to x's dtype)."""
    num_experts = p["expert_gate"].shape[0]
    dense_weights = (jax.nn.one_hot(experts, num_experts) * weights[..., None]).sum(-2)  # [..., E]
    gate = contract("...d,eid->...ei", x, dense(_layer(p["expert_gate"]), x.dtype))
    up = contract("...d,eid->...ei", x, dense(_layer(p["expert_up"]), x.dtype))
    out = contract("...ei,edi->...ed", jax.nn.silu(gate) * up, dense(_layer(p["expert_down"]), x.dtype))
    return contract("...ed,...e->...d", out, dense_weights.astype(out.dtype))


def moe_reference(config: DeepSeekV3Config, p: dict, x: jax.Array) -> jax.Array:
    """Routed experts (every expert evaluated, weighted by a dense [.., E] routing matrix) + shared expert."""
    experts, weights = route(config, p["router"], p["router_bias"], x)
    return routed_dense(p, x, experts, weights) + _shared(p, x)


def _take(weight, index: jax.Array):
    """Rows `index` of the leading (experts) axis of a plain or quantised weight, kept in its stored form;
    of a LayerOf, one gather at (layer, index)."""
    if isinstance(weight, LayerOf):
        return jax.tree.map(lambda a: a[weight.layer, index], weight.stack)
    return jax.tree.map(lambda a: jnp.take(a, index, axis=0), weight)


def _gathered_matvec(x: jax.Array, weight, experts: jax.Array) -> jax.Array:
    """x [M, in] or [M, k, in], weight [E, out, in], experts [M, k] -> [M, k, out]: row (m, j) times expert
    experts[m, j].

    Written as an elementwise product and a float32 reduction over `in` (not a dot), so that XLA fuses
    the gather and the dequantisation into the reduction and reads each chosen expert once in its stored
    form, writing no gathered or dequantised copy; INT4 codes are unpacked inside it and scaled per group."""
    w = _take(weight, experts)  # leading [M, k], stored form
    tokens, k = experts.shape
    x32 = x.astype(jnp.float32).reshape(tokens, -1, 1, x.shape[-1])  # [M, 1 or k, 1, in]
    if not isinstance(w, Int4Weight):
        return (dense(w, jnp.float32) * x32).sum(-1).astype(x.dtype)
    out_dim, groups = w.scale.shape[-2:]
    shifts = jnp.arange(8, dtype=jnp.int32) * 4
    codes = ((w.packed[..., None] >> shifts) & 0xF) - 8  # [M, k, out, in / 8, 8]
    codes = codes.reshape(tokens, k, out_dim, groups, INT4_GROUP).astype(jnp.float32)
    xg = x32.reshape(tokens, -1, 1, groups, INT4_GROUP)
    return (codes * xg * w.scale.astype(jnp.float32)[..., None]).sum((-2, -1)).astype(x.dtype)


def routed_gather(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """x [M, D], experts / weights [M, k] -> [M, D]: each token's k experts gathered in stored form."""
    gate = _gathered_matvec(x, p["expert_gate"], experts)
    up = _gathered_matvec(x, p["expert_up"], experts)
    out = _gathered_matvec(jax.nn.silu(gate) * up, p["expert_down"], experts)  # [M, k, D]
    return contract("mkd,mk->md", out, weights.astype(out.dtype))


def routed_decode(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """x [M, D], experts / weights [M, k] -> [M, D] on the `moe_decode` kernels (module docstring, "decode");
    "gather" where they do not apply (non-INT4 experts, more than MAX_ASSIGNMENTS assignments)."""
    names = ("expert_gate", "expert_up", "expert_down")
    stacked = [isinstance(p[name], LayerOf) for name in names]
    if any(stacked) and not all(stacked):
        raise ValueError(f"the routed experts must be all LayerOf or none, got LayerOf for {stacked} of {names}")
    stored = [_stored(p[name]) for name in names]
    if not all(isinstance(w, Int4Weight) for w in stored):
        return routed_gather(p, x, experts, weights)
    layer = p["expert_gate"].layer if isinstance(p["expert_gate"], LayerOf) else None
    if dispatch.decode_moe_kernel(experts.size, [w.shape for w in stored], x.dtype) == "mosaic":
        return routed_gathered_mosaic(stored, layer, x, experts, weights)
    if experts.size > MAX_ASSIGNMENTS:
        return routed_gather(p, x, experts, weights)
    flat_experts, tokens, flat_weights = flat_assignments(experts, weights)
    return moe_decode(x, *stored, flat_experts, tokens, flat_weights, layer)


def routed_gathered_mosaic(stored: list, layer, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """The "decode" path on the Mosaic GPU decode form (`grouped_int4_mgpu.gathered_int4_matmul`): each (token,
    expert) assignment its own tile, its expert's INT4 codes and scales read in place (stacked layers too), no
    sort, no gather of weights. stored: the gate / up / down Int4Weights ([E, ...] or every layer's [L, E, ...]
    with `layer`); x [M, D] bf16, experts / weights [M, k] -> [M, D]."""
    gate_w, up_w, down_w = stored
    tokens, k = experts.shape
    ids = experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # [M k, D]: row a is token a // k
    gate = gathered_int4_matmul(rows, gate_w, ids, layer=layer)
    up = gathered_int4_matmul(rows, up_w, ids, layer=layer)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    out = gathered_int4_matmul(act, down_w, ids, layer=layer).reshape(tokens, k, -1)
    return contract("mkd,mk->md", out, weights.astype(out.dtype))


# lhs [N, in] ragged over N, rhs [G, out, in] (the stored [out, in] layout) -> [N, out]
_RAGGED_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _ragged(lhs: jax.Array, weight: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return lax.ragged_dot_general(lhs, weight, group_sizes, _RAGGED_DIMS, precision=dot_precision(lhs.dtype))


def sort_by_expert(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stable sort of assignments by expert: flat int32 [A] (assignment a's expert) -> (order int32 [A]: sorted
    position -> assignment, position int32 [A]: assignment -> sorted position; order[position[a]] = a).
    `dispatch.moe_sort`: "rank" counts each position by comparisons (the experts below a's, plus a's expert's
    assignments before a: one [A, A] fusion) and inverts it by a scatter; "argsort" sorts, then inverts by a
    scatter. Both give the same permutation."""
    count = flat.shape[0]
    index = jnp.arange(count, dtype=jnp.int32)
    if dispatch.moe_sort(count) == "rank":
        position = stable_rank(flat)
        order = jnp.zeros((count,), jnp.int32).at[position].set(index, unique_indices=True)
    else:
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        position = jnp.zeros((count,), jnp.int32).at[order].set(index, unique_indices=True)
    return order, position


def routed_ragged(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """x [M, D], experts / weights [M, k] -> [M, D]: assignments sorted by expert, grouped matmuls, unsorted."""
    tokens, k = experts.shape
    num_experts = p["expert_gate"].shape[0]
    flat = experts.reshape(-1)  # [N], assignment a = token * k + j
    count = flat.shape[0]
    order, position = sort_by_expert(flat)
    sorted_experts = flat[order]
    if count < num_experts:  # only the distinct chosen experts, in ascending order; spare slots: expert 0, no rows
        new = jnp.concatenate([jnp.ones((1,), bool), sorted_experts[1:] != sorted_experts[:-1]])
        slot = jnp.cumsum(new.astype(jnp.int32)) - 1
        ids = jnp.zeros((count,), jnp.int32).at[slot].set(sorted_experts)
        group_sizes = jnp.zeros((count,), jnp.int32).at[slot].add(1)
        gate_w, up_w, down_w = (_take(p[name], ids) for name in ("expert_gate", "expert_up", "expert_down"))
    else:
        group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
        gate_w, up_w, down_w = (_layer(p[name]) for name in ("expert_gate", "expert_up", "expert_down"))
    xs = x[order // k]  # [N, D], rows grouped by expert
    h = jax.nn.silu(_ragged(xs, dense(gate_w, x.dtype), group_sizes)) * _ragged(xs, dense(up_w, x.dtype), group_sizes)
    out_sorted = _ragged(h, dense(down_w, x.dtype), group_sizes)  # [N, D]
    out = out_sorted[position].reshape(tokens, k, -1)  # back to assignment order
    return contract("mkd,mk->md", out, weights.astype(out.dtype))


def routed_pallas(p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """As `routed_ragged`, with grouped kernels for the three expert matmuls: INT4 / FP8 experts stay packed and
    are dequantised in registers; experts no assignment chose are never read. INT4 experts at prefill sizes on
    GPU take `ddtree_kernels.grouped_int4_mgpu.grouped_int4_matmul` (`dispatch.grouped_int4_kernel`), smaller
    calls `grouped_int4_stream_mgpu.streamed_int4_matmul` where the rule says "stream", the rest
    `ddtree_kernels.decode_matmul.grouped_matmul` (gate / up reading the tokens through a row index where
    `dispatch.grouped_gather` says "kernel"). Interpret mode off GPU (slow: for tests)."""
    tokens, k = experts.shape
    num_experts = p["expert_gate"].shape[0]
    flat = experts.reshape(-1)
    order, position = sort_by_expert(flat)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    token_of = order // k  # [N]: the token of each sorted assignment

    gather = dispatch.grouped_gather()

    def kernel_for(rows, weight) -> str:
        stack = _stored(weight)
        if isinstance(stack, Int4Weight):
            return dispatch.grouped_int4_kernel(flat.shape[0], stack.shape, rows.dtype)
        return "triton"

    def grouped(rows, weight, row_index=None):
        """rows [N, D] in expert order, or (row_index [N] given) the tokens [M, D], sorted row a = rows[row_index[a]]."""
        stack, layer = (weight.stack, weight.layer) if isinstance(weight, LayerOf) else (weight, None)
        kernel = kernel_for(rows, weight)
        if row_index is not None and kernel != "triton":  # only the Triton kernel reads rows through an index
            raise ValueError(f"a row index reached the {kernel!r} grouped kernel, which takes rows in expert order")
        # a LayerOf is read in place: no per-layer copy of the experts
        if kernel == "mosaic":
            return grouped_int4_matmul(rows, stack, group_sizes, layer=layer)
        if kernel == "stream":
            return streamed_int4_matmul(rows, stack, group_sizes, layer=layer)
        return grouped_matmul(rows, stack, group_sizes, layer=layer, row_index=row_index)

    # the gate / up rows: the tokens read through a row index by the Triton kernel ("kernel"), else gathered into
    # expert order once for both (the Mosaic kernels take rows in expert order); "xla_apart" materialises the gather
    if gather == "kernel" and all(kernel_for(x, p[name]) == "triton" for name in ("expert_gate", "expert_up")):
        gate_rows, row_index = x, token_of
    else:
        gate_rows, row_index = x[token_of], None
        if gather == "xla_apart":
            gate_rows = lax.optimization_barrier(gate_rows)
    gate = grouped(gate_rows, p["expert_gate"], row_index)
    h = jax.nn.silu(gate) * grouped(gate_rows, p["expert_up"], row_index)
    out_sorted = grouped(h, p["expert_down"])
    out = out_sorted[position].reshape(tokens, k, -1)
    return contract("mkd,mk->md", out, weights.astype(out.dtype))


def _routed_expert_parallel(
    p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, local_impl: str | None = None
) -> jax.Array:
    """The per-device program of "ep": this device's E / m experts (the routed experts split over "model")
    on the assignments that chose one of them (the others weigh 0; the kernel runs them as local expert 0's
    rows), then the sum over devices. Dispatch on the device: `dispatch.local_expert_impl` unless given."""
    local_experts = p["expert_gate"].shape[0]
    first = lax.axis_index(MODEL) * local_experts
    mine = (experts >= first) & (experts < first + local_experts)
    local_ids = jnp.where(mine, experts - first, 0)
    local_weights = jnp.where(mine, weights, 0.0)
    local_impl = local_impl or dispatch.local_expert_impl(experts.size, local_experts)
    routed = {"gather": routed_gather, "pallas": routed_pallas, "dense": routed_dense}[local_impl]
    return lax.psum(routed(p, x, local_ids, local_weights), MODEL)


def _routed_tensor_parallel(impl: str, p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """The per-device program of a Pallas dispatch under TP: every expert's FFN columns split over "model"
    ("expert_mlp": gate / up by output rows, down by input columns), partial sums combined by a psum."""
    return lax.psum(_ROUTED[impl](p, x, experts, weights), MODEL)


_ROUTED = {"gather": routed_gather, "ragged": routed_ragged, "pallas": routed_pallas, "decode": routed_decode}


def _routed_on_mesh(
    impl: str, p: dict, x: jax.Array, experts: jax.Array, weights: jax.Array, local_impl: str | None = None
) -> jax.Array:
    """ "ep", and "pallas" under a mesh: the routed experts as a manual region (`sharding.regions`). Tokens
    (replicated over "model", split by batch over "data") meet the experts where they live, results are
    summed over "model"; without a mesh "ep" is "gather" and "pallas" / "decode" run as they are."""
    if context_mesh() is None:
        return _ROUTED["gather" if impl == "ep" else impl](p, x, experts, weights)
    # the experts' specs from the rule tables: "ep" splits "experts", "tp" each expert's "expert_mlp"
    layout, fn = (
        ("ep", functools.partial(_routed_expert_parallel, local_impl=local_impl))
        if impl == "ep"
        else ("tp", functools.partial(_routed_tensor_parallel, impl))
    )
    specs = {name: partition_spec(axes, layout) for name, axes in EXPERT_AXES.items()}
    specs = {
        name: LayerOf(PartitionSpec(None, *spec), PartitionSpec()) if isinstance(p[name], LayerOf) else spec
        for name, spec in specs.items()
    }  # a stack's layer axis and the layer index: replicated
    experts_only = {name: p[name] for name in EXPERT_AXES}
    return shard_call(
        fn, (experts_only, x, experts, weights), (specs, rows(2), rows(2), rows(2)), rows(2), reduce_axes=(MODEL,)
    )


def moe(config: DeepSeekV3Config, p: dict, x: jax.Array, *, impl: str = "auto") -> jax.Array:
    """Routed experts + shared expert, x [..., D] -> [..., D]; impl one of MOE_IMPLS (module docstring)."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown MoE impl {impl!r}; expected one of {MOE_IMPLS}")
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    if impl == "auto":
        int4 = isinstance(_stored(p["expert_gate"]), Int4Weight)
        impl = dispatch.moe_impl(flat.shape[0] * config.num_experts_per_tok, config.n_routed_experts, int4=int4)
    if impl == "reference":
        return moe_reference(config, p, x)
    experts, weights = route(config, p["router"], p["router_bias"], flat)
    if impl in ("ep", "pallas", "decode"):
        routed = _routed_on_mesh(impl, p, flat, experts, weights)
    else:
        routed = _ROUTED[impl](p, flat, experts, weights)
    return routed.reshape(lead + (width,)) + _shared(p, x)
