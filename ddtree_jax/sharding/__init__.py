"""Sharding: mesh construction (mesh.py), the per-layout rule tables from logical axes to mesh axes
(rules.py) and manual shard_map regions for what XLA cannot partition (regions.py): the parallel layer,
below tree / verify / models, which shard their kernel calls through it. The vocab-parallel top-K is
`ddtree_jax.tree.vocab_parallel`; the memory planner is `ddtree_jax.analysis.memory`."""

from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.sharding.regions import context_mesh, shard_call
from ddtree_jax.sharding.rules import RULES, batch_sharding, param_shardings, param_specs, partition_spec, shard_params

__all__ = [
    "RULES",
    "batch_sharding",
    "context_mesh",
    "make_mesh",
    "shard_call",
    "param_shardings",
    "param_specs",
    "partition_spec",
    "shard_params",
]
