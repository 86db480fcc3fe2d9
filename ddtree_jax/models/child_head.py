"""A path-conditioned child head (issue #23): each draft-tree node's own child distribution.

DFlash's single pass gives the marginal of every depth: the logits at depth j are lm_head(h_j), h_j the
drafter's final-normed hidden state at block position j, and every node at depth j - 1 gets its children from
them, whatever its token. The head conditions the children on their parent's token t:

    g(h_j, t) = h_j + W_out silu(W_in [h_j ; embed[t]]),   children's logits = lm_head(g(h_j, t))

with the target's (frozen) embedding and LM head, as the drafter uses them. W_out starts at zero, so an
untrained head is exactly the marginal drafter (a test builds the same tree with it as `build_tree`).

  param_shapes / param_axes / init_params   the parameters ({name: (shape, logical axes)}, as the models')
  child_hidden                              g for hidden states and parent tokens
  head_child_logits                         the `tree.conditional.ChildLogitsFn` the builder calls per depth
                                            (bind the config with functools.partial: a hashable static)
  HeadInputs                                what it reads: the head's parameters, the draft pass's hidden
                                            states [B, L, D] (`dflash.draft(..., return_hidden=True)`), the
                                            target's embedding and LM head
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.models.layers import axes_of, init_from_shapes, linear


def param_shapes(config: ChildHeadConfig) -> dict:
    """{name: (shape, logical axes)}, weights in the [out, in] layout."""
    c = config
    return {
        "in_proj": ((c.inner_size, 2 * c.hidden_size), ("mlp", "features")),
        "out_proj": ((c.hidden_size, c.inner_size), ("embed", "mlp")),
    }


def param_axes(config: ChildHeadConfig) -> dict:
    return axes_of(param_shapes(config))


def init_params(config: ChildHeadConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """in_proj normal(0, 0.02), out_proj zero: the untrained head is the marginal drafter."""
    params = init_from_shapes(param_shapes(config), key, dtype)
    return {**params, "out_proj": jnp.zeros_like(params["out_proj"])}


def child_hidden(config: ChildHeadConfig, params: dict, hidden: jax.Array, parent_embeddings: jax.Array) -> jax.Array:
    """g(h, t) = h + W_out silu(W_in [h ; e_t]): hidden [..., D] (the children's depth), parent_embeddings
    [..., D] (their parent's token) -> [..., D] in hidden's dtype."""
    if hidden.shape[-1] != config.hidden_size or parent_embeddings.shape[-1] != config.hidden_size:
        raise ValueError(
            f"hidden and parent embeddings must end in hidden_size = {config.hidden_size}, got "
            f"{hidden.shape} and {parent_embeddings.shape}"
        )
    x = jnp.concatenate([hidden, parent_embeddings.astype(hidden.dtype)], axis=-1)
    return hidden + linear(jax.nn.silu(linear(x, params["in_proj"])), params["out_proj"]).astype(hidden.dtype)


@dataclasses.dataclass(frozen=True)
class HeadInputs:
    """The traced inputs of `head_child_logits`.

    Attributes:
      params: the head's parameters (`init_params`).
      hidden: [B, L, D] the draft pass's final-normed hidden states (depth j at index j - 1).
      embed: [V, D] the target's embedding; lm_head: [V, D] its LM head.
    """

    params: dict
    hidden: jax.Array
    embed: jax.Array
    lm_head: jax.Array


jax.tree_util.register_dataclass(HeadInputs, data_fields=["params", "hidden", "embed", "lm_head"], meta_fields=[])


def head_child_logits(config: ChildHeadConfig, inputs: HeadInputs, parent_depth: int, parent_tokens: jax.Array):
    """float32 [B, P, V]: the logits of the children (depth parent_depth + 1) of P parents per row at
    parent_depth holding parent_tokens int32 [B, P]. With `functools.partial(head_child_logits, config)` this
    is a `tree.conditional.ChildLogitsFn`."""
    batch, parents = parent_tokens.shape
    hidden = inputs.hidden[:, parent_depth]  # the children's depth parent_depth + 1: index parent_depth
    hidden = jnp.broadcast_to(hidden[:, None, :], (batch, parents, hidden.shape[-1]))
    g = child_hidden(config, inputs.params, hidden, inputs.embed[parent_tokens])
    return linear(g, inputs.lm_head).astype(jnp.float32)
