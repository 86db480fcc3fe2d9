"""One device's share of a tensor-parallel model, as a model of its own.

Under a layout of `sharding.rules`, device d of an n-way "model" axis holds, of every parameter, the slice
that the rule table assigns it: a dimension whose logical axis maps to "model" is cut n ways, the others
are whole. For the TP layout of a DeepSeek-V3 / Kimi K2 target that is 1/n of the query heads (their q_b,
kv_b and o projections), the replicated q_a / kv_a projections and latent cache, 1/n of the dense FFN, of
the shared expert's and of every routed expert's FFN columns, 1/n of the vocabulary, and the whole router.
That share is itself a DeepSeek-V3 model with smaller dimensions; `tp_shard_config` builds its config and
checks, parameter by parameter, that the shard's shapes are exactly the per-device shapes the rule table
gives the full model (`per_device_shapes`), so the shard cannot drift from the real sharding. The same for
the Qwen3 family and the DFlash drafter.

What the shard model does not do is communicate: its attention and FFN outputs are one device's partial
sums (the real run all-reduces them over "model"), its logits cover its 1/n of the vocabulary, and its
embedding lookup only its rows. Its step therefore costs what one GPU of the real program computes and
reads; the collectives are priced apart.
"""

from __future__ import annotations

import dataclasses

import jax

from ddtree_jax.analysis.memory import MeshLayout, Tensor, local_shape
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.models import deepseek_v3, dflash, qwen3
from ddtree_jax.models.layers import is_shape_leaf
from ddtree_jax.sharding.rules import MODEL, RULES

# config field -> the logical axis of the parameter dimensions it sizes (models' `param_shapes`)
SHARDED_FIELDS = {
    DeepSeekV3Config: {
        "num_heads": "q_heads",
        "intermediate_size": "mlp",
        "moe_intermediate_size": ("expert_mlp", "mlp"),  # each routed expert's columns and the shared expert's
        "n_routed_experts": "experts",
        "vocab_size": "vocab",
    },
    Qwen3Config: {
        "num_heads": "q_heads",
        "num_kv_heads": "kv_heads",
        "intermediate_size": "mlp",
        "vocab_size": "vocab",
    },
    DFlashConfig: {"num_heads": "q_heads", "num_kv_heads": "kv_heads", "intermediate_size": "mlp"},
}


def _param_shapes(config, target_hidden: int | None):
    if isinstance(config, DeepSeekV3Config):
        return deepseek_v3.param_shapes(config)
    if isinstance(config, DFlashConfig):
        if target_hidden is None:
            raise ValueError("a DFlash drafter's shapes need target_hidden (the target's hidden size)")
        return dflash.param_shapes(config, target_hidden)
    if isinstance(config, Qwen3Config):
        return qwen3.param_shapes(config)
    raise TypeError(f"no shard rule for {type(config).__name__}")


def per_device_shapes(config, layout: str, model_size: int, target_hidden: int | None = None) -> dict:
    """{name: (shape, axes)} of one device's slice of every parameter of `config` under `layout` on an
    n = model_size "model" axis. ValueError naming the parameter whose sharded dimension n does not divide."""
    if layout not in RULES:
        raise ValueError(f"layout must be one of {sorted(RULES)}, got {layout!r}")
    if isinstance(model_size, bool) or not isinstance(model_size, int) or model_size < 1:
        raise ValueError(f"model_size must be an int >= 1, got {model_size!r}")
    mesh_layout = MeshLayout(layout, model_size)  # the planner's per-device split
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_param_shapes(config, target_hidden), is_leaf=is_shape_leaf)
    out = []
    for path, (shape, axes) in leaves:
        tensor = Tensor(jax.tree_util.keystr(path), shape, axes, "bf16", "")
        out.append((local_shape(tensor, mesh_layout), axes))
    return jax.tree.unflatten(treedef, out)


def tp_shard_config(config, model_size: int, *, layout: str = "tp", target_hidden: int | None = None):
    """The config of one device's share of `config` under `layout` (module docstring): each field of
    SHARDED_FIELDS whose logical axis the layout maps to "model" divided by model_size. Checks that the
    shard's parameter shapes equal `per_device_shapes` of the full model, leaf by leaf; a layout whose
    share is not a model of the same family (EP splits the routed experts, but routing stays global over
    all of them) raises NotImplementedError."""
    rules = RULES.get(layout)
    if rules is None:
        raise ValueError(f"layout must be one of {sorted(RULES)}, got {layout!r}")
    fields = SHARDED_FIELDS.get(type(config))
    if fields is None:
        raise TypeError(f"no shard rule for {type(config).__name__}")
    changes = {}
    for field, axes in fields.items():
        axes = (axes,) if isinstance(axes, str) else axes
        split = {rules[a] == MODEL for a in axes}
        if len(split) > 1 or (field == "n_routed_experts" and split == {True}):
            raise NotImplementedError(
                f"layout {layout!r} splits {field} in a way one device's share cannot express as a "
                f"{type(config).__name__} (the {'experts' if field == 'n_routed_experts' else 'axes ' + str(axes)})"
            )
        if split == {True}:
            size = getattr(config, field)
            if size % model_size:
                raise ValueError(f"{field} = {size} does not split {model_size} ways")
            changes[field] = size // model_size
    shard = dataclasses.replace(config, **changes)
    want = per_device_shapes(config, layout, model_size, target_hidden)
    got = _param_shapes(shard, target_hidden)
    if jax.tree.structure(want, is_leaf=is_shape_leaf) != jax.tree.structure(got, is_leaf=is_shape_leaf):
        raise AssertionError("the shard's parameter tree differs from the full model's")
    leaves_want = jax.tree_util.tree_flatten_with_path(want, is_leaf=is_shape_leaf)[0]
    for (path, w), g in zip(leaves_want, jax.tree.leaves(got, is_leaf=is_shape_leaf)):
        if tuple(w) != tuple(g):
            raise AssertionError(f"{jax.tree_util.keystr(path)}: shard {g} != per-device share {w}")
    return shard
