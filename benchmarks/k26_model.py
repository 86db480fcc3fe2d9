"""The K2.6-width DeepSeek-V3 target that the part timings (`benchmarks.bench_model_parts`) and the sharded
runs (`experiments.sharded_run`) build: the `kimi-k2.6` preset (or the tiny one, which splits up to 4 ways under TP) at a chosen
depth, with random weights whose routed experts are INT4 pack-quantized as in the real checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.models import deepseek_v3
from ddtree_jax.presets import preset
from ddtree_kernels.quant import INT4_GROUP, Int4Weight

EXPERTS = ("expert_gate", "expert_up", "expert_down")
TINY_SIZES = " (--tiny works with --model-size 2 or 4)"  # the tiny K2's 128 expert columns: INT4 groups split <= 4 ways


def k26_config(layers: int, tiny: bool = False) -> DeepSeekV3Config:
    """The K2.6 target with `layers` decoder layers (the first dense), tapped at layers 1, layers // 2 and
    the last (clipped to the depth); tiny: the `kimi-k2-mesh-tiny` preset, tapped at its first two layers."""
    if tiny:
        return dataclasses.replace(
            preset("kimi-k2-mesh-tiny"), num_layers=layers, tapped_layers=tuple(range(min(layers, 2)))
        )
    taps = tuple(sorted({min(layers - 1, t) for t in (1, layers // 2, layers - 1)}))
    return dataclasses.replace(preset("kimi-k2.6"), num_layers=layers, tapped_layers=taps)


def int4_split_problem(config: DeepSeekV3Config) -> str | None:
    """Why a (shard) config's routed experts cannot hold INT4 codes (an input dimension that is not a whole number
    of INT4 groups, e.g. the tiny K2 split 8 ways), or None: checked from the shapes, before any weight is built."""
    shapes = deepseek_v3.param_shapes(config).get("moe_layers", {})
    for name in EXPERTS:
        if name in shapes and shapes[name][0][-1] % INT4_GROUP:
            return (
                f"the shard's {name} input dimension {shapes[name][0][-1]} is not a whole number of INT4 groups "
                f"of {INT4_GROUP}"
            )
    return None


ROUTER_BIASES = ("zero", "random")


def random_int4_target(config: DeepSeekV3Config, key: jax.Array, dtype, router_bias: str = "zero") -> dict:
    """`deepseek_v3.init_params` with each routed expert stack [L, E, N, K] as random INT4 codes (int32
    [L, E, N, K / 8]) and constant group scales ([L, E, N, K / INT4_GROUP] of 0.002 in `dtype`). The dense
    experts are never built (`init_params(skip=EXPERTS)`) and the codes are drawn one layer at a time
    (`lax.map`), so under jit the temporaries stay one layer's size: a 61-layer TP8 shard (~76 GB) can be
    initialised on one H200.

    router_bias: "zero" (the default) sets the routers' correction bias to 0; "random" keeps `init_params`'
    draw (normal x 0.3, there so the model tests exercise the bias). On random weights that draw outweighs the
    token-dependent scores, so every token picks nearly the same experts: the 17 rows of a tree routed to 35-40
    distinct experts of their 136 assignments in a 4-layer TP8 shard, 110-115 with the bias zero, 114.6 expected
    of uniform draws (`experiments/routing_spread.py`). A trained model's bias balances the experts' load instead, so with the
    random draw a multi-row step (chain, tree) would read ~3x fewer experts than it does in a real run."""
    if router_bias not in ROUTER_BIASES:
        raise ValueError(f"router_bias must be one of {ROUTER_BIASES}, got {router_bias!r}")
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
    if router_bias == "zero" and "router_bias" in moe:
        moe["router_bias"] = jnp.zeros_like(moe["router_bias"])
    return {**params, "moe_layers": moe}


def routing_spread(config: DeepSeekV3Config, params: dict, tokens: int = 48, rows: int = 17, seed: int = 3) -> list:
    """Per MoE layer, the distinct experts the last `rows` of a `tokens`-long random sequence route to (a
    tree's or a chain's rows), from a full forward (`deepseek_v3.forward_logits`): the routing that a benchmark
    on these weights exercises (recorded by wrapping `moe.route` for the one forward; restored after).
    -> [(distinct, assignments)] one per MoE layer."""
    from ddtree_jax.models import moe as moe_module

    seen = []
    route = moe_module.route

    def recording_route(c, router, bias, x):
        experts, weights = route(c, router, bias, x)
        jax.debug.callback(lambda e: seen.append(np.asarray(e)), experts)
        return experts, weights

    ids = jax.random.randint(jax.random.key(seed), (1, tokens), 0, config.vocab_size)
    moe_module.route = recording_route
    try:
        jax.block_until_ready(deepseek_v3.forward_logits(config, params, ids))
    finally:
        moe_module.route = route
    last = [e.reshape(-1, e.shape[-1])[-rows:] for e in seen]
    return [(len(np.unique(e)), e.size) for e in last]


DRAFTS = ("spread", "model")


@dataclasses.dataclass(frozen=True)
class SpreadDraftsDrafter(DFlashDrafter):
    """A random-weight DFlash drafter whose draft pass gives each (row, depth) its own distribution, as a trained
    drafter's positions have: its own pass, then `spread_logits` (fresh random logits a step, the pass's own kept at a
    small weight so none of its work is dropped). The random drafter alone gives nearly the same hidden state at every
    mask position (its attention over the context is near-uniform): its chain repeats one token, so the target's
    verify rows route to the same few experts, flattering the chain against a tree (on the 61-layer K2.6 shard the
    chain took 14.55 ms with those drafts and 16.65 with a different token a depth). With per-depth distributions the
    chain proposes distinct tokens and a DDTree tree takes its nodes of depth d from depth d's own top tokens (shared
    across branches, as DDTree's marginal tree does). For step timings only: the tokens mean nothing."""

    def draft(self, state, bonus, block_size: int):
        return spread_logits(super().draft(state, bonus, block_size), state.lengths)

    def draft_children(self, state, bonus, block_size: int):
        logits, child_logits_fn, inputs = super().draft_children(state, bonus, block_size)
        return spread_logits(logits, state.lengths), child_logits_fn, inputs


jax.tree_util.register_dataclass(
    SpreadDraftsDrafter,
    data_fields=["params", "embed", "lm_head", "head_params"],
    meta_fields=["config", "head_config"],
)


DRAFTS_HELP = (
    "the drafter's proposals: spread (each depth its own random distribution, as a trained drafter's positions have: "
    "`k26_model.SpreadDraftsDrafter`) or model (the random drafter's own, which repeat one token along the chain, so "
    "its verify rows read few experts: every run before 1031e46)"
)


def drafter_class(drafts: str) -> type[DFlashDrafter]:
    """The benchmarks' random-weight drafter class for `drafts` (DRAFTS): "spread" SpreadDraftsDrafter, "model" the
    plain DFlashDrafter; ValueError naming any other value (call it before building weights: it checks up front)."""
    if drafts not in DRAFTS:
        raise ValueError(f"drafts must be one of {DRAFTS}, got {drafts!r}")
    return SpreadDraftsDrafter if drafts == "spread" else DFlashDrafter


SPREAD_SCALE = 4.0  # std of the random logits: the top token of 20,480 takes a fifth to a quarter of the mass
OWN_WEIGHT = 1e-3  # the drafter's own logits, kept (not dead code) but far below the random ones


def spread_logits(logits: jax.Array, lengths: jax.Array, seed: int = 0) -> jax.Array:
    """float32 logits [B, L, V] -> OWN_WEIGHT * logits + SPREAD_SCALE * standard normal [B, L, V], drawn from a key
    folded with the context lengths (int32 [B], the drafter's), so each step, row and depth has its own distribution."""
    key = jax.random.fold_in(jax.random.key(seed), jnp.sum(lengths.astype(jnp.int32)))
    noise = jax.random.normal(key, logits.shape, jnp.float32) * SPREAD_SCALE
    return (logits * OWN_WEIGHT + noise).astype(logits.dtype)
