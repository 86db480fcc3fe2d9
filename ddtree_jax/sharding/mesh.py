"""Device meshes: ("data", "model") with explicit axis types (jax.make_mesh; no pjit, no `with mesh:`)."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from ddtree_jax.sharding.rules import DATA, MODEL


def make_mesh(model: int, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, model) mesh over the first data * model devices; both axes AxisType.Auto (the compiler
    partitions the code between the shardings we pin on parameters, caches and inputs)."""
    available = jax.devices() if devices is None else list(devices)
    if model < 1 or data < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    if data * model > len(available):
        raise ValueError(
            f"a {data} x {model} mesh needs {data * model} devices, {len(available)} are available "
            "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )
    return jax.make_mesh(
        (data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto), devices=available[: data * model]
    )
