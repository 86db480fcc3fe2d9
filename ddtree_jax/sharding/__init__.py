"""Sharding: mesh construction (mesh.py), the per-layout rule tables from logical axes to mesh axes
(rules.py), manual shard_map regions for what XLA cannot partition (regions.py), and the memory planner
(memory.py; pure Python, no device work)."""

from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.regions import context_mesh, shard_call
from ddtree_jax.sharding.rules import RULES, batch_sharding, param_shardings, param_specs, partition_spec, shard_params

from ddtree_jax.sharding.memory import (
    MemoryPlan,
    MeshLayout,
    Tensor,
    cache_bytes_per_token,
    drafter_inventory,
    max_context,
    param_counts,
    parse_layout,
    plan_memory,
    total_params,
    weight_bytes,
    weight_inventory,
)

__all__ = [
    "RULES", "batch_sharding", "context_mesh", "make_mesh", "shard_call", "param_shardings", "param_specs", "partition_spec", "shard_params",
    "MemoryPlan", "MeshLayout", "Tensor", "cache_bytes_per_token", "drafter_inventory", "max_context",
    "param_counts", "parse_layout", "plan_memory", "total_params", "weight_bytes", "weight_inventory",
]
