"""The drafter's per-depth top-K over a vocabulary split across the "model" axis (the LM head under TP).

Under tensor parallelism the LM head's output features (the vocabulary) are split over "model", so each
device holds logits [..., V / P]. The tree builder needs, per depth, the K largest float32 log-softmax
values and their token ids (`tree.select.top_k_log_probs`). Two ways:

  gathered         all-gather the logits to [..., V] on every device, then `top_k_log_probs` there:
                   moves (P - 1) / P * V values per row per device.
  vocab-parallel   per shard: the row's max and sum of exponentials combined across shards (`pmax`,
                   `psum`: two scalars per row), the shard's K best logits (`lax.top_k`), shifted by the
                   global log-normaliser; the P * K candidates all-gathered (K values + K ids per shard)
                   and a final `lax.top_k` over them: moves 2 * (P - 1) * K numbers per row per device.

Both return the same ids; the values equal the unsharded log-softmax up to float32 rounding of the
normaliser (the sum of exponentials is added in another order). Ties: candidates are laid out shard by
shard, each shard's in descending order with lower ids first, and shard s holds ids below shard s + 1's,
so `lax.top_k`'s lower-position-first rule is the lower-id-first rule of the unsharded selection.

Every device computes the same result from the same numbers (no rank divergence): the collectives return
identical values on every device. Sampling at verification stays on gathered logits (the sampler's filters
need the whole row; see README "Sharded runs").

`benchmarks/bench_lm_head.py` measures the two at K2.6 shapes on the devices present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ddtree_jax.sharding.regions import axis_size, context_mesh, shard_call
from ddtree_jax.sharding.rules import DATA, MODEL
from ddtree_jax.tree.select import top_k_log_probs

VOCAB_TOPK_IMPLS = ("gathered", "vocab_parallel")


def _local_top_k(logits, k: int, vocab_shard: int):
    """Per shard: ([..., K] global log-probs, [..., K] global ids) of this shard's K best logits."""
    x = logits.astype(jnp.float32)
    row_max = lax.pmax(jnp.max(x, axis=-1, keepdims=True), MODEL)
    total = lax.psum(jnp.sum(jnp.exp(x - row_max), axis=-1, keepdims=True), MODEL)
    log_norm = row_max + jnp.log(total)
    values, ids = lax.top_k(x, k)
    offset = lax.axis_index(MODEL) * vocab_shard
    return values - log_norm, ids.astype(jnp.int32) + offset


def _merge(values, ids, k: int):
    """values / ids [P, ..., K] from every shard -> the K best over the P * K candidates."""
    shards = values.shape[0]
    values = jnp.moveaxis(values, 0, -2).reshape(*values.shape[1:-1], shards * values.shape[-1])
    ids = jnp.moveaxis(ids, 0, -2).reshape(values.shape)
    best, position = lax.top_k(values, k)
    return best, jnp.take_along_axis(ids, position, axis=-1)


def sharded_top_k_log_probs(
    logits: jax.Array, k: int, *, impl: str = "vocab_parallel", mesh=None
) -> tuple[jax.Array, jax.Array]:
    """`tree.select.top_k_log_probs(logits, k)` for logits whose last axis (the vocabulary) is split over
    the mesh's "model" axis.

    Args:
      logits: float [B, ..., V] (the leading axis may be split over "data").
      k: static, 1 <= k <= V / P (each shard must hold k candidates).
      impl: "vocab_parallel" (local top-K + two scalar reductions + a K-candidate gather) or "gathered"
        (all-gather the logits, then the unsharded selection).
      mesh: default the mesh set by `jax.set_mesh`; without one (or with a "model" axis of 1) this is
        `top_k_log_probs`.
    Returns:
      (log_probs float32 [..., k] descending, token_ids int32 [..., k]), replicated over "model".
    """
    if impl not in VOCAB_TOPK_IMPLS:
        raise ValueError(f"vocab top-k impl must be one of {VOCAB_TOPK_IMPLS}, got {impl!r}")
    mesh = context_mesh() if mesh is None else mesh
    parts = 1 if mesh is None else axis_size(mesh, MODEL)
    vocab = logits.shape[-1]
    if parts == 1:
        return top_k_log_probs(logits, k, impl="xla")
    if vocab % parts:
        raise ValueError(f"vocabulary {vocab} does not divide over the {parts} devices of the {MODEL!r} axis")
    if not 1 <= k <= vocab // parts:
        raise ValueError(f"k must be in [1, V / P = {vocab // parts}] for a vocabulary split {parts} ways, got {k}")
    # batch over "data" where it divides (shard_call drops it otherwise), vocabulary over "model"
    in_spec = PartitionSpec(DATA, *([None] * (logits.ndim - 2)), MODEL)
    out_spec = PartitionSpec(DATA, *([None] * (logits.ndim - 1)))

    if impl == "gathered":

        def fn(x):
            full = lax.all_gather(x, MODEL, axis=x.ndim - 1, tiled=True)
            return top_k_log_probs(full, k, impl="xla")
    else:

        def fn(x):
            values, ids = _local_top_k(x, k, vocab // parts)
            return _merge(lax.all_gather(values, MODEL), lax.all_gather(ids, MODEL), k)

    return shard_call(fn, (logits,), (in_spec,), (out_spec, out_spec), reduce_axes=(MODEL,), mesh=mesh)


__all__ = ["VOCAB_TOPK_IMPLS", "sharded_top_k_log_probs"]
