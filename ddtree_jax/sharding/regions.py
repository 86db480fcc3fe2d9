"""Manual-sharding regions: Pallas calls and the expert-parallel MoE inside `jax.shard_map`.

The partitioner cannot split a Pallas (Triton / Mosaic) custom call: left to it, every device would gather
the whole operands and run the whole kernel. So each kernel call site goes through `shard_call`, which,
when a mesh is set (`jax.set_mesh(mesh)`, the mesh of `sharding.mesh.make_mesh`), runs the call per shard
inside `jax.shard_map` with the specs the call site gives, and otherwise calls it directly. The same code
therefore runs on one device and on a mesh.

Specs name mesh axes ("data", "model"). `fit_specs` drops an axis from *every* spec of a call when some
operand's dimension on it does not divide by the axis size, or the mesh lacks it (e.g. a batch of 3 on a
2-way "data" axis runs replicated over "data"), so the inputs and outputs always agree.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from ddtree_jax.sharding.rules import DATA, MODEL


def context_mesh():
    """The mesh set by `jax.set_mesh`, or None when none is set (or it has a single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def axis_size(mesh, axis: str) -> int:
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def fit_specs(mesh, args, in_specs, out_specs):
    """(in_specs, out_specs, dropped axes): every mesh axis that some operand cannot be split on (or that the
    mesh lacks) replaced by None in all the specs. args / in_specs are matching pytrees (a spec may stand
    for a whole subtree); outputs are split on the axes their inputs are."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    unusable = set()

    def check(spec, leaf):
        for dim, axis in enumerate(spec):
            if axis is None:
                continue
            if axis not in sizes or dim >= len(leaf.shape) or leaf.shape[dim] % sizes[axis]:
                unusable.add(axis)

    flat_specs, treedef = jax.tree.flatten(in_specs, is_leaf=_is_spec)
    for spec, subtree in zip(flat_specs, treedef.flatten_up_to(args)):
        for leaf in jax.tree.leaves(subtree):
            check(spec, leaf)
    for spec in jax.tree.leaves(out_specs, is_leaf=_is_spec):
        unusable.update(a for a in spec if a is not None and a not in sizes)

    def drop(spec):
        return PartitionSpec(*(None if a in unusable else a for a in spec))

    fitted = jax.tree.map(drop, in_specs, is_leaf=_is_spec), jax.tree.map(drop, out_specs, is_leaf=_is_spec)
    return fitted + (unusable,)


def shard_call(fn: Callable, args: tuple, in_specs: tuple, out_specs, *, reduce_axes: tuple[str, ...] = (), mesh=None):
    """fn(*args), per shard inside `jax.shard_map` when a mesh is set (module docstring), else fn(*args).

    fn must be a per-shard program: on the operands' blocks it computes the output's block, with its own
    collectives over `reduce_axes` (e.g. `lax.psum(x, "model")` after a contraction split over "model");
    those axes must stay split (a ValueError names the operand dimension that prevents it). Without a
    mesh fn runs on the whole operands, so a caller whose fn reduces builds it with the collective only
    when `context_mesh()` is set."""
    mesh = context_mesh() if mesh is None else mesh
    if mesh is None:
        return fn(*args)
    in_fit, out_fit, dropped = fit_specs(mesh, args, in_specs, out_specs)
    blocked = [a for a in reduce_axes if a in dropped and axis_size(mesh, a) > 1]
    if blocked:
        shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(args)]
        raise ValueError(
            f"mesh axis {blocked[0]!r} (size {axis_size(mesh, blocked[0])}) does not divide an operand "
            f"of this sharded region (operand shapes {shapes}, specs {in_specs})"
        )
    return jax.shard_map(fn, mesh=mesh, in_specs=in_fit, out_specs=out_fit, check_vma=False)(*args)


def rows(ndim: int) -> PartitionSpec:
    """An operand split by its leading (batch / row) dimension over "data"."""
    return PartitionSpec(DATA, *([None] * (ndim - 1)))


def heads(ndim: int, head_axis: int = 2) -> PartitionSpec:
    """[B, ..., H, ...]: batch over "data", heads over "model"."""
    spec = [None] * ndim
    spec[0], spec[head_axis] = DATA, MODEL
    return PartitionSpec(*spec)


__all__ = ["DATA", "MODEL", "axis_size", "context_mesh", "fit_specs", "heads", "rows", "shard_call"]
