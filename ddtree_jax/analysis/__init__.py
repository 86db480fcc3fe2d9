"""Analytic models of a decode step, numbers only (no device work): the memory planner (memory.py: bytes per
device of a sharded target + drafter, the longest context that fits) and the roofline (roofline.py: bytes,
FLOPs and collectives per device -> step time, tokens/s, break-even tau; `python -m
ddtree_jax.analysis.roofline`).

The roofline's names are loaded on first use (module `__getattr__`), so that running the roofline module
with `-m` does not import it twice."""

from ddtree_jax.analysis.memory import (
    MemoryPlan,
    MeshLayout,
    Tensor,
    cache_bytes_per_token,
    drafter_cache_bytes_per_token,
    drafter_inventory,
    drafter_params,
    format_bytes,
    local_shape,
    max_context,
    param_counts,
    parse_layout,
    plan_memory,
    tensor_bytes,
    total_params,
    weight_bytes,
    weight_inventory,
)

_ROOFLINE_NAMES = (
    "H200",
    "Hardware",
    "Phase",
    "StepCost",
    "break_even_tau",
    "expected_distinct_experts",
    "expected_max_group_experts",
    "format_table",
    "roofline_table",
    "step_cost",
)


def __getattr__(name: str):
    if name in _ROOFLINE_NAMES:
        from ddtree_jax.analysis import roofline

        return getattr(roofline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MemoryPlan",
    "MeshLayout",
    "Tensor",
    "cache_bytes_per_token",
    "drafter_cache_bytes_per_token",
    "drafter_inventory",
    "drafter_params",
    "format_bytes",
    "local_shape",
    "max_context",
    "param_counts",
    "parse_layout",
    "plan_memory",
    "tensor_bytes",
    "total_params",
    "weight_bytes",
    "weight_inventory",
    *_ROOFLINE_NAMES,
]
