"""Logical axis names -> mesh axes: one rule table per layout (MaxText-style).

Every parameter carries logical axis names (`models.*.param_axes`: "layers", "embed", "vocab", "features",
"q_heads", "kv_heads", "kv_lora", "q_lora", "mlp", "experts", "expert_mlp", "head_dim"). A layout maps
each name to a mesh axis or None (replicated); `partition_spec` turns a parameter's names into a
PartitionSpec, and `param_shardings` does it for a whole parameter tree, quantised weights included
(an INT4 / FP8 weight's arrays share the weight's logical axes; packing and block scales shrink the
last dimension, so where that dimension is sharded - the TP expert down projection, "expert_mlp" - a
shard must hold whole groups / blocks: K2.6's 2048 / 8 = 256 columns per device is 8 INT4 groups;
`param_shardings` (so `shard_params` too) checks every array divides and names the one that does not).

Layouts (mesh axes "data" and "model"):
  tp   tensor parallel: attention heads, the dense / shared FFN columns, each routed expert's FFN
       columns ("expert_mlp") and the vocabulary split over "model"; all 384 experts on every device.
  ep   expert parallel: whole routed experts split over "model" (384 / 8 = 48 per device); attention
       heads, dense / shared FFN and vocabulary still tensor-parallel.
Batch (caches, activations) goes on "data" in both. MLA's latent cache has one shared KV head, so it
is not split by heads: it is replicated over "model" and split by batch over "data".
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight

DATA, MODEL = "data", "model"

_SHARED = {
    "layers": None,
    "embed": None,
    "head_dim": None,
    "kv_lora": None,
    "q_lora": None,
    "features": None,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "batch": DATA,
}
RULES = {
    "tp": {**_SHARED, "experts": None, "expert_mlp": MODEL},
    "ep": {**_SHARED, "experts": MODEL, "expert_mlp": None},
}


def partition_spec(axes: tuple[str, ...], layout: str) -> PartitionSpec:
    """The PartitionSpec of one parameter from its logical axis names."""
    if layout not in RULES:
        raise ValueError(f"layout must be one of {sorted(RULES)}, got {layout!r}")
    rules = RULES[layout]
    unknown = [a for a in axes if a not in rules]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule in layout {layout!r}")
    return PartitionSpec(*(rules[a] for a in axes))


def _leaf_specs(value, axes, layout):
    spec = partition_spec(axes, layout)
    if isinstance(value, Int4Weight):
        return Int4Weight(spec, spec)
    if isinstance(value, Fp8BlockWeight):
        return Fp8BlockWeight(spec, spec)
    return spec


def param_specs(params, axes, layout: str):
    """A tree like `params` of PartitionSpecs (quantised weights: one spec per array)."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    flat_axes, treedef = jax.tree.flatten(axes, is_leaf=is_axes)
    flat_params = treedef.flatten_up_to(params)
    return treedef.unflatten([_leaf_specs(p, a, layout) for p, a in zip(flat_params, flat_axes)])


def param_shardings(params, axes, mesh, layout: str):
    """NamedShardings for every array of `params` on `mesh` (params: arrays or jax.ShapeDtypeStructs, e.g.
    `jax.eval_shape` of an initialiser whose jit takes these as out_shardings). Every array's dimension on a
    mesh axis must divide by the axis size: a ValueError names the first one that does not (e.g. the 64-wide
    kv_b_proj columns, 4 heads of 16, over a 3-way "model" axis), before anything is placed or compiled."""
    specs = param_specs(params, axes, layout)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings)):
        for dim, axis in enumerate(sharding.spec):
            if axis is not None and leaf.shape[dim] % mesh.shape[axis]:
                raise ValueError(
                    f"{jax.tree_util.keystr(path)}: dimension {dim} of size {leaf.shape[dim]} does not "
                    f"divide over mesh axis {axis!r} of size {mesh.shape[axis]} (layout {layout!r})"
                )
    return shardings


def shard_params(params, axes, mesh, layout: str):
    """Places `params` on `mesh` by the layout's rules (jax.device_put; arrays must divide evenly,
    `param_shardings` names the one that does not)."""
    return jax.device_put(params, param_shardings(params, axes, mesh, layout))


def batch_sharding(mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Arrays with a batch dimension (prompts, caches, sampling params): batch over "data"."""
    spec = [None] * ndim
    spec[batch_axis] = DATA
    return NamedSharding(mesh, PartitionSpec(*spec))
