"""HF safetensors <-> our parameter trees, for the Qwen3 target and the DFlash drafter.

HF keeps one tensor per layer ("model.layers.3.self_attn.q_proj.weight"); we stack layers on a
leading axis. Every tensor is checked: missing, unexpected and mis-shaped tensors raise errors that
name the tensor. A file that cannot be read (truncated or damaged safetensors, an index json without
`weight_map` or naming the wrong shard, a file given as the directory) raises CheckpointError naming
the file and the tensor.
"""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from ddtree_jax.checkpoint.hf_config import mtp_layer_count, read_config
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig
from ddtree_jax.models import deepseek_v3, dflash, qwen3
from ddtree_kernels.quant import FP8_BLOCK, Fp8BlockWeight, Int4Weight

_LAYER_NAMES = {  # our name -> HF suffix within a layer
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


_MLA_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "q_a_proj": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b_proj": "self_attn.q_b_proj.weight",
    "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b_proj": "self_attn.kv_b_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
    "router_bias": "mlp.gate.e_score_correction_bias",
    "shared_gate": "mlp.shared_experts.gate_proj.weight",
    "shared_up": "mlp.shared_experts.up_proj.weight",
    "shared_down": "mlp.shared_experts.down_proj.weight",
}
_EXPERT_NAMES = {"expert_gate": "gate_proj.weight", "expert_up": "up_proj.weight", "expert_down": "down_proj.weight"}


_INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_FLOAT_DTYPES = {"F16": jnp.float16, "BF16": jnp.bfloat16, "F32": jnp.float32, "F64": jnp.float64}  # for dtype="auto"


def _deepseek_names(config: DeepSeekV3Config) -> dict:
    """{(stack, ours): [[HF name per expert] per layer] or [HF name per layer]} for every stacked tensor."""
    shapes = deepseek_v3.param_shapes(config)
    names = {}
    for stack, first, count in (
        ("dense_layers", 0, config.first_k_dense_replace),
        ("moe_layers", config.first_k_dense_replace, config.num_moe_layers),
    ):
        for ours in shapes[stack]:
            layers = range(first, first + count)
            if ours in _EXPERT_NAMES:
                base = _EXPERT_NAMES[ours].removesuffix(".weight")
                names[(stack, ours)] = [
                    [f"model.layers.{l}.mlp.experts.{e}.{base}" for e in range(config.n_routed_experts)] for l in layers
                ]
            else:
                names[(stack, ours)] = [f"model.layers.{l}.{_MLA_NAMES[ours]}" for l in layers]
    return names


def _layout(config) -> tuple[dict, dict, str]:
    """(top-level name map, expected shapes, layer prefix) for a target or drafter config."""
    if isinstance(config, DFlashConfig):
        shapes = dflash.param_shapes(config, config.hidden_size)
        top = {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "final_norm": "norm.weight"}
        return top, shapes, "layers"
    shapes = qwen3.param_shapes(config)
    top = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not config.tie_word_embeddings:
        top["lm_head"] = "lm_head.weight"
    return top, shapes, "model.layers"


def _deepseek_top(config: DeepSeekV3Config) -> dict:
    top = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not config.tie_word_embeddings:
        top["lm_head"] = "lm_head.weight"
    return top


def hf_tensor_names(config) -> list[str]:
    if isinstance(config, DeepSeekV3Config):
        names = list(_deepseek_top(config).values())
        parts = _INT4_PARTS if config.expert_format == "int4" else ("weight",)
        for per_layer in _deepseek_names(config).values():
            for entry in per_layer:
                names += [f"{base}.{part}" for base in entry for part in parts] if isinstance(entry, list) else [entry]
        return names
    top, shapes, prefix = _layout(config)
    names = list(top.values())
    for layer in range(config.num_layers):
        names += [f"{prefix}.{layer}.{suffix}" for suffix in _LAYER_NAMES.values()]
    return names


SCALE_SUFFIX = "_scale_inv"  # block FP8: "<module>.weight" + "_scale_inv" holds the weight's block scales


def is_linear_weight(name: str) -> bool:
    """An HF tensor name of a linear projection's weight ([out, in]), the tensors HF's block-FP8
    quantiser stores as FP8 with a weight_scale_inv; not the embedding, norms, routers or biases."""
    return name in ("lm_head.weight", "fc.weight") or name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def fp8_block_shape(shape) -> tuple[int, int]:
    """The weight_scale_inv shape of a block-FP8 [out, in] weight: one scale per 128 x 128 block."""
    out, inner = shape[-2:]
    return -(-out // FP8_BLOCK), -(-inner // FP8_BLOCK)


def dequantize_fp8(codes: np.ndarray, scale_inv: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A block-FP8 weight (float8_e4m3fn codes [out, in], scales [ceil(out / 128), ceil(in / 128)]) as
    `dtype`: codes x the scale of their 128 x 128 block, computed in float32 (as HF's dequantisation)."""
    out, inner = codes.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:out, :inner]
    return (codes.astype(np.float32) * scale).astype(dtype)


def _mtp_tensors(path: str, config, available: set[str], mtp_layers: int | None) -> set[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction layers (`model.layers.{L + i}.*` for i <
    num_nextn_predict_layers, L = num_hidden_layers), which HF's DeepseekV3ForCausalLM ignores, as we do.
    mtp_layers None: num_nextn_predict_layers of the config.json in `path` (0 without one)."""
    if not isinstance(config, DeepSeekV3Config):
        return set()
    if mtp_layers is None:
        has_config = os.path.isfile(os.path.join(path, "config.json"))
        mtp_layers = mtp_layer_count(read_config(path)) if has_config else 0
    prefixes = tuple(f"model.layers.{config.num_layers + i}." for i in range(mtp_layers))
    return {name for name in available if name.startswith(prefixes)} if prefixes else set()


def _tied_lm_head_copy(source, config, available: set[str]) -> set[str]:
    """{"lm_head.weight"} when a tied-embedding checkpoint also stores the head (some exporters write the tied
    tensor twice; HF loads them, the head being the embedding): accepted only if it equals the embedding,
    else CheckpointError (the model would silently use the embedding instead of that head)."""
    embed_name = "model.embed_tokens.weight"
    if not (
        getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in available and embed_name in available
    ):
        return set()
    head, embed = source.get("lm_head.weight"), source.get(embed_name)
    if head.shape != embed.shape or not np.array_equal(np.asarray(head), np.asarray(embed)):
        raise CheckpointError(
            "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight: the tied model "
            "would use the embedding as its head; set tie_word_embeddings false to load this head"
        )
    return {"lm_head.weight"}


def read_safetensors_header(file: str) -> dict:
    """{tensor name: {dtype, shape, data_offsets}} of a safetensors file, checked against the file's size:
    CheckpointError naming the file (and tensor) for a truncated file or a damaged header."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{file} is not a safetensors file: {size} bytes, shorter than the 8-byte header length"
            )
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise CheckpointError(
                f"{file} is truncated or not a safetensors file: its header length is {header_len} "
                f"bytes, but the file has only {size - 8} bytes after the length field"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} has a damaged safetensors header (not UTF-8 JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file} has a damaged safetensors header (a JSON {type(header).__name__}, not an object)"
        )
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            width = _DTYPE_BYTES[dtype]
            ok = isinstance(begin, int) and isinstance(end, int) and min(shape, default=0) >= 0
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: damaged header entry for tensor {name!r}: {info!r}") from None
        if not ok or not 0 <= begin <= end or end - begin != width * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(
                f"{file}: damaged header entry for tensor {name!r}: data_offsets {info['data_offsets']} "
                f"do not hold a {dtype} tensor of shape {shape}"
            )
        if end > data_bytes:
            raise CheckpointError(
                f"{file} is truncated: tensor {name!r} needs bytes [{begin}, {end}) of the data, "
                f"the file holds {data_bytes}"
            )
    return header


WRAPPED_PREFIX = "language_model."  # the text model inside a multimodal wrapper (Kimi K2.5 / K2.6)
MULTIMODAL_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")  # the wrapper's other parts


class TensorSource:
    """Reads tensors from a single model.safetensors or a sharded set with model.safetensors.index.json."""

    def __init__(self, path: str):
        if os.path.isfile(path):
            raise CheckpointError(
                f"{path} is a file; give the checkpoint directory that holds it: {os.path.dirname(path) or '.'}"
            )
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self._headers: dict[str, dict] = {}
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    content = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{index} is not valid JSON: {e}") from None
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} has no weight_map object ({{tensor name: shard file}})")
            self.index = index
            self.files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        elif os.path.exists(single):
            self.index = None
            self.files = {name: single for name in self.header(single)}
        else:
            raise CheckpointNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
        for file in sorted(set(self.files.values())):
            if not os.path.isfile(file):
                raise CheckpointNotFoundError(f"shard {file} named in the index {index} does not exist")
        # a multimodal wrapper (Kimi K2.5 / K2.6: KimiK25ForConditionalGeneration) stores the text model under
        # "language_model." beside its vision tower and projector: the text model's tensors are read by their
        # bare names, the vision parts left out (the text model never uses them)
        self.stored = {name: name for name in self.files}
        if any(name.startswith(WRAPPED_PREFIX) for name in self.files):
            self.stored = {
                name.removeprefix(WRAPPED_PREFIX): name
                for name in self.files
                if name.startswith(WRAPPED_PREFIX) or not name.startswith(MULTIMODAL_PREFIXES)
            }

    def header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def names(self) -> set[str]:
        return set(self.stored)

    def info(self, name: str) -> tuple[str, dict]:
        """(file, header entry) of a tensor; CheckpointError when its shard does not hold it."""
        stored = self.stored[name]
        file = self.files[stored]
        info = self.header(file).get(stored)
        if info is None:
            raise CheckpointError(f"the index {self.index} maps tensor {stored!r} to {file}, which does not hold it")
        return file, info

    def get(self, name: str) -> np.ndarray:
        file, info = self.info(name)
        if info["dtype"] in _RAW_DTYPES:  # safetensors' numpy reader cannot return float8: read those ourselves
            header_len = int.from_bytes(open(file, "rb").read(8), "little")
            begin, end = info["data_offsets"]
            with open(file, "rb") as f:
                f.seek(8 + header_len + begin)
                return np.frombuffer(f.read(end - begin), dtype=_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
        try:
            with safe_open(file, framework="numpy") as f:
                return f.get_tensor(self.stored[name])
        except Exception as e:  # safetensors' own errors name no file
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None

    def stored_dtype(self, names) -> str | None:
        """The floating-point safetensors dtype ('BF16', 'F32', ...) holding the most elements among `names`
        (FP8 and integer tensors aside); None if there is none."""
        elements: dict[str, int] = {}
        for name in names:
            _, info = self.info(name)
            if info["dtype"] in _FLOAT_DTYPES:
                elements[info["dtype"]] = elements.get(info["dtype"], 0) + int(np.prod(info["shape"], dtype=np.int64))
        return max(sorted(elements), key=elements.get) if elements else None


def check_finite_array(arr: np.ndarray, name: str, file: str) -> None:
    """CheckpointError naming the tensor and file when a floating-point tensor holds NaN or inf."""
    if arr.dtype.kind in "iub":
        return
    bad = ~np.isfinite(arr)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(
            f"tensor {name!r} in {file} holds {int(bad.sum())} non-finite value(s) (NaN/inf), "
            f"first at index {first}: {arr[first]}"
        )


def resolve_dtype(dtype, source: TensorSource, names) -> object:
    """dtype="auto": the checkpoint's own floating dtype (the one holding most parameters, as stored);
    anything else (a jnp dtype or its name, e.g. "bfloat16") as given."""
    if isinstance(dtype, str) and dtype == "auto":
        stored = source.stored_dtype(names)
        return _FLOAT_DTYPES[stored] if stored else jnp.float32
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be 'auto' or a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(resolved, jnp.floating):  # "int32" / "bool" loaded every weight cast to zeros and ones
        raise ValueError(f"dtype must be 'auto' or a floating dtype, got {dtype!r}")
    return resolved


def load_weights(path: str, config, dtype="auto", *, check_finite: bool = False, mtp_layers: int | None = None) -> dict:
    """Our param tree from the safetensors in `path`.

    dtype: the device dtype of the arrays; "auto" (default, as transformers' dtype="auto") keeps the
      checkpoint's stored floating dtype; e.g. jnp.bfloat16 or "bfloat16" casts to it. DeepSeek-V3's FP8
      decoder projections stay FP8 (`Fp8BlockWeight`), routers and FP8 scales float32, packed INT4 int32.
      Block-FP8 weights of a Qwen3 target or DFlash drafter (and any FP8 lm_head) are dequantised to
      `dtype` as they load (codes x the scale of their 128 x 128 block).
    check_finite: check every floating-point tensor for NaN/inf as read from the file (CheckpointError
      naming the tensor and file); off by default (it reads every value once more on the host).
    mtp_layers: DeepSeek-V3's num_nextn_predict_layers, whose layers (after the decoder layers) are
      skipped as HF skips them; None: read from the config.json in `path`.

    Every tensor in the checkpoint is used or reported: a weight_scale_inv is used with its FP8 linear
    weight, and one beside any other tensor (or an FP8 tensor without its scales) raises CheckpointError.
    """
    source = TensorSource(path)
    expected = set(hf_tensor_names(config))
    available = source.names()
    missing = sorted(expected - available)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s), first: {missing[0]!r}")
    # the FP8 weights: the linear weights stored with their block scales (used with them, below)
    quantised = {n for n in expected if is_linear_weight(n) and f"{n}{SCALE_SUFFIX}" in available}
    used = expected | {f"{n}{SCALE_SUFFIX}" for n in quantised} | _mtp_tensors(path, config, available, mtp_layers)
    tied_copy = _tied_lm_head_copy(source, config, available)
    unexpected = sorted(n for n in available - used - tied_copy if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {len(unexpected)} tensor(s) this model does not use, first: {unexpected[0]!r}"
        )
    dtype = resolve_dtype(dtype, source, sorted(expected))

    def fetch(name, shape):
        file, info = source.info(name)
        if tuple(info["shape"]) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(info['shape'])}, expected {tuple(shape)} (in {file})"
            )
        fp8 = info["dtype"].startswith("F8_")
        if name in quantised and info["dtype"] != "F8_E4M3":
            raise CheckpointError(
                f"tensor {name!r} has a {name}{SCALE_SUFFIX} but is stored as {info['dtype']}, not F8_E4M3 (in {file})"
            )
        if fp8 and name not in quantised:
            raise CheckpointError(
                f"tensor {name!r} is stored as {info['dtype']} without its block scales "
                f"({name}{SCALE_SUFFIX}); only block-FP8 linear weights with their scales can load (in {file})"
            )
        arr = source.get(name)
        if check_finite:
            check_finite_array(arr, name, file)
        return arr

    def fetch_array(name, shape, as_dtype):
        """A tensor as a host array of `as_dtype`; an FP8 one dequantised with its block scales."""
        if name not in quantised:
            return fetch(name, shape)
        scale = fetch(f"{name}{SCALE_SUFFIX}", fp8_block_shape(shape))
        return dequantize_fp8(fetch(name, shape), scale, np.dtype(as_dtype))

    if isinstance(config, DeepSeekV3Config):
        shapes = deepseek_v3.param_shapes(config)
        params = {
            ours: jnp.asarray(fetch_array(hf, shapes[ours][0], dtype), dtype)
            for ours, hf in _deepseek_top(config).items()
        }
        for stack in ("dense_layers", "moe_layers"):
            params[stack] = {}
        for (stack_name, ours), per_layer in _deepseek_names(config).items():
            stack = stack_name
            one = shapes[stack][ours][0][1:]  # one layer's shape
            if ours in _EXPERT_NAMES and config.expert_format == "int4":
                out, inner = one[1:]
                packed = np.stack(
                    [np.stack([fetch(f"{n}.weight_packed", (out, inner // 8)) for n in e]) for e in per_layer]
                )
                scale = np.stack(
                    [np.stack([fetch(f"{n}.weight_scale", (out, inner // 32)) for n in e]) for e in per_layer]
                )
                for experts in per_layer:
                    for n in experts:
                        if tuple(source.get(f"{n}.weight_shape").tolist()) != (out, inner):
                            raise CheckpointError(
                                f"tensor '{n}.weight_shape' is {source.get(f'{n}.weight_shape').tolist()}, expected {[out, inner]}"
                            )
                params[stack][ours] = Int4Weight(jnp.asarray(packed.view(np.int32)), jnp.asarray(scale, dtype))
                continue
            names = [[f"{n}.weight" for n in e] for e in per_layer] if ours in _EXPERT_NAMES else per_layer
            flat = [n for e in names for n in (e if isinstance(e, list) else [e])]
            if any(n in quantised for n in flat):  # block-FP8: kept in FP8 with its scales
                missing_scale = [n for n in flat if n not in quantised]
                if missing_scale:
                    raise CheckpointError(
                        f"tensor '{missing_scale[0]}{SCALE_SUFFIX}' is missing (the other layers are FP8)"
                    )
                out, inner = one[-2:]
                blocks = fp8_block_shape((out, inner))

                def stacked_arrays(suffix, shape):
                    if ours in _EXPERT_NAMES:
                        return np.stack([np.stack([fetch(f"{n}{suffix}", shape) for n in e]) for e in names])
                    return np.stack([fetch(f"{n}{suffix}", shape) for n in names])

                params[stack_name][ours] = Fp8BlockWeight(
                    jnp.asarray(stacked_arrays("", (out, inner))),
                    jnp.asarray(stacked_arrays(SCALE_SUFFIX, blocks), jnp.float32),
                )
                continue
            if ours in _EXPERT_NAMES:
                arrays = [np.stack([fetch(n, one[1:]) for n in e]) for e in names]
            else:
                arrays = [fetch(n, one) for n in per_layer]
            keep = jnp.float32 if ours in ("router", "router_bias") else dtype  # routing stays in float32 (as HF)
            params[stack][ours] = jnp.asarray(np.stack(arrays) if arrays else np.zeros((0,) + one), keep)
        return params
    top, shapes, prefix = _layout(config)
    params = {ours: jnp.asarray(fetch_array(hf, shapes[ours][0], dtype), dtype) for ours, hf in top.items()}
    params["layers"] = {}
    for ours, suffix in _LAYER_NAMES.items():
        layer_shape = shapes["layers"][ours][0][1:]
        stacked = [fetch_array(f"{prefix}.{layer}.{suffix}", layer_shape, dtype) for layer in range(config.num_layers)]
        params["layers"][ours] = jnp.asarray(np.stack(stacked), dtype)
    return params


def save_weights(path: str, config, params: dict, dtype=np.float32, max_shard_bytes: int | None = None) -> None:
    """Writes `params` as HF safetensors (sharded with an index when max_shard_bytes is given)."""
    if isinstance(config, DeepSeekV3Config):
        raise NotImplementedError("save_hf for DeepSeek-V3 / Kimi K2 checkpoints is not implemented (load_hf is)")
    top, _, prefix = _layout(config)
    tensors = {hf: np.asarray(params[ours]).astype(dtype) for ours, hf in top.items()}
    for ours, suffix in _LAYER_NAMES.items():
        for layer in range(config.num_layers):
            tensors[f"{prefix}.{layer}.{suffix}"] = np.asarray(params["layers"][ours][layer]).astype(dtype)
    os.makedirs(path, exist_ok=True)
    # an earlier save's files that this one does not rewrite would be read instead (the loader takes the index
    # when there is one): a single file replaces a sharded save, a sharded save a single file or other shards
    stale = ["model.safetensors", "model.safetensors.index.json"]
    stale += [f for f in os.listdir(path) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    for name in stale:
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name, arr in tensors.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}, f, indent=1
        )
