"""Sharding: mesh construction (mesh.py), the per-layout rule tables from logical axes to mesh axes
(rules.py), manual shard_map regions for what XLA cannot partition (regions.py) and the vocab-parallel
top-K of the drafter's logits (vocab_parallel.py). The memory planner is `ddtree_jax.analysis.memory`."""

from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.regions import context_mesh, shard_call
from ddtree_jax.sharding.rules import RULES, batch_sharding, param_shardings, param_specs, partition_spec, shard_params
from ddtree_jax.sharding.vocab_parallel import VOCAB_TOPK_IMPLS, sharded_top_k_log_probs

__all__ = [
    "RULES", "VOCAB_TOPK_IMPLS", "batch_sharding", "context_mesh", "make_mesh", "shard_call", "sharded_top_k_log_probs", "param_shardings", "param_specs", "partition_spec", "shard_params",
]
