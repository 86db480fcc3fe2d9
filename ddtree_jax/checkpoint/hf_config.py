"""HF config.json -> frozen configs. Both rope layouts (older `rope_theta` + `rope_scaling`, newer
`rope_parameters`) and DFlash drafter configs (`dflash_config`: block_size, mask_token_id,
target_layer_ids; `num_target_layers` for the default layer choice)."""

from __future__ import annotations

import json
import os

from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config, default_tapped_layers

SUPPORTED_TARGETS = ("qwen3", "deepseek_v3", "kimi_k2", "kimi_k25")
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2")


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(file) as f:
        return json.load(f)


def _rope(cfg: dict) -> float:
    params = cfg.get("rope_parameters")
    if params is not None:  # newer layout
        kind, theta = params.get("rope_type", "default"), params.get("rope_theta")
    else:  # older layout
        scaling = cfg.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        theta = cfg.get("rope_theta")
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported for this model family (only 'default')")
    if theta is None:
        raise ValueError("config has no rope_theta (neither top-level nor in rope_parameters)")
    return float(theta)


def _common(cfg: dict) -> dict:
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias = true is not supported (Qwen3 has no attention biases)")
    if cfg.get("use_sliding_window", False):
        raise ValueError("use_sliding_window = true is not supported (full attention only)")
    num_heads = cfg["num_attention_heads"]
    return dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope(cfg),
    )


def is_dflash(cfg: dict) -> bool:
    return "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures", []))


def parse_config(cfg: dict) -> Qwen3Config | DFlashConfig:
    """A target (Qwen3Config) or a DFlash drafter (DFlashConfig) from a config.json dict."""
    model_type = cfg.get("model_type")
    if is_dflash(cfg):
        if model_type != "qwen3":
            raise ValueError(f"DFlash drafters with model_type {model_type!r} are not supported (only Qwen3-style layers)")
        extra = cfg.get("dflash_config", {})
        if any(k in extra for k in ("conv_kernel_size", "selector_top_k")):
            raise ValueError("this DFlash variant (convolutions / candidate selector) is not supported")
        rope = _rope_parameters(cfg)
        if rope["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported for DFlash drafters (default, yarn)")
        common = _common({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": rope["rope_theta"]}})
        common.update(_yarn_fields(rope))
        layers = extra.get("target_layer_ids")
        if layers is None:
            if "num_target_layers" not in cfg:
                raise ValueError("DFlash config needs dflash_config.target_layer_ids or num_target_layers")
            layers = default_tapped_layers(cfg["num_target_layers"], common["num_layers"])
        block = extra.get("block_size", cfg.get("block_size"))
        mask = extra.get("mask_token_id", cfg.get("mask_token_id"))
        if block is None or mask is None:
            raise ValueError("DFlash config needs block_size and mask_token_id (in dflash_config or top level)")
        return DFlashConfig(**common, block_size=int(block), mask_token_id=int(mask), target_layers=tuple(int(l) for l in layers))
    if model_type == "kimi_k25":  # the multimodal wrapper: the text model sits in text_config
        if "text_config" not in cfg:
            raise ValueError("kimi_k25 config without a text_config")
        return parse_config(cfg["text_config"])
    if model_type in DEEPSEEK_FAMILY:
        return _deepseek(cfg)
    if model_type == "qwen3":
        return Qwen3Config(
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            **_common(cfg),
        )
    raise ValueError(f"unknown model_type {model_type!r}; supported: {SUPPORTED_TARGETS} and DFlash drafters")


def to_hf_dict(config: Qwen3Config | DFlashConfig, vocab_size: int | None = None) -> dict:
    """The inverse of parse_config (newer rope layout), for writing HF directories."""
    base = {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": _rope_dict(config),
        "attention_bias": False,
        "hidden_act": "silu",
    }
    if isinstance(config, DFlashConfig):
        return {**base, "architectures": ["DFlashDraftModel"], "vocab_size": vocab_size,
                "dflash_config": {"block_size": config.block_size, "mask_token_id": config.mask_token_id,
                                  "target_layer_ids": list(config.target_layers)}}
    return {**base, "architectures": ["Qwen3ForCausalLM"], "vocab_size": config.vocab_size,
            "tie_word_embeddings": config.tie_word_embeddings, "max_position_embeddings": config.max_position_embeddings}


def _rope_parameters(cfg: dict) -> dict:
    """One dict with rope_type / rope_theta / YaRN fields from either config layout."""
    if cfg.get("rope_parameters") is not None:
        params = dict(cfg["rope_parameters"])
    else:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta"))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _yarn_fields(rope: dict) -> dict:
    """Our rope_* config fields from an HF rope dict (either layout, after _rope_parameters)."""
    return dict(
        rope_type=rope["rope_type"], rope_factor=float(rope.get("factor", 1.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 4096)),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_mscale=float(rope.get("mscale") or 0.0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def _deepseek(cfg: dict) -> DeepSeekV3Config:
    rope = _rope_parameters(cfg)
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"rope type {rope['rope_type']!r} is not supported for DeepSeek-V3 / Kimi K2 (default, yarn)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("only sigmoid scoring with noaux_tc top-k routing is supported (DeepSeek-V3 / Kimi K2)")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias = true is not supported")
    return DeepSeekV3Config(
        expert_format=_expert_format(cfg.get("quantization_config")),
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"], num_layers=cfg["num_hidden_layers"],
        first_k_dense_replace=cfg.get("first_k_dense_replace", 0), n_routed_experts=cfg["n_routed_experts"],
        n_shared_experts=cfg.get("n_shared_experts", 0) or 0, num_experts_per_tok=cfg["num_experts_per_tok"],
        n_group=cfg.get("n_group", 1) or 1, topk_group=cfg.get("topk_group", 1) or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        num_heads=cfg["num_attention_heads"], q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]), **_yarn_fields(rope),
        rope_interleave=bool(cfg.get("rope_interleave", True)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


def _expert_format(quant: dict | None) -> str:
    """'dense', or 'int4' for compressed-tensors pack-quantized symmetric group-32 INT4 weights."""
    if not quant:
        return "dense"
    method = quant.get("quant_method")
    if method == "fp8":  # block FP8 (DeepSeek-V3, original K2): found per tensor from its weight_scale_inv
        if list(quant.get("weight_block_size", [128, 128])) != [128, 128]:
            raise ValueError(f"block-FP8 needs 128 x 128 blocks, got {quant.get('weight_block_size')}")
        return "dense"
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        for group in quant.get("config_groups", {}).values():
            w = group.get("weights", {})
            if (w.get("num_bits"), w.get("group_size"), w.get("symmetric"), w.get("type")) != (4, 32, True, "int"):
                raise ValueError(f"unsupported compressed-tensors weights {w} (need symmetric int4, group size 32)")
        return "int4"
    raise ValueError(f"unsupported quantization_config (quant_method {method!r}, format {quant.get('format')!r}); "
                     "supported: compressed-tensors pack-quantized INT4 experts, block FP8")


def _rope_dict(config) -> dict:
    out = {"rope_type": getattr(config, "rope_type", "default"), "rope_theta": config.rope_theta}
    if out["rope_type"] == "yarn":
        out.update(factor=config.rope_factor, original_max_position_embeddings=config.rope_original_max_position,
                   beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow, mscale=config.rope_mscale,
                   mscale_all_dim=config.rope_mscale_all_dim)
    return out
