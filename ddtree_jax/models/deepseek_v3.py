"""The DeepSeek-V3 / Kimi K2.x target: MLA attention, dense first layers, sigmoid-routed MoE.

`forward_logits` is the plain reference (expanded K/V over the sequence). `prefill` / `tree_forward` run
the absorbed form over a latent cache (kv_lora_rank + qk_rope_head_dim values per token and layer,
one shared KV head), tested against the reference; `commit` from models.cache applies unchanged.
The MoE block (routing and the expert dispatches) lives in models.moe: `forward_logits` uses
`moe_reference` (every expert evaluated), `prefill` / `tree_forward` an efficient dispatch (`moe_impl`,
default "auto", `dispatch.moe_impl`: on GPU the in-place INT4 decode kernels for few tokens, else the grouped kernel;
off GPU gather for few tokens, else the every-expert form; "ragged" on request).

Parameters: a dict with two stacks, "dense_layers" (the first `first_k_dense_replace` layers) and
"moe_layers", each with a leading "layers" axis; `param_axes` names every axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import dispatch
from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.dispatch import MOE_IMPLS  # noqa: F401  (re-exported)
from ddtree_jax.models.attention import (
    HeadRows,
    attention,
    blockwise_attention,
    pack_tree_mask,
    sharded_absorb,
    sharded_causal_attention,
    sharded_mla_attention,
)
from ddtree_jax.models.cache import (
    KVCache,
    append_positions_and_mask,
    check_pass,
    tree_cache_mask,
    write_layer_rows,
    write_rows,
)
from ddtree_jax.models.layers import (
    apply_rope_interleaved,
    axes_of,
    contract,
    init_from_shapes,
    linear,
    rms_norm,
    rope_cos_sin,
    stacked,
    swiglu,
    yarn_mscale,
)
from ddtree_jax.models.moe import EXPERT_AXES, LayerOf, moe, moe_reference, route  # noqa: F401  (route re-exported)
from ddtree_kernels.quant import dense


def _attention_shapes(c: DeepSeekV3Config) -> dict:
    shapes = {
        "input_norm": ((c.hidden_size,), ("embed",)),
        "kv_a_proj": ((c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size), ("kv_lora", "embed")),
        "kv_a_norm": ((c.kv_lora_rank,), ("kv_lora",)),
        "kv_b_proj": ((c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), ("q_heads", "kv_lora")),
        "o_proj": ((c.hidden_size, c.num_heads * c.v_head_dim), ("embed", "q_heads")),
        "post_norm": ((c.hidden_size,), ("embed",)),
    }
    if c.q_lora_rank is None:
        shapes["q_proj"] = ((c.num_heads * c.qk_head_dim, c.hidden_size), ("q_heads", "embed"))
    else:
        shapes["q_a_proj"] = ((c.q_lora_rank, c.hidden_size), ("q_lora", "embed"))
        shapes["q_a_norm"] = ((c.q_lora_rank,), ("q_lora",))
        shapes["q_b_proj"] = ((c.num_heads * c.qk_head_dim, c.q_lora_rank), ("q_heads", "q_lora"))
    return shapes


def param_shapes(config: DeepSeekV3Config) -> dict:
    c = config
    dense = {
        **_attention_shapes(c),
        "gate_proj": ((c.intermediate_size, c.hidden_size), ("mlp", "embed")),
        "up_proj": ((c.intermediate_size, c.hidden_size), ("mlp", "embed")),
        "down_proj": ((c.hidden_size, c.intermediate_size), ("embed", "mlp")),
    }
    e, i, shared = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
    moe_layer = {
        **_attention_shapes(c),
        "router": ((e, c.hidden_size), ("experts", "embed")),
        "router_bias": ((e,), ("experts",)),
        "expert_gate": ((e, i, c.hidden_size), EXPERT_AXES["expert_gate"]),
        "expert_up": ((e, i, c.hidden_size), EXPERT_AXES["expert_up"]),
        "expert_down": ((e, c.hidden_size, i), EXPERT_AXES["expert_down"]),
        "shared_gate": ((shared, c.hidden_size), ("mlp", "embed")),
        "shared_up": ((shared, c.hidden_size), ("mlp", "embed")),
        "shared_down": ((c.hidden_size, shared), ("embed", "mlp")),
    }
    shapes = {
        "embed": ((c.vocab_size, c.hidden_size), ("vocab", "embed")),
        "dense_layers": stacked(dense, c.first_k_dense_replace),
        "moe_layers": stacked(moe_layer, c.num_moe_layers),
        "final_norm": ((c.hidden_size,), ("embed",)),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((c.vocab_size, c.hidden_size), ("vocab", "embed"))
    return shapes


def param_axes(config: DeepSeekV3Config) -> dict:
    return axes_of(param_shapes(config))


def init_params(
    config: DeepSeekV3Config, key: jax.Array, dtype=jnp.float32, norm_jitter: float = 0.0, skip: tuple[str, ...] = ()
) -> dict:
    """Random parameters; the router correction bias is drawn too (normal * 0.3) so tests exercise it.
    skip: per-layer parameter names (e.g. the routed experts) left out of both layer stacks, for a caller
    that initialises them another way (never materialised here, so never in device memory)."""
    shapes = param_shapes(config)
    for stack in ("dense_layers", "moe_layers"):
        shapes[stack] = {name: leaf for name, leaf in shapes[stack].items() if name not in skip}
    params = init_from_shapes(shapes, key, dtype, norm_jitter)
    if config.num_moe_layers and "router_bias" not in skip:
        bias_key = jax.random.fold_in(key, 1)
        params["moe_layers"]["router_bias"] = 0.3 * jax.random.normal(
            bias_key, params["moe_layers"]["router_bias"].shape
        )
    return params


def rope_tables_half(config: DeepSeekV3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [..., qk_rope_head_dim / 2], YaRN's attention factor applied (as HF)."""
    return rope_cos_sin(positions, config.qk_rope_head_dim, config)


def softmax_scale(config: DeepSeekV3Config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (the mscale correction)."""
    scale = config.qk_head_dim**-0.5
    if config.rope_type == "yarn" and config.rope_mscale_all_dim:
        scale *= yarn_mscale(config.rope_factor, config.rope_mscale_all_dim) ** 2
    return scale


def _mla_inputs(config: DeepSeekV3Config, p: dict, x, cos, sin):
    """The per-token MLA projections both forms share: the query q [B, T, H, nope + rope] before rope (its nope
    part q[..., :nope] is used as it is; a kernel may read it from q in place), roped q_rot [B, T, H, rope],
    the normalised latent [B, T, kv_lora] and the roped shared key k_rot [B, T, 1, rope]."""
    c = config
    if not c.rope_interleave:
        raise NotImplementedError("rope_interleave = false is not implemented")
    batch, steps, _ = x.shape
    if c.q_lora_rank is None:
        q = linear(x, p["q_proj"])
    else:
        q = linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], c.rms_norm_eps), p["q_b_proj"])
    q = q.reshape(batch, steps, c.num_heads, c.qk_head_dim)
    q_rot = apply_rope_interleaved(q[..., c.qk_nope_head_dim :], cos, sin)
    compressed = linear(x, p["kv_a_proj"])
    latent = rms_norm(compressed[..., : c.kv_lora_rank], p["kv_a_norm"], c.rms_norm_eps)
    k_rot = apply_rope_interleaved(compressed[..., c.kv_lora_rank :][:, :, None, :], cos, sin)
    return q, q_rot, latent, k_rot


def _mla_naive(config: DeepSeekV3Config, p: dict, x, cos, sin, mask):
    """Expanded-K/V multi-head latent attention over the sequence itself (the reference form)."""
    c = config
    batch, steps, _ = x.shape
    q, q_rot, latent, k_rot = _mla_inputs(c, p, x, cos, sin)
    q_nope = q[..., : c.qk_nope_head_dim]
    kv = linear(latent, p["kv_b_proj"]).reshape(batch, steps, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, k_nope.shape[:-1] + (c.qk_rope_head_dim,))], axis=-1)
    query = jnp.concatenate([q_nope, q_rot], axis=-1)
    out = attention(query, k, v, mask, scale=softmax_scale(c))
    return linear(out.reshape(batch, steps, c.num_heads * c.v_head_dim), p["o_proj"])


def forward_logits(config: DeepSeekV3Config, params: dict, input_ids: jax.Array) -> jax.Array:
    """Plain causal forward (expanded MLA, reference MoE): int32 [B, T] -> float32 logits [B, T, V]."""
    c = config
    batch, steps = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
    cos, sin = rope_tables_half(c, positions)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (batch, steps, steps))
    h = params["embed"][input_ids]
    for stack, count in (("dense_layers", c.first_k_dense_replace), ("moe_layers", c.num_moe_layers)):
        for layer in range(count):
            p = jax.tree.map(lambda w: w[layer], params[stack])
            h = h + _mla_naive(c, p, rms_norm(h, p["input_norm"], c.rms_norm_eps), cos, sin, mask)
            x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
            h = h + (
                swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"])
                if stack == "dense_layers"
                else moe_reference(c, p, x)
            )
    h = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    head = params["embed"] if c.tie_word_embeddings else params["lm_head"]
    return linear(h, head).astype(jnp.float32)


# --- the absorbed (latent-cache) path: prefill / verify over a per-row cache -------------------------------


def _check_matmul_impl(matmul_impl: str) -> None:
    """This family takes matmul_impl "xla" / "auto" only: its dense projections run in XLA, except those its layer
    scan reads in place on GPU (`dispatch.stacked_in_place`, the skinny Mosaic kernel; governed by
    `dispatch.AUTO_IN_PLACE` like the routed experts' in-place reads, whatever matmul_impl says); its routed
    experts have moe_impl."""
    if matmul_impl not in ("xla", "auto"):
        raise NotImplementedError(
            f"matmul_impl={matmul_impl!r} is not wired into the DeepSeek-V3 family yet; "
            "use moe_impl='pallas' for the INT4 experts"
        )


def create_cache(config: DeepSeekV3Config, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """The MLA latent cache: `k` holds the normalised latent [layers, B, S, 1, kv_lora_rank] and `v`
    the roped shared key [layers, B, S, 1, qk_rope_head_dim]: kv_lora_rank + qk_rope_head_dim values
    per token and layer (576 for K2), one shared KV head."""
    shape = (config.num_layers, batch, capacity, 1)
    return KVCache(
        jnp.zeros(shape + (config.kv_lora_rank,), dtype),
        jnp.zeros(shape + (config.qk_rope_head_dim,), dtype),
        jnp.zeros((batch,), jnp.int32),
    )


def embedding(params: dict) -> jax.Array:
    return params["embed"]


def head(config: DeepSeekV3Config, params: dict) -> jax.Array:
    return params["embed"] if config.tie_word_embeddings else params["lm_head"]


def mla_absorbed(
    config: DeepSeekV3Config,
    p: dict,
    x,
    cos,
    sin,
    latent_cache,
    rope_cache,
    write_start,
    mask,
    attn_impl: str = "xla",
    form: str = "auto",
    layer=None,
    causal_start=None,
    packed_mask=None,
):
    """MLA over the latent cache. Absorbed form: W_UK folded into the query, attention over [latent ; rope
    key] with one shared KV head and the latent as value, W_UV after. Expanded form (`dispatch.mla_form`:
    long prefill chunks): per-head keys [W_UK latent ; rope key] and values W_UV latent, expanded from the
    cache one key block at a time under "blockwise". Writes this step's latent / rope key into the caches
    first; both forms read the same cache.

    x [B, T, hidden] (normed), one layer's p, cos / sin from `rope_tables_half`, latent_cache
    [B, S, 1, kv_lora_rank], rope_cache [B, S, 1, qk_rope_head_dim], write_start int32 [B] (the first row
    written), mask bool [B, T, S] -> (out [B, T, hidden], latent_cache, rope_cache). With `layer` (an int
    or int32 scalar) the caches are the stacks of all layers, [L, B, S, 1, ...]: the new rows are scattered
    into layer `layer` in place (`write_layer_rows`) and the stacks returned. causal_start int32 [B] or None:
    the caller states mask[b, t, s] == (s <= causal_start[b] + t) (a prefill chunk), so the expanded form may
    run on the causal flash-attention kernel (`attention`'s causal_start). packed_mask: `pack_tree_mask(mask)`,
    packed once for every layer by the caller (`_run`), for the Mosaic GPU kernel (unused by the other paths)."""
    c = config
    batch, steps, _ = x.shape
    q, q_rot, latent, k_rot = _mla_inputs(c, p, x, cos, sin)
    latent = latent[:, :, None, :]
    if layer is None:
        latent_cache = write_rows(latent_cache, latent, write_start)
        rope_cache = write_rows(rope_cache, k_rot, write_start)
        out = _mla_attend(
            c, p, x, q, q_rot, latent_cache, rope_cache, mask, attn_impl, form, causal_start, None, packed_mask
        )
        return out, latent_cache, rope_cache
    latent_stack = write_layer_rows(latent_cache, layer, latent, write_start)
    rope_stack = write_layer_rows(rope_cache, layer, k_rot, write_start)
    out = _mla_attend(
        c, p, x, q, q_rot, latent_stack, rope_stack, mask, attn_impl, form, causal_start, layer, packed_mask
    )
    return out, latent_stack, rope_stack


def _mla_attend(
    c,
    p,
    x,
    q,
    q_rot,
    latent_cache,
    rope_cache,
    mask,
    attn_impl,
    form,
    causal_start=None,
    layer=None,
    packed_mask=None,
):
    """`mla_absorbed`'s attention over one layer's written caches -> out [B, T, hidden]. q [B, T, H, nope + rope]
    the query before rope (`_mla_inputs`), q_rot its roped part. With `layer` the caches are every layer's stacks
    [L, B, S, 1, ...]: the Mosaic kernel reads the layer in place, the other paths slice it out
    (`sharded_mla_attention`)."""
    batch, steps, _ = x.shape
    q_nope = q[..., : c.qk_nope_head_dim]

    def one_layer(cache):
        return cache if layer is None else jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False)

    kv_b = p["kv_b_proj"]  # a LayerOf where the scan passes it stacked (`dispatch.head_kernels_in_place`)
    kv_b_layer = kv_b.get() if isinstance(kv_b, LayerOf) else kv_b
    w_kv = dense(kv_b_layer, x.dtype).reshape(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = w_kv[:, : c.qk_nope_head_dim], w_kv[:, c.qk_nope_head_dim :]
    shape = dict(
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
    )
    if dispatch.mla_form(form, queries=steps, **shape) == "expanded":
        latent_cache, rope_cache = one_layer(latent_cache), one_layer(rope_cache)
        out = _mla_expanded(c, q_nope, q_rot, latent_cache, rope_cache, w_uk, w_uv, mask, attn_impl, causal_start)
        return linear(out.reshape(batch, steps, c.num_heads * c.v_head_dim), p["o_proj"])
    float32 = q.dtype == jnp.float32 or latent_cache.dtype == jnp.float32
    impl = dispatch.attention_impl(
        attn_impl,
        queries=steps,
        keys=latent_cache.shape[-3],
        mla=True,
        float32=float32,
        mla_dims=(c.kv_lora_rank, c.qk_rope_head_dim),
    )
    absorb, merge_up = (
        _head_kernels(c, kv_b_layer, q, latent_cache, rope_cache, q_rot) if impl == "pallas" else (False, False)
    )
    reduce = batch * steps <= dispatch.MLA_REDUCE_MAX_ROWS  # the products as reductions (dispatch's note)
    if absorb:  # q_nope . W_UK in one launch, read from q and kv_b_proj in place
        q_latent = sharded_absorb(q, HeadRows(kv_b, offset=0, width=c.qk_nope_head_dim), q_width=c.kv_lora_rank)
    elif reduce:
        q_latent = _absorb_query(q_nope, w_uk)
    else:
        q_latent = contract("bthn,hnr->bthr", q_nope, w_uk)  # [B, T, H, r]
    if impl == "pallas":  # the two key parts as they are: no [latent ; rope] copy; values the latent part
        out = sharded_mla_attention(
            q_latent,
            q_rot.astype(q_latent.dtype),
            latent_cache,
            rope_cache,
            mask,
            scale=softmax_scale(c),
            layer=layer,
            packed_mask=packed_mask,
            # merge_up: W_UV applied in the merge of the kernel's splits (one launch), kv_b_proj's rows in place
            up=HeadRows(kv_b, offset=c.qk_nope_head_dim, width=c.v_head_dim) if merge_up else None,
        )
        if merge_up:  # out [B, T, H, v]
            return linear(out.reshape(batch, steps, c.num_heads * c.v_head_dim), p["o_proj"])
        out_latent = out
    else:
        latent_cache, rope_cache = one_layer(latent_cache), one_layer(rope_cache)
        query = jnp.concatenate([q_latent, q_rot.astype(q_latent.dtype)], axis=-1)
        keys = jnp.concatenate([latent_cache, rope_cache], axis=-1).astype(query.dtype)  # [B, S, 1, kv_lora + rope]
        blockwise = dispatch.attention_impl(attn_impl, queries=steps, keys=keys.shape[1], mla=True) == "blockwise"
        out_latent = attention(
            query,
            keys,
            latent_cache.astype(query.dtype),
            mask,
            scale=softmax_scale(c),
            impl="blockwise" if blockwise else "xla",
        )
    out = _expand_values(out_latent, w_uv) if reduce else contract("bthr,hvr->bthv", out_latent, w_uv)
    return linear(out.reshape(batch, steps, c.num_heads * c.v_head_dim), p["o_proj"])


def _head_kernels(c, kv_b, q, latent_cache, rope_cache, q_rot) -> tuple[bool, bool]:
    """(absorb, merge_up): whether this absorbed-MLA call takes W_UK's / W_UV's products in `head_projections`'
    kernels around the Mosaic kernel (`dispatch.mla_head_kernels`; the Mosaic check on every operand's dtype, as
    `sharded_mla_attention` makes it). kv_b: this layer's kv_b_proj (its dtype)."""
    bfloat16 = all(a.dtype == jnp.bfloat16 for a in (q, latent_cache, rope_cache, q_rot))
    mosaic = dispatch.mla_attention_kernel(bfloat16=bfloat16, dims=(c.kv_lora_rank, q_rot.shape[-1])) == "mosaic"
    weight_bfloat16 = isinstance(kv_b, jax.Array) and kv_b.dtype == jnp.bfloat16
    return dispatch.mla_head_kernels(
        mosaic=mosaic, weight_bfloat16=weight_bfloat16, nope=c.qk_nope_head_dim, width=c.v_head_dim
    )


def _absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """q_nope [B, T, H, nope] . W_UK [H, nope, r] -> [B, T, H, r] as a broadcast product summed over nope (float32
    accumulation, q_nope's dtype out): a column reduction reading W_UK as stored."""
    product = q_nope.astype(jnp.float32)[..., :, None] * w_uk.astype(jnp.float32)
    return product.sum(axis=-2).astype(q_nope.dtype)


def _expand_values(out_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """out_latent [B, T, H, r] . W_UV [H, v, r]^T -> [B, T, H, v] as a broadcast product summed over r (float32
    accumulation): a row reduction reading W_UV as stored."""
    product = out_latent.astype(jnp.float32)[..., None, :] * w_uv.astype(jnp.float32)
    return product.sum(axis=-1).astype(out_latent.dtype)


def _mla_expanded(config, q_nope, q_rot, latent_cache, rope_cache, w_uk, w_uv, mask, attn_impl, causal_start=None):
    """The expanded form over the cache: queries [q_nope ; q_rot] [B, T, H, nope + rope] against per-head keys
    [W_UK latent ; rope key] and values W_UV latent -> [B, T, H, v]. Under "blockwise" the keys and values
    are expanded one key block at a time (never [B, S, H, nope + rope + v] at once); on the causal kernel
    (a prefill chunk, `dispatch.prefill_attention_kernel`) they are expanded whole, [B, S, H, nope + rope]
    and [B, S, H, v] (one layer's at a time: 1.3 GB at 32k keys and 64 heads, 168 MB for a TP8 shard's 8
    heads), and the kernel reads only the blocks at or below each query tile's diagonal."""
    c = config
    dtype = q_nope.dtype
    query = jnp.concatenate([q_nope, q_rot.astype(dtype)], axis=-1)
    cache = jnp.concatenate([latent_cache, rope_cache], axis=-1).astype(dtype)  # [B, S, 1, kv_lora + rope]

    def expand(block, _):
        latent, rope = block[:, :, 0, : c.kv_lora_rank], block[:, :, :, c.kv_lora_rank :]
        k_nope = contract("bsr,hnr->bshn", latent, w_uk)
        keys = jnp.concatenate([k_nope, jnp.broadcast_to(rope, k_nope.shape[:-1] + rope.shape[-1:])], axis=-1)
        return keys, contract("bsr,hvr->bshv", latent, w_uv)

    if causal_start is not None:
        kernel = dispatch.prefill_attention_kernel(
            attn_impl,
            queries=q_nope.shape[1],
            keys=cache.shape[1],
            key_dim=query.shape[-1],
            value_dim=c.v_head_dim,
            bfloat16=dtype == jnp.bfloat16,
            mla=True,
        )
        if kernel == "mosaic":
            keys, values = expand(cache, None)
            return sharded_causal_attention(query, keys, values, causal_start, scale=softmax_scale(c))
    impl = dispatch.attention_impl(attn_impl, queries=q_nope.shape[1], keys=cache.shape[1], mla=True)
    if impl == "blockwise":
        return blockwise_attention(query, cache, cache, mask, scale=softmax_scale(c), expand=expand)
    keys, values = expand(cache, None)
    return attention(query, keys, values, mask, scale=softmax_scale(c), impl="xla")


LAYER_LOOPS = ("scan", "unrolled")


def _run(
    config: DeepSeekV3Config,
    params,
    tokens,
    positions,
    mask,
    cache: KVCache,
    write_start,
    moe_impl: str,
    attn_impl: str = "xla",
    layer_loop: str = "scan",
    head_rows=None,
    causal_start=None,
):
    """Embeds, runs the dense then the MoE layers, returns (logits f32, tapped [B, T, F*D], cache).
    head_rows int32 [B] (or None): the LM head runs only at that position of each row (logits [B, 1, V]).
    causal_start int32 [B] (or None): mask is causal at that offset (a prefill; `mla_absorbed`).

    layer_loop "scan": `lax.scan` over each stack of layers (the stacked parameters as scanned inputs, the
    stacked caches in the carry, each layer's new rows scattered into them in place): the program holds
    one layer of each kind, so 61 layers compile in about the time of two. "unrolled": a Python loop (one
    copy of the layer per layer in the program).
    """
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    c = config
    cos, sin = rope_tables_half(c, positions)
    h = params["embed"][tokens]
    # the mask in the Mosaic MLA kernel's form, once for every layer (inside the layer scan XLA repacked it in
    # each layer); dead code, removed by XLA, where no layer runs that kernel
    packed_mask = pack_tree_mask(mask)

    def layer_fn(kind):
        def step(carry, inputs):  # carry (h, latent stack [L, B, S, 1, r], rope stack); inputs (p, layer)
            h, latent_all, rope_all = carry
            p, layer = inputs
            attn, latent_all, rope_all = mla_absorbed(
                c,
                p,
                rms_norm(h, p["input_norm"], c.rms_norm_eps),
                cos,
                sin,
                latent_all,
                rope_all,
                write_start,
                mask,
                attn_impl,
                layer=layer,
                causal_start=causal_start,
                packed_mask=packed_mask,
            )
            h = h + attn
            x = rms_norm(h, p["post_norm"], c.rms_norm_eps)
            h = h + (
                swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"])
                if kind == "dense_layers"
                else moe(c, p, x, impl=moe_impl)
            )
            return (h, latent_all, rope_all), h

        return step

    # the stacked caches ride in the carry and each layer scatters its new rows into them in place (no
    # per-layer cache slices scanned in and restacked: that copied every layer's cache each step)
    carry = (h, cache.k, cache.v)
    outputs = []
    first = 0
    for kind, count in (("dense_layers", c.first_k_dense_replace), ("moe_layers", c.num_moe_layers)):
        if not count:
            continue
        # the routed experts stay stacked (loop invariants) and reach the layer as LayerOf(stack, layer): the
        # grouped kernel reads its layer in place instead of a per-layer slice copy (models/moe.py); so do the
        # dense projections `dispatch.stacked_in_place` names (read in place by `linear`)
        in_place = [
            name
            for name in params[kind]
            if dispatch.stacked_in_place(name, tokens.size) or dispatch.head_kernels_in_place(name)
        ]
        stacks = {name: params[kind][name] for name in (*EXPERT_AXES, *in_place) if name in params[kind]}
        rest = {name: value for name, value in params[kind].items() if name not in stacks}
        xs = (rest, jnp.arange(count, dtype=jnp.int32))
        # a projection's logical axes (its spec under a mesh, `layers._linear_in_place`); the experts' are theirs
        layer_axes = param_axes(c)[kind] if in_place else {}
        axes = {name: layer_axes[name][1:] for name in in_place}

        def step(carry, inputs, kind=kind, stacks=stacks, first=first, axes=axes):
            p, layer = inputs
            p = {**p, **{name: LayerOf(stack, layer, axes.get(name)) for name, stack in stacks.items()}}
            return layer_fn(kind)(carry, (p, first + layer))

        if layer_loop == "scan":
            carry, hs = jax.lax.scan(step, carry, xs)
        else:
            per_layer = []
            for layer in range(count):
                carry, out = step(carry, (jax.tree.map(lambda a: a[layer], xs[0]), layer))
                per_layer.append(out)
            hs = jnp.stack(per_layer)
        outputs.append(hs)  # [count, B, T, D]: each layer's output, for the tapped features
        first += count
    h, latent_all, rope_all = carry
    layer_outputs = jnp.concatenate(outputs) if outputs else None
    tapped = [layer_outputs[layer] for layer in c.tapped_layers]
    features = jnp.concatenate(tapped, axis=-1) if tapped else jnp.zeros(h.shape[:2] + (0,), h.dtype)
    if head_rows is not None:
        h = jnp.take_along_axis(h, head_rows[:, None, None], axis=1)
    logits = linear(rms_norm(h, params["final_norm"], c.rms_norm_eps), head(c, params)).astype(jnp.float32)
    return logits, features, KVCache(latent_all, rope_all, cache.lengths)


def prefill(
    config: DeepSeekV3Config,
    params: dict,
    cache: KVCache,
    input_ids: jax.Array,
    num_new: jax.Array,
    *,
    attn_impl: str = "xla",
    moe_impl: str = "auto",
    matmul_impl: str = "xla",
    layer_loop: str = "scan",
    head_rows: jax.Array | None = None,
):
    """Causal pass appending input_ids [B, T] (row b: num_new[b] real) -> (logits, tapped, cache with lengths += num_new).
    head_rows int32 [B] (or None): the logits [B, 1, V] of only that position of each row.
    moe_impl: models.moe.MOE_IMPLS ("auto": `dispatch.moe_impl`; off GPU gather while B * T * k <= n_routed_experts,
      else reference);
    attn_impl: models.attention's ("pallas": kernels/tree_attention with the latent and rope key parts);
    layer_loop: "scan" (default; 61 layers compile like 2) or "unrolled" (see `_run`)."""
    _check_matmul_impl(matmul_impl)
    steps = input_ids.shape[1]
    check_pass(cache, steps, num_new=num_new, token_ids=input_ids, vocab=config.vocab_size, head_rows=head_rows)
    start = cache.lengths
    positions, mask = append_positions_and_mask(cache, steps)
    logits, features, cache = _run(
        config,
        params,
        input_ids,
        positions,
        mask,
        cache,
        start,
        moe_impl,
        attn_impl,
        layer_loop,
        head_rows,
        causal_start=start,
    )
    return logits, features, KVCache(cache.k, cache.v, start + num_new)


def tree_forward(
    config: DeepSeekV3Config,
    params: dict,
    cache: KVCache,
    tokens: jax.Array,
    depths: jax.Array,
    tree_mask: jax.Array,
    *,
    attn_impl: str = "xla",
    moe_impl: str = "auto",
    matmul_impl: str = "xla",
    layer_loop: str = "scan",
):
    """The tree-verify pass, as `qwen3.tree_forward`: slot i at position lengths + depth, latent row lengths + i."""
    _check_matmul_impl(matmul_impl)
    slots = tokens.shape[1]
    check_pass(cache, slots, token_ids=tokens, vocab=config.vocab_size, tree_mask=tree_mask)
    start = cache.lengths
    mask = tree_cache_mask(cache, tree_mask)
    return _run(config, params, tokens, start[:, None] + depths, mask, cache, start, moe_impl, attn_impl, layer_loop)
