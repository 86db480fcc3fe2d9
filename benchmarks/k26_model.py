"""The K2.6-width DeepSeek-V3 target that the part timings (`benchmarks.bench_model_parts`) and the sharded
runs (`experiments.sharded_run`) build: the `kimi-k2.6` preset (or the 8-way-divisible tiny one) at a chosen
depth, with random weights whose routed experts are INT4 pack-quantized as in the real checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.models import deepseek_v3
from ddtree_jax.presets import preset
from ddtree_kernels.quant import INT4_GROUP, Int4Weight

EXPERTS = ("expert_gate", "expert_up", "expert_down")


def k26_config(layers: int, tiny: bool = False) -> DeepSeekV3Config:
    """The K2.6 target with `layers` decoder layers (the first dense), tapped at layers 1, layers // 2 and
    the last (clipped to the depth); tiny: the `kimi-k2-mesh-tiny` preset, tapped at its first two layers."""
    if tiny:
        return dataclasses.replace(
            preset("kimi-k2-mesh-tiny"), num_layers=layers, tapped_layers=tuple(range(min(layers, 2)))
        )
    taps = tuple(sorted({min(layers - 1, t) for t in (1, layers // 2, layers - 1)}))
    return dataclasses.replace(preset("kimi-k2.6"), num_layers=layers, tapped_layers=taps)


def random_int4_target(config: DeepSeekV3Config, key: jax.Array, dtype) -> dict:
    """`deepseek_v3.init_params` with each routed expert stack [L, E, N, K] as random INT4 codes (int32
    [L, E, N, K / 8]) and constant group scales ([L, E, N, K / INT4_GROUP] of 0.002 in `dtype`). The dense
    experts are never built (`init_params(skip=EXPERTS)`) and the codes are drawn one layer at a time
    (`lax.map`), so under jit the temporaries stay one layer's size: a 61-layer TP8 shard (~76 GB) can be
    initialised on one H200."""
    params = deepseek_v3.init_params(config, key, dtype, skip=EXPERTS)
    shapes = deepseek_v3.param_shapes(config)["moe_layers"]
    moe = dict(params["moe_layers"])
    for i, name in enumerate(EXPERTS):
        shape = shapes[name][0]
        if shape[-1] % INT4_GROUP:
            raise ValueError(
                f"{name}'s input dimension {shape[-1]} is not a whole number of INT4 groups of {INT4_GROUP}"
            )
        layer = shape[1:-1] + (shape[-1] // 8,)
        keys = jax.random.split(jax.random.fold_in(key, 100 + i), shape[0])
        packed = jax.lax.map(lambda k: jax.random.randint(k, layer, -(2**31), 2**31 - 1, jnp.int32), keys)
        moe[name] = Int4Weight(packed, jnp.full(shape[:-1] + (shape[-1] // INT4_GROUP,), 0.002, dtype))
    return {**params, "moe_layers": moe}
