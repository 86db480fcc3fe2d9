"""HF config.json -> frozen configs. Both rope layouts (older `rope_theta` + `rope_scaling`, newer
`rope_parameters`) and DFlash drafter configs (`dflash_config`: block_size, mask_token_id,
target_layer_ids; `num_target_layers` for the default layer choice)."""

from __future__ import annotations

import json
import math
import os

from ddtree_jax.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config, default_tapped_layers

SUPPORTED_TARGETS = ("qwen3", "deepseek_v3", "kimi_k2", "kimi_k25")
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2")


class ConfigDict(dict):
    """A config.json dict that remembers the file it was read from (`source`), for error messages."""

    source: str | None = None


def read_config(path: str) -> dict:
    """The config.json of a checkpoint directory (or a config file's path) as a dict (a ConfigDict
    remembering its file); CheckpointError naming the file when it is not a JSON object."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        raise CheckpointError(
            f"{path} is a safetensors file; give the checkpoint directory that holds it "
            f"(with config.json): {os.path.dirname(path) or '.'}"
        )
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise CheckpointNotFoundError(f"no config.json at {path}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not a UTF-8 text file, so not a config.json ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file} holds a JSON {_json_type(cfg)}, not an object (a config.json is a JSON object)")
    out = ConfigDict(cfg)
    out.source = file
    return out


def _json_type(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


_REQUIRED = object()


def _absent(cfg: dict, key: str, default) -> bool:
    """True when cfg[key] is absent or null (HF's default then applies); an error if there is no default."""
    if cfg.get(key) is not None:
        return False
    if default is _REQUIRED:
        raise CheckpointError(f"{key} is missing" if key not in cfg else f"{key} is null; it must be given")
    return True


def _int(cfg: dict, key: str, default=_REQUIRED, minimum: int | None = 0):
    """cfg[key] as an int >= minimum (absent or null: default); CheckpointError naming the key and value."""
    if _absent(cfg, key, default):
        return default
    value = cfg[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise CheckpointError(f"{key} must be an integer, got {value!r} ({_json_type(value)})")
    if minimum is not None and value < minimum:
        raise CheckpointError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _float(cfg: dict, key: str, default=_REQUIRED, positive: bool = False) -> float:
    """cfg[key] as a finite float, > 0 if positive (absent or null: default); CheckpointError naming the key."""
    if _absent(cfg, key, default):
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{key} must be a number, got {value!r} ({_json_type(value)})")
    if not math.isfinite(value) or (positive and value <= 0):
        raise CheckpointError(f"{key} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _bool(cfg: dict, key: str, default: bool) -> bool:
    if _absent(cfg, key, default):
        return default
    value = cfg[key]
    if not isinstance(value, bool):
        raise CheckpointError(f"{key} must be true or false, got {value!r} ({_json_type(value)})")
    return value


def _object(cfg: dict, key: str) -> dict:
    """cfg[key] as a dict ({} when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{key} must be a JSON object, got {value!r} ({_json_type(value)})")
    return value


def _int_list(cfg: dict, key: str) -> tuple[int, ...] | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise CheckpointError(f"{key} must be a list of integers, got {value!r} ({_json_type(value)})")
    return tuple(_int({key: v}, key, minimum=0) for v in value)


def _rope(cfg: dict) -> float:
    rope = _rope_parameters(cfg)
    if rope["rope_type"] != "default":
        raise CheckpointError(
            f"rope type {rope['rope_type']!r} is not supported for this model family (only 'default')"
        )
    if rope.get("rope_theta") is None:
        raise CheckpointError("config has no rope_theta (neither top-level nor in rope_parameters)")
    return _float(rope, "rope_theta", positive=True)


SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names of SiLU, the only activation the models implement


def _check_silu(cfg: dict) -> None:
    """hidden_act must name SiLU (absent: HF's default for these models, "silu"); the models' MLPs are
    SwiGLU, so any other activation (or null) would run as SiLU silently."""
    if "hidden_act" not in cfg:
        return
    value = cfg["hidden_act"]
    if not isinstance(value, str) or value not in SILU_NAMES:
        raise CheckpointError(
            f"hidden_act {value!r} ({_json_type(value)}) is not supported; the models implement SiLU only "
            f"(hidden_act one of {SILU_NAMES})"
        )


def _common(cfg: dict) -> dict:
    _check_silu(cfg)
    _check_dense_or_fp8(cfg.get("quantization_config"))
    if _bool(cfg, "attention_bias", False):
        raise CheckpointError("attention_bias = true is not supported (Qwen3 has no attention biases)")
    if _bool(cfg, "use_sliding_window", False):
        raise CheckpointError("use_sliding_window = true is not supported (full attention only)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # transformers' per-layer attention kinds: only full attention is implemented
        if not isinstance(layer_types, list):
            raise CheckpointError(f"layer_types must be a list, got {layer_types!r} ({_json_type(layer_types)})")
        other = [(i, kind) for i, kind in enumerate(layer_types) if kind != "full_attention"]
        if other:
            raise CheckpointError(
                f"layer_types[{other[0][0]}] = {other[0][1]!r} is not supported (full attention only; "
                f"{len(other)} layer(s) are not 'full_attention')"
            )
    hidden = _int(cfg, "hidden_size", minimum=1)
    num_heads = _int(cfg, "num_attention_heads", minimum=1)
    num_kv_heads = _int(cfg, "num_key_value_heads", num_heads, minimum=1)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = _int(cfg, "head_dim", None, minimum=1)
    if head_dim is None:
        if hidden < num_heads:
            raise CheckpointError(f"no head_dim, and hidden_size ({hidden}) // num_attention_heads ({num_heads}) is 0")
        head_dim = hidden // num_heads
    return dict(
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", minimum=1),
        num_layers=_int(cfg, "num_hidden_layers", minimum=1),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6, positive=True),
        rope_theta=_rope(cfg),
    )


def _architectures(cfg: dict) -> list[str]:
    """cfg["architectures"]: a list of strings; absent or null (as transformers writes it) is []."""
    value = cfg.get("architectures")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise CheckpointError(f"architectures must be a list of class names, got {value!r}")
    return value


def is_dflash(cfg: dict) -> bool:
    return "dflash_config" in cfg or any("DFlash" in a for a in _architectures(cfg))


def parse_config(cfg: dict, source: str | None = None) -> Qwen3Config | DFlashConfig | DeepSeekV3Config:
    """A target (Qwen3Config, DeepSeekV3Config) or a DFlash drafter (DFlashConfig) from a config.json dict.

    A config that cannot be parsed (a missing or mistyped key, a bad value, an unsupported variant)
    raises CheckpointError naming `source` (default: the file `read_config` read it from) and the key.
    """
    where = source or getattr(cfg, "source", None) or "config"
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: a config must be a JSON object, got a JSON {_json_type(cfg)}")
    try:
        return _parse(cfg, where)
    except CheckpointError as e:
        if str(e).startswith(f"{where}: "):
            raise
        raise CheckpointError(f"{where}: {e}") from None
    except ValueError as e:  # a config dataclass' own check (e.g. num_heads a multiple of num_kv_heads)
        raise CheckpointError(f"{where}: {e}") from None


def _parse(cfg: dict, where: str):
    model_type = cfg.get("model_type")
    if is_dflash(cfg):
        if model_type != "qwen3":
            raise CheckpointError(
                f"DFlash drafters with model_type {model_type!r} are not supported (only Qwen3-style layers)"
            )
        extra = _object(cfg, "dflash_config")
        if any(k in extra for k in ("conv_kernel_size", "selector_top_k")):
            raise CheckpointError("this DFlash variant (convolutions / candidate selector) is not supported")
        rope = _rope_parameters(cfg)
        if rope["rope_type"] not in ("default", "yarn"):
            raise CheckpointError(
                f"rope type {rope['rope_type']!r} is not supported for DFlash drafters (default, yarn)"
            )
        common = _common({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta")}})
        common.update(_yarn_fields(rope))
        layers = _int_list(extra, "target_layer_ids")
        if layers is None:
            if cfg.get("num_target_layers") is None:
                raise CheckpointError("DFlash config needs dflash_config.target_layer_ids or num_target_layers")
            layers = default_tapped_layers(_int(cfg, "num_target_layers", minimum=1), common["num_layers"])
        block_from, mask_from = (extra if extra.get(k) is not None else cfg for k in ("block_size", "mask_token_id"))
        if block_from.get("block_size") is None or mask_from.get("mask_token_id") is None:
            raise CheckpointError("DFlash config needs block_size and mask_token_id (in dflash_config or top level)")
        return DFlashConfig(
            **common,
            block_size=_int(block_from, "block_size", minimum=2),
            mask_token_id=_int(mask_from, "mask_token_id", minimum=0),
            target_layers=tuple(layers),
        )
    if model_type == "kimi_k25":  # the multimodal wrapper: the text model sits in text_config
        if cfg.get("text_config") is None:
            raise CheckpointError("kimi_k25 config without a text_config")
        return parse_config(_object(cfg, "text_config"), f"{where} (text_config)")
    if model_type in DEEPSEEK_FAMILY:
        return _deepseek(cfg)
    if model_type == "qwen3":
        return Qwen3Config(
            vocab_size=_int(cfg, "vocab_size", minimum=1),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            max_position_embeddings=_int(cfg, "max_position_embeddings", 40960, minimum=1),
            **_common(cfg),
        )
    raise CheckpointError(f"unknown model_type {model_type!r}; supported: {SUPPORTED_TARGETS} and DFlash drafters")


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
        return {
            **base,
            "architectures": ["DFlashDraftModel"],
            "vocab_size": vocab_size,
            "dflash_config": {
                "block_size": config.block_size,
                "mask_token_id": config.mask_token_id,
                "target_layer_ids": list(config.target_layers),
            },
        }
    return {
        **base,
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
    }


def _rope_parameters(cfg: dict) -> dict:
    """One dict with rope_type / rope_theta / YaRN fields from either config layout."""
    if cfg.get("rope_parameters") is not None:
        params = dict(_object(cfg, "rope_parameters"))
    else:
        params = dict(_object(cfg, "rope_scaling"))
        params.setdefault("rope_theta", cfg.get("rope_theta"))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _yarn_fields(rope: dict) -> dict:
    """Our rope_* config fields from an HF rope dict (either layout, after _rope_parameters)."""
    return dict(
        rope_type=rope["rope_type"],
        rope_factor=_float(rope, "factor", 1.0, positive=True),
        rope_original_max_position=_int(rope, "original_max_position_embeddings", 4096, minimum=1),
        rope_beta_fast=_float(rope, "beta_fast", 32.0) or 32.0,
        rope_beta_slow=_float(rope, "beta_slow", 1.0) or 1.0,
        rope_mscale=_float(rope, "mscale", 0.0),
        rope_mscale_all_dim=_float(rope, "mscale_all_dim", 0.0),
    )


def _deepseek(cfg: dict) -> DeepSeekV3Config:
    rope = _rope_parameters(cfg)
    if rope["rope_type"] not in ("default", "yarn"):
        raise CheckpointError(
            f"rope type {rope['rope_type']!r} is not supported for DeepSeek-V3 / Kimi K2 (default, yarn)"
        )
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise CheckpointError("only sigmoid scoring with noaux_tc top-k routing is supported (DeepSeek-V3 / Kimi K2)")
    if _bool(cfg, "attention_bias", False):
        raise CheckpointError("attention_bias = true is not supported")
    _check_silu(cfg)
    _int(cfg, "num_nextn_predict_layers", 0)  # the MTP layers' count (checked here; load_weights skips them)
    return DeepSeekV3Config(
        expert_format=_expert_format(cfg.get("quantization_config")),
        vocab_size=_int(cfg, "vocab_size", minimum=1),
        hidden_size=_int(cfg, "hidden_size", minimum=1),
        intermediate_size=_int(cfg, "intermediate_size", minimum=1),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", minimum=1),
        num_layers=_int(cfg, "num_hidden_layers", minimum=1),
        first_k_dense_replace=_int(cfg, "first_k_dense_replace", 0),
        n_routed_experts=_int(cfg, "n_routed_experts", minimum=1),
        n_shared_experts=_int(cfg, "n_shared_experts", 0),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", minimum=1),
        n_group=_int(cfg, "n_group", 1) or 1,
        topk_group=_int(cfg, "topk_group", 1) or 1,
        routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.0),
        norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
        num_heads=_int(cfg, "num_attention_heads", minimum=1),
        q_lora_rank=_int(cfg, "q_lora_rank", None, minimum=1),
        kv_lora_rank=_int(cfg, "kv_lora_rank", minimum=1),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", minimum=1),
        v_head_dim=_int(cfg, "v_head_dim", minimum=1),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6, positive=True),
        rope_theta=_float(rope, "rope_theta", positive=True),
        **_yarn_fields(rope),
        rope_interleave=_bool(cfg, "rope_interleave", True),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096, minimum=1),
    )


def _quantization(quant) -> tuple[dict, object]:
    """(quantization_config as a dict ({} when absent, null or empty), its quant_method)."""
    if not quant:
        return {}, None
    if not isinstance(quant, dict):
        raise CheckpointError(f"quantization_config must be a JSON object, got {quant!r} ({_json_type(quant)})")
    return quant, quant.get("quant_method")


def _check_block_fp8(quant: dict) -> None:
    """HF's block FP8 ("fp8": e4m3 weights, a weight_scale_inv per 128 x 128 block, dynamic activation
    quantisation) as the loaders read it; any other block size, format or activation scheme raises."""
    block = quant.get("weight_block_size", [128, 128])  # HF's default (128, 128)
    if not isinstance(block, list) or block != [128, 128]:
        raise CheckpointError(
            f"quantization_config.weight_block_size {block!r} is not supported (block FP8 needs [128, 128])"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config.fmt {quant.get('fmt')!r} is not supported (FP8 needs 'e4m3')")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"quantization_config.activation_scheme {quant.get('activation_scheme')!r} is not supported "
            "(block FP8 needs 'dynamic')"
        )


def _check_dense_or_fp8(quant) -> None:
    """Qwen3 targets and DFlash drafters: no quantization_config, or block FP8 (the weights are dequantised
    to the load dtype as they load, `hf_weights.load_weights`); anything else raises naming its quant_method."""
    quant, method = _quantization(quant)
    if not quant:
        return
    if method == "fp8":
        _check_block_fp8(quant)
        return
    raise CheckpointError(
        f"unsupported quantization_config (quant_method {method!r}, format {quant.get('format')!r}); "
        "supported for this model family: block FP8 (quant_method 'fp8', 128 x 128 blocks)"
    )


def _expert_format(quant: dict | None) -> str:
    """'dense', or 'int4' for compressed-tensors pack-quantized symmetric group-32 INT4 weights."""
    quant, method = _quantization(quant)
    if not quant:
        return "dense"
    if method == "fp8":  # block FP8 (DeepSeek-V3, original K2): found per tensor from its weight_scale_inv
        _check_block_fp8(quant)
        return "dense"
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        for group in quant.get("config_groups", {}).values():
            w = group.get("weights", {})
            if (w.get("num_bits"), w.get("group_size"), w.get("symmetric"), w.get("type")) != (4, 32, True, "int"):
                raise CheckpointError(
                    f"unsupported compressed-tensors weights {w} (need symmetric int4, group size 32)"
                )
        return "int4"
    raise CheckpointError(
        f"unsupported quantization_config (quant_method {method!r}, format {quant.get('format')!r}); "
        "supported: compressed-tensors pack-quantized INT4 experts, block FP8"
    )


def mtp_layer_count(cfg: dict) -> int:
    """num_nextn_predict_layers of a DeepSeek-V3 / Kimi K2 config (kimi_k25: of its text_config): the
    multi-token-prediction layers stored after the decoder layers, which HF's model (and ours) does not
    run; 0 for other model types."""
    if not isinstance(cfg, dict):
        return 0
    if cfg.get("model_type") == "kimi_k25":
        return mtp_layer_count(_object(cfg, "text_config"))
    if cfg.get("model_type") in DEEPSEEK_FAMILY:
        return _int(cfg, "num_nextn_predict_layers", 0)
    return 0


def _rope_dict(config) -> dict:
    out = {"rope_type": getattr(config, "rope_type", "default"), "rope_theta": config.rope_theta}
    if out["rope_type"] == "yarn":
        out.update(
            factor=config.rope_factor,
            original_max_position_embeddings=config.rope_original_max_position,
            beta_fast=config.rope_beta_fast,
            beta_slow=config.rope_beta_slow,
            mscale=config.rope_mscale,
            mscale_all_dim=config.rope_mscale_all_dim,
        )
    return out
