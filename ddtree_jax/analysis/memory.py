"""Memory planner: bytes per device of a sharded target (+ DFlash drafter) for a decode step. Numbers only.

Input: a target config (`DeepSeekV3Config` or `Qwen3Config`), optionally a `DFlashConfig` drafter, the
weight formats, a mesh layout, batch, context length, tree budget (N = budget + 1 verified slots) and the
cache dtype. Output: a `MemoryPlan` with bytes per device split into weights (by component), the target's
KV / latent cache, the drafter's weights and context cache, the verify step's workspace and a headroom
term, checked against the usable device memory; `max_context` solves for the longest context that fits.

Parameters are counted exactly from the config: `weight_inventory` lists every tensor of the models'
`param_shapes` (same path, shape and logical axes; tests/analysis/test_memory.py checks it tensor by
tensor), so the per-device split follows the logical axes.

Layouts (`MeshLayout`; which logical axes split over "model" is read from `sharding/rules.py`'s RULES: a ("data", "model") mesh, weights split over
"model" only and replicated over "data", batch split over "data"):
  tp   attention heads (q_b / kv_b / o projections; Qwen3 q / k / v / o), dense-FFN and shared-expert
       columns, each routed expert's FFN columns ("expert_mlp": 2048 / 8 = 256 per device = 8 INT4
       groups) and the vocabulary (embedding and lm_head, vocab-parallel) split over "model"; all 384
       experts on every device.
  ep   whole routed experts over "model" (384 / 8 = 48 per device, and the router's rows with them);
       attention, dense FFN, shared expert and vocabulary tensor-parallel exactly as in tp. Choice:
       attention stays head-parallel under EP (not replicated / data-parallel), so TP8 and EP8 hold the
       same bytes per device and differ only in which expert bytes a step reads (roofline.py).
  Not split in either (replicated over "model"): MLA's q_a_proj / kv_a_proj (shared low-rank inputs of
  all heads: 15.1M parameters per layer, ~1.8 GB per device at K2.6) and their norms, the layer norms,
  and under tp the router.
The MLA latent cache ((kv_lora_rank + qk_rope_head_dim) values per token and layer, one shared KV head)
cannot be split by heads: it is replicated on every "model" rank and split by batch over "data". A GQA
cache splits its KV heads over "model". The drafter's layers are split like a Qwen3 target's; its `fc`
(7168 x 43008 at K2.6: 0.62 GB) is replicated, as rules.py maps "features" to None.

Weight formats: "bf16" (2 B), "fp8" (block FP8: 1 B + a float32 scale per 128 x 128 block), "int4"
(pack-quantized group 32: 0.5 B + a bf16 scale per 32 weights = 0.5625 B), "f32". Routed experts take
`expert_format` (default from the config: "int4" for K2.6's pack-quantized experts, else "bf16"); the
other projections `dense_format` (default "bf16"; "fp8" for block-FP8 checkpoints); embedding, lm_head,
norms and router stay bf16, the router's correction bias float32 (as stored in DeepSeek-V3 / K2 files).

Workspace of one verify step (per device; rows = ceil(batch / data), T = N slots): float32 logits
[rows, T, V] gathered to the full vocabulary (what `verify_step` reads) plus the local bf16 shard, the
drafter's float32 marginals [rows, L, V], the dense bool attention mask [rows, T, S + T], eight float32
[rows * T, hidden] residual / temporary buffers, the tapped features, the FFN / MoE intermediates and the
attention core: the Pallas flash-decoding kernel's split partials (~264 programs x 64 rows x Dv floats),
or with `attention_impl="xla"` one layer's float32 scores and probabilities [rows, H / model, T, S + T];
"auto" is resolved as `dispatch.attention_impl` does on a GPU (the T queries of a step).
Caches are assumed updated in place (donated), so they are counted once.

Workspace of the prefill of a `context`-token prompt (per device, `prefill` in the plan): the engine
prefills in chunks of P = `dispatch.target_prefill_chunk(config, 0, S, batch)` tokens when the prompt is longer than that
(`PREFILL_CHUNK`; for a target with routed experts about `PREFILL_TOKENS_MOE` / batch; else P = the whole
prompt): float32 logits [rows, V] (the head runs at each row's last prompt token only) plus the local shard,
the bool mask [rows, P, S], the residual / FFN buffers of P rows, the tapped features of P rows, for routed
experts the chunk's A = rows x P x top-k assignment rows grouped by expert and their outputs ([A, hidden] bf16
each) and the grouped INT4 kernel's tile-major output (64-row tiles), and the attention core at the rule's choice for P queries against S
keys (`dispatch.attention_impl`): "blockwise" holds one key block's float32 scores and probabilities
[rows, H / model, P, 1024] and the accumulator [rows, H / model, P, Dv]; dense XLA the whole
[rows, H / model, P, S]; where "auto" takes the causal flash-attention kernel (`dispatch.
prefill_attention_kernel`: bf16 on the GPU) the scores stay on chip and only the float32 output
[rows, H / model, P, Dv] counts, plus, for MLA's expanded form, the whole cache's per-head keys and values
(bf16 [rows, S, H / model, Dk + Dv]; one key block's under blockwise). The prefill runs before the decode loop, so the plan counts the larger of the two
workspaces (`workspace_total`), not their sum.

Device memory: 141e9 B (the H200's 141 GB; nvidia-smi reports 143771 MiB = 150.8e9 B, so this is
conservative) x `usable_fraction` 0.92 = 129.7 GB (CUDA context, cuBLAS / NCCL workspaces, allocator
slack; more than JAX preallocates by default, 75% of the GPU: raise XLA_PYTHON_CLIENT_MEM_FRACTION),
minus `headroom_bytes` 4e9 (XLA temporaries not listed above, fragmentation, compiled programs).
"""

from __future__ import annotations

import dataclasses
import math
import re

from ddtree_jax import dispatch
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.dispatch import ATTENTION_IMPLS
from ddtree_jax.sharding.rules import MODEL, RULES
from ddtree_kernels import grouped_int4_mgpu
from ddtree_kernels.decode_matmul import max_row_tiles
from ddtree_kernels.quant import FP8_BLOCK, INT4_GROUP
from ddtree_kernels.tiling import TARGET_PROGRAMS
from ddtree_kernels.tree_attention import MAX_BLOCK_M

DEVICE_BYTES = 141e9  # NVIDIA H200 HBM3e, vendor figure
USABLE_FRACTION = 0.92
HEADROOM_BYTES = 4e9

COMPONENTS = ("attention", "dense_ffn", "shared_experts", "routed_experts", "embedding", "lm_head", "norms_router")
WEIGHT_FORMATS = ("bf16", "fp8", "int4", "f32")
CACHE_DTYPES = {"bf16": 2, "bfloat16": 2, "fp8": 1, "float8": 1, "f32": 4, "float32": 4}
INT4_SCALE_BYTES = 2  # compressed-tensors pack-quantized: a bf16 scale per INT4_GROUP weights (ddtree_kernels/quant.py)
FP8_SCALE_BYTES = 4  # block FP8: a float32 scale_inv per FP8_BLOCK x FP8_BLOCK block (ddtree_kernels/quant.py)
ACT_BUFFERS = 8  # live float32 [tokens, hidden] buffers assumed in a layer (residual, norms, outputs, temporaries)
# the attention kernels' split partials: programs x query rows of partial outputs (tree_attention; the Mosaic MLA
# kernel's ~132 CTAs x 64 rows stay under it)
PALLAS_PARTIALS = TARGET_PROGRAMS * MAX_BLOCK_M
PLANNED_BACKEND = "gpu"  # what attention_impl="auto" resolves for: the planner models H200s

# logical axes split over the "model" mesh axis, per layout (sharding/rules.py; every other axis is replicated)
MODEL_AXES = {
    kind: frozenset(axis for axis, mesh_axis in rules.items() if mesh_axis == MODEL) for kind, rules in RULES.items()
}


# --- the tensors ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter as the models store it: `path` as in param_shapes ("moe_layers/expert_up"), full
    `shape` (leading "layers" axis for stacked layers, then "experts"), logical `axes`, storage format
    and the component it belongs to. The last axis is the contracted (input) one: INT4 groups and FP8
    blocks run along it, as in models/quant.py."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    fmt: str
    component: str

    @property
    def params(self) -> int:
        return math.prod(self.shape)

    @property
    def layers(self) -> int:
        return self.shape[0] if self.axes and self.axes[0] == "layers" else 1


def _check_format(name: str, fmt: str) -> str:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    return fmt


def default_expert_format(config) -> str:
    """'int4' for pack-quantized routed experts (config.expert_format == 'int4'), else 'bf16'."""
    return "int4" if getattr(config, "expert_format", "dense") == "int4" else "bf16"


def _stack(layer: dict, layers: int, prefix: str) -> list[tuple[str, tuple, tuple, str]]:
    return [(f"{prefix}/{k}", (layers,) + s, ("layers",) + a, comp) for k, (s, a, comp) in layer.items()]


def _qwen3_layer(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    return {
        "input_norm": ((hidden,), ("embed",), "norms_router"),
        "q_proj": ((heads * head_dim, hidden), ("q_heads", "embed"), "attention"),
        "k_proj": ((kv_heads * head_dim, hidden), ("kv_heads", "embed"), "attention"),
        "v_proj": ((kv_heads * head_dim, hidden), ("kv_heads", "embed"), "attention"),
        "o_proj": ((hidden, heads * head_dim), ("embed", "q_heads"), "attention"),
        "q_norm": ((head_dim,), ("head_dim",), "norms_router"),
        "k_norm": ((head_dim,), ("head_dim",), "norms_router"),
        "post_norm": ((hidden,), ("embed",), "norms_router"),
        "gate_proj": ((inter, hidden), ("mlp", "embed"), "dense_ffn"),
        "up_proj": ((inter, hidden), ("mlp", "embed"), "dense_ffn"),
        "down_proj": ((hidden, inter), ("embed", "mlp"), "dense_ffn"),
    }


def _mla(c: DeepSeekV3Config) -> dict:
    heads, hidden = c.num_heads, c.hidden_size
    out = {
        "input_norm": ((hidden,), ("embed",), "norms_router"),
        "kv_a_proj": ((c.kv_lora_rank + c.qk_rope_head_dim, hidden), ("kv_lora", "embed"), "attention"),
        "kv_a_norm": ((c.kv_lora_rank,), ("kv_lora",), "norms_router"),
        "kv_b_proj": (
            (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            ("q_heads", "kv_lora"),
            "attention",
        ),
        "o_proj": ((hidden, heads * c.v_head_dim), ("embed", "q_heads"), "attention"),
        "post_norm": ((hidden,), ("embed",), "norms_router"),
    }
    if c.q_lora_rank is None:
        out["q_proj"] = ((heads * c.qk_head_dim, hidden), ("q_heads", "embed"), "attention")
    else:
        out["q_a_proj"] = ((c.q_lora_rank, hidden), ("q_lora", "embed"), "attention")
        out["q_a_norm"] = ((c.q_lora_rank,), ("q_lora",), "norms_router")
        out["q_b_proj"] = ((heads * c.qk_head_dim, c.q_lora_rank), ("q_heads", "q_lora"), "attention")
    return out


def _format_of(path: str, axes: tuple, component: str, expert_format: str, dense_format: str) -> str:
    if path.endswith("router_bias"):
        return "f32"
    if component == "routed_experts":
        return expert_format
    if component in ("embedding", "lm_head", "norms_router") or len(axes) - (axes[0] == "layers") < 2:
        return "bf16"
    return dense_format


def weight_inventory(config, *, expert_format: str | None = None, dense_format: str = "bf16") -> list[Tensor]:
    """Every parameter tensor of a DeepSeekV3Config / Qwen3Config target, in param_shapes' paths."""
    expert_format = _check_format("expert_format", expert_format or default_expert_format(config))
    dense_format = _check_format("dense_format", dense_format)
    c = config
    if isinstance(c, DeepSeekV3Config):
        dense = {
            **_mla(c),
            "gate_proj": ((c.intermediate_size, c.hidden_size), ("mlp", "embed"), "dense_ffn"),
            "up_proj": ((c.intermediate_size, c.hidden_size), ("mlp", "embed"), "dense_ffn"),
            "down_proj": ((c.hidden_size, c.intermediate_size), ("embed", "mlp"), "dense_ffn"),
        }
        e, i, hid = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        shared = c.moe_intermediate_size * c.n_shared_experts
        moe = {
            **_mla(c),
            "router": ((e, hid), ("experts", "embed"), "norms_router"),
            "router_bias": ((e,), ("experts",), "norms_router"),
            "expert_gate": ((e, i, hid), ("experts", "expert_mlp", "embed"), "routed_experts"),
            "expert_up": ((e, i, hid), ("experts", "expert_mlp", "embed"), "routed_experts"),
            "expert_down": ((e, hid, i), ("experts", "embed", "expert_mlp"), "routed_experts"),
            "shared_gate": ((shared, hid), ("mlp", "embed"), "shared_experts"),
            "shared_up": ((shared, hid), ("mlp", "embed"), "shared_experts"),
            "shared_down": ((hid, shared), ("embed", "mlp"), "shared_experts"),
        }
        rows = _stack(dense, c.first_k_dense_replace, "dense_layers") + _stack(moe, c.num_moe_layers, "moe_layers")
    elif isinstance(c, Qwen3Config):
        layer = _qwen3_layer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
        rows = _stack(layer, c.num_layers, "layers")
    else:
        raise ValueError(f"config must be a DeepSeekV3Config or Qwen3Config, got {type(config).__name__}")
    rows = [("embed", (c.vocab_size, c.hidden_size), ("vocab", "embed"), "embedding")] + rows
    rows.append(("final_norm", (c.hidden_size,), ("embed",), "norms_router"))
    if not c.tie_word_embeddings:
        rows.append(("lm_head", (c.vocab_size, c.hidden_size), ("vocab", "embed"), "lm_head"))
    return [Tensor(p, s, a, _format_of(p, a, comp, expert_format, dense_format), comp) for p, s, a, comp in rows]


def drafter_inventory(drafter: DFlashConfig, target_hidden: int, fmt: str = "bf16") -> list[Tensor]:
    """The DFlash drafter's tensors (dflash.param_shapes): fc, hidden_norm, Qwen3-style layers, final_norm."""
    _check_format("drafter format", fmt)
    if not isinstance(drafter, DFlashConfig):
        raise ValueError(f"drafter must be a DFlashConfig, got {type(drafter).__name__}")
    d = drafter
    if target_hidden != d.hidden_size:
        raise ValueError(f"the drafter's hidden_size ({d.hidden_size}) must equal the target's ({target_hidden})")
    layer = _qwen3_layer(d.hidden_size, d.intermediate_size, d.num_heads, d.num_kv_heads, d.head_dim)
    rows = [
        ("fc", (d.hidden_size, len(d.target_layers) * target_hidden), ("embed", "features"), "attention"),
        ("hidden_norm", (d.hidden_size,), ("embed",), "norms_router"),
    ]
    rows += _stack(layer, d.num_layers, "layers")
    rows.append(("final_norm", (d.hidden_size,), ("embed",), "norms_router"))
    return [Tensor(p, s, a, fmt if len(s) - (a[0] == "layers") >= 2 else "bf16", comp) for p, s, a, comp in rows]


def param_counts(config) -> dict[str, int]:
    """Exact parameter count per component (COMPONENTS) of a target config."""
    out = dict.fromkeys(COMPONENTS, 0)
    for t in weight_inventory(config):
        out[t.component] += t.params
    return out


def total_params(config) -> int:
    return sum(param_counts(config).values())


def drafter_params(drafter: DFlashConfig, target_hidden: int | None = None) -> int:
    return sum(t.params for t in drafter_inventory(drafter, target_hidden or drafter.hidden_size))


# --- layouts ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A ("data", "model") mesh and a rule table: kind "tp" or "ep" (module docstring), `model` = the
    tensor / expert-parallel degree, `data` = the batch-parallel degree; devices = model * data."""

    kind: str
    model: int
    data: int = 1

    def __post_init__(self):
        if self.kind not in MODEL_AXES:
            raise ValueError(f"layout kind must be one of {sorted(MODEL_AXES)}, got {self.kind!r}")
        if self.model < 1 or self.data < 1:
            raise ValueError(f"mesh sizes must be >= 1, got model={self.model}, data={self.data}")

    @property
    def devices(self) -> int:
        return self.model * self.data

    @property
    def name(self) -> str:
        if self.devices == 1:
            return "single"
        return f"{self.kind}{self.model}" + (f"-dp{self.data}" if self.data > 1 else "")

    def split(self, axis: str) -> int:
        """How many ways a dimension with this logical axis is split (1: replicated)."""
        return self.model if axis in MODEL_AXES[self.kind] else 1


def parse_layout(layout) -> MeshLayout:
    """'tp8', 'ep8', 'tp2', 'ep2', 'tp4-dp2' (model 4 x data 2), 'single' (one device), or a MeshLayout."""
    if isinstance(layout, MeshLayout):
        return layout
    if layout in ("single", "tp1", "ep1"):
        return MeshLayout("tp", 1, 1)
    m = re.fullmatch(r"(tp|ep)(\d+)(?:-dp(\d+))?", str(layout))
    if not m:
        raise ValueError(f"layout must look like 'tp8', 'ep8', 'tp4-dp2' or 'single', got {layout!r}")
    return MeshLayout(m.group(1), int(m.group(2)), int(m.group(3) or 1))


def local_shape(t: Tensor, layout: MeshLayout) -> tuple[int, ...]:
    """The per-device shape of `t` under `layout` (ValueError where a split dimension does not divide)."""
    out = []
    for size, axis in zip(t.shape, t.axes):
        ways = layout.split(axis)
        if size % ways:
            raise ValueError(
                f"{t.path}: dimension {axis!r} of size {size} does not divide over {ways} devices "
                f"(layout {layout.name!r})"
            )
        out.append(size // ways)
    return tuple(out)


def format_bytes(shape: tuple[int, ...], fmt: str, path: str = "tensor") -> int:
    """Stored bytes of an array of `shape` in `fmt` (quantisation groups / blocks along the last axes)."""
    n = math.prod(shape)
    if fmt == "bf16":
        return 2 * n
    if fmt == "f32":
        return 4 * n
    if len(shape) < 2:
        raise ValueError(f"{path}: format {fmt!r} needs a matrix, got shape {shape}")
    rows, cols = shape[-2], shape[-1]
    stack = math.prod(shape[:-2])
    if fmt == "int4":
        if cols % INT4_GROUP:
            raise ValueError(f"{path}: INT4 needs the input dimension to be a multiple of {INT4_GROUP}, got {cols}")
        return stack * rows * (cols // 2 + (cols // INT4_GROUP) * INT4_SCALE_BYTES)
    if fmt == "fp8":
        return stack * (rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * FP8_SCALE_BYTES)
    raise ValueError(f"{path}: format must be one of {WEIGHT_FORMATS}, got {fmt!r}")


def tensor_bytes(t: Tensor, layout=None) -> int:
    """Bytes of `t` on one device (whole tensor when layout is None)."""
    shape = t.shape if layout is None else local_shape(t, parse_layout(layout))
    return format_bytes(shape, t.fmt, t.path)


def weight_bytes(
    config, layout="tp8", *, expert_format: str | None = None, dense_format: str = "bf16"
) -> dict[str, int]:
    """Bytes per device of the target's weights, per component."""
    layout = parse_layout(layout)
    out = dict.fromkeys(COMPONENTS, 0)
    for t in weight_inventory(config, expert_format=expert_format, dense_format=dense_format):
        out[t.component] += tensor_bytes(t, layout)
    return out


def _kv_local(kv_heads: int, layout: MeshLayout, what: str) -> int:
    ways = layout.model if "kv_heads" in MODEL_AXES[layout.kind] else 1
    if kv_heads % ways:
        raise ValueError(f"{what}: {kv_heads} KV heads do not divide over {ways} devices (layout {layout.name!r})")
    return kv_heads // ways


def cache_bytes_per_token(config, layout="tp8", cache_dtype: str = "bf16") -> int:
    """Target cache bytes per token (all layers) on one device: MLA (kv_lora + rope) values, replicated
    over "model"; GQA 2 x local KV heads x head_dim."""
    layout, width = parse_layout(layout), _dtype_bytes(cache_dtype)
    if isinstance(config, DeepSeekV3Config):
        return config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * width
    return config.num_layers * 2 * _kv_local(config.num_kv_heads, layout, "target") * config.head_dim * width


def drafter_cache_bytes_per_token(drafter: DFlashConfig, layout="tp8", cache_dtype: str = "bf16") -> int:
    layout = parse_layout(layout)
    kv_local = _kv_local(drafter.num_kv_heads, layout, "drafter")
    return drafter.num_layers * 2 * kv_local * drafter.head_dim * _dtype_bytes(cache_dtype)


def _dtype_bytes(cache_dtype: str) -> int:
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPES)}, got {cache_dtype!r}")
    return CACHE_DTYPES[cache_dtype]


# --- the plan ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (all ints). `fits`: total <= capacity = device_bytes * usable_fraction."""

    layout: MeshLayout
    batch: int
    context: int
    budget: int
    tree_slots: int
    rows_per_device: int
    weights: dict
    drafter_weights: int
    kv_cache: int
    drafter_cache: int
    activations: dict
    headroom: int
    capacity: int
    prefill: dict = dataclasses.field(default_factory=dict)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def activations_total(self) -> int:
        return sum(self.activations.values())

    @property
    def prefill_total(self) -> int:
        return sum(self.prefill.values())

    @property
    def workspace_total(self) -> int:
        """The larger of the decode step's and the prefill's workspace (they are never alive together)."""
        return max(self.activations_total, self.prefill_total)

    @property
    def total(self) -> int:
        return (
            self.weights_total
            + self.drafter_weights
            + self.kv_cache
            + self.drafter_cache
            + self.workspace_total
            + self.headroom
        )

    @property
    def free(self) -> int:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def table(self) -> str:
        """A two-column markdown table (GB = 1e9 bytes) of every term."""
        lines = [
            f"| {self.layout.name} ({self.layout.devices} devices), batch {self.batch}, context {self.context:,}, "
            f"budget {self.budget} | GB / device |",
            "|---|---|",
        ]
        rows = [(f"weights: {k}", v) for k, v in self.weights.items() if v] + [
            ("weights (target)", self.weights_total),
            ("drafter weights", self.drafter_weights),
            ("KV / latent cache", self.kv_cache),
            ("drafter context cache", self.drafter_cache),
        ]
        rows += [(f"workspace: {k}", v) for k, v in self.activations.items() if v]
        rows += [(f"prefill workspace: {k}", v) for k, v in self.prefill.items() if v]
        rows += [("workspace (the larger of the two)", self.workspace_total)]
        rows += [
            ("headroom", self.headroom),
            ("total", self.total),
            ("capacity", self.capacity),
            ("fits" if self.fits else "DOES NOT FIT", self.free),
        ]
        return "\n".join(lines + [f"| {k} | {v / 1e9:,.3f} |" for k, v in rows])


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def plan_memory(
    config,
    *,
    drafter: DFlashConfig | None = None,
    layout="tp8",
    batch: int = 1,
    context: int = 4096,
    budget: int = 64,
    expert_format: str | None = None,
    dense_format: str = "bf16",
    cache_dtype: str = "bf16",
    attention_impl: str = "pallas",
    device_bytes: float = DEVICE_BYTES,
    usable_fraction: float = USABLE_FRACTION,
    headroom_bytes: float = HEADROOM_BYTES,
) -> MemoryPlan:
    """Bytes per device of serving `config` (+ `drafter`) with trees of `budget` nodes (N = budget + 1
    slots per row; budget 0 = plain AR), `batch` rows of up to `context` committed tokens each."""
    layout = parse_layout(layout)
    _check_int("batch", batch, 1)
    _check_int("context", context, 0)
    _check_int("budget", budget, 0)
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
    if device_bytes <= 0 or headroom_bytes < 0:
        raise ValueError(f"device_bytes must be > 0 and headroom_bytes >= 0, got {device_bytes!r}, {headroom_bytes!r}")
    c = config
    weights = weight_bytes(c, layout, expert_format=expert_format, dense_format=dense_format)
    slots = budget + 1
    rows = -(-batch // layout.data)
    tokens = rows * slots
    # a chunked prefill pads the prompt to whole chunks (`engine.generate.prefill`), then whole 128-row blocks
    chunk = dispatch.target_prefill_chunk(c, 0, context, batch)
    padded = context if chunk is None else -(-context // chunk) * chunk
    cache_rows = -(-(padded + slots) // dispatch.CACHE_ROW_MULTIPLE) * dispatch.CACHE_ROW_MULTIPLE
    kv = rows * cache_rows * cache_bytes_per_token(c, layout, cache_dtype)

    drafter_weights = drafter_cache = 0
    if drafter is not None:
        drafter_weights = sum(tensor_bytes(t, layout) for t in drafter_inventory(drafter, c.hidden_size))
        drafter_cache = rows * cache_rows * drafter_cache_bytes_per_token(drafter, layout, cache_dtype)  # same rows

    vocab_local = c.vocab_size // layout.split("vocab")
    heads_local = c.num_heads // layout.split("q_heads")
    if isinstance(c, DeepSeekV3Config):
        value_dim, key_dim = c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim
        ffn = max(
            c.intermediate_size // layout.split("mlp"),
            c.num_experts_per_tok * c.moe_intermediate_size // layout.split("expert_mlp")
            + c.moe_intermediate_size * c.n_shared_experts // layout.split("mlp"),
        )
    else:
        value_dim, key_dim = c.head_dim, c.head_dim
        ffn = c.intermediate_size // layout.split("mlp")
    keys = context + slots
    attention = dispatch.attention_impl(
        attention_impl,
        queries=slots,
        keys=cache_rows,
        mla=isinstance(c, DeepSeekV3Config),
        mla_dims=(c.kv_lora_rank, c.qk_rope_head_dim) if isinstance(c, DeepSeekV3Config) else None,
        backend_name=PLANNED_BACKEND,
    )
    act = {
        "logits": tokens * c.vocab_size * 4 + tokens * vocab_local * 2,
        "draft_logits": rows * drafter.num_draft_tokens * c.vocab_size * 4 if drafter is not None else 0,
        "attention_mask": tokens * keys,
        "hidden_states": ACT_BUFFERS * tokens * c.hidden_size * 4,
        "tapped_features": tokens
        * len(c.tapped_layers or (drafter.target_layers if drafter else ()))
        * c.hidden_size
        * 2,
        "ffn": 3 * tokens * ffn * 4,
        "attention": (
            PALLAS_PARTIALS * (value_dim + 2) * 4
            if attention == "pallas"
            else 2 * rows * heads_local * slots * keys * 4
        ),
    }
    if isinstance(c, DeepSeekV3Config):  # absorbed queries [rows, T, H_local, kv_lora + rope] and outputs, f32
        act["attention"] += 2 * tokens * heads_local * key_dim * 4
    int4_experts = (expert_format or default_expert_format(c)) == "int4"
    prefill = _prefill_workspace(
        c, drafter, rows, context, vocab_local, heads_local, value_dim, key_dim, ffn, batch, int4_experts
    )
    return MemoryPlan(
        layout=layout,
        batch=batch,
        context=context,
        budget=budget,
        tree_slots=slots,
        rows_per_device=rows,
        weights=weights,
        drafter_weights=drafter_weights,
        kv_cache=kv,
        drafter_cache=drafter_cache,
        activations=act,
        headroom=int(headroom_bytes),
        capacity=int(device_bytes * usable_fraction),
        prefill=prefill,
    )


def _prefill_workspace(
    c, drafter, rows, context, vocab_local, heads_local, value_dim, key_dim, ffn, batch: int = 1, int4_experts=False
) -> dict:
    """The prefill's workspace per device (module docstring): one chunk of P tokens against S keys."""
    if context == 0:
        return {}
    chunk = dispatch.target_prefill_chunk(c, 0, context, batch) or context
    tokens = rows * chunk
    keys = context
    attention = dispatch.attention_impl("auto", queries=chunk, keys=keys, backend_name=PLANNED_BACKEND)
    key_block = min(dispatch.BLOCKWISE_KEYS, keys)
    expanded = isinstance(c, DeepSeekV3Config) and (
        dispatch.mla_form(
            "auto",
            queries=chunk,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
        )
        == "expanded"
    )
    if expanded:  # per-head keys and values from the latent (models.deepseek_v3.mla_absorbed, expanded form)
        value_dim, key_dim = c.v_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
    # the causal flash-attention kernel where "auto" takes it (bf16 on the GPU; the cache is whole row blocks)
    capacity = -(-keys // dispatch.CACHE_ROW_MULTIPLE) * dispatch.CACHE_ROW_MULTIPLE
    kernel = (
        chunk > 1
        and (expanded or not isinstance(c, DeepSeekV3Config))
        and dispatch.prefill_attention_kernel(
            "auto",
            queries=chunk,
            keys=capacity,
            key_dim=key_dim,
            value_dim=value_dim,
            bfloat16=True,
            mla=expanded,
            backend_name=PLANNED_BACKEND,
        )
        == "mosaic"
    )
    if kernel:  # scores stay on chip; the output per query row and head, f32
        core = rows * heads_local * chunk * value_dim * 4
    elif attention == "blockwise":
        core = rows * heads_local * chunk * (2 * key_block + value_dim) * 4
    else:
        core = 2 * rows * heads_local * chunk * keys * 4
    if expanded:  # the expanded keys and values of one key block (blockwise) or of the whole cache, bf16
        core += (
            rows
            * (key_block if attention == "blockwise" and not kernel else keys)
            * heads_local
            * (key_dim + value_dim)
            * 2
        )
    if isinstance(c, DeepSeekV3Config):  # the chunk's queries and outputs, f32
        core += 2 * tokens * heads_local * key_dim * 4
    routed = 0
    if getattr(c, "n_routed_experts", 0):
        # the grouped path ("pallas"): the chunk's rows grouped by expert and their outputs [A, hidden] bf16
        # (A = tokens x top-k), plus for INT4 experts the Mosaic grouped kernel's tile-major output
        # [max_row_tiles x block_m, hidden] (`grouped_int4_mgpu`)
        assignments = tokens * c.num_experts_per_tok
        routed = 2 * assignments * c.hidden_size * 2
        if int4_experts:
            block_m = grouped_int4_mgpu.DEFAULT_BLOCK_M
            routed += block_m * max_row_tiles(assignments, c.n_routed_experts, block_m) * c.hidden_size * 2
    return {
        "logits": rows * c.vocab_size * 4 + rows * vocab_local * 2,  # the last prompt token of each row
        "attention_mask": tokens * keys,
        "hidden_states": ACT_BUFFERS * tokens * c.hidden_size * 4,
        "tapped_features": tokens
        * len(c.tapped_layers or (drafter.target_layers if drafter else ()))
        * c.hidden_size
        * 2,
        "ffn": 3 * tokens * ffn * 4,
        "routed_experts": routed,
        "attention": core,
    }


def max_context(config, *, batch: int = 1, budget: int = 64, limit: int | None = None, **kwargs) -> int:
    """The longest context (committed tokens per row) whose plan fits; 0 if not even context 0 fits.
    `limit` caps the search (e.g. config.max_position_embeddings); the uncapped memory limit otherwise.
    Other keyword arguments go to plan_memory."""

    def fits(s):
        return plan_memory(config, batch=batch, context=s, budget=budget, **kwargs).fits

    if not fits(0):
        return 0
    cap = limit if limit is not None else 1 << 40
    lo, hi = 0, 1
    while hi < cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap)
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
