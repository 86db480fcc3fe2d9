"""Frozen model configurations. Parsing of HF config.json files lives in `ddtree_jax.checkpoint`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 dense decoder (the targets of the public DFlash drafters; the fields of HF's Qwen3 config.json).

    `tapped_layers` are the decoder layers whose outputs feed the DFlash drafter (HF
    `hidden_states[l + 1]`); the target returns them concatenated for the verified slots.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    tapped_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check_tapped_layers(self.tapped_layers, self.num_layers)

    @property
    def num_tapped(self) -> int:
        return len(self.tapped_layers)


def check_tapped_layers(tapped_layers, num_layers: int) -> None:
    """ValueError naming the tapped layers outside [0, num_layers) (every target config's check)."""
    bad = [layer for layer in tapped_layers if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"tapped_layers {bad} are outside [0, num_layers = {num_layers})")


def default_tapped_layers(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """DFlash's default target layers: round(1 + i * (N - 4) / (F - 1)), i = 0..F-1; one feature: the middle
    layer N // 2 (DFlash's `build_target_layer_ids`; a one-layer drafter's checkpoint without target_layer_ids
    was fed layer 1's features)."""
    if num_features == 1:
        return (num_target_layers // 2,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_features - 1))) for i in range(num_features))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash block-diffusion drafter (arXiv 2602.06036; the fields of the public DFlash config.json).

    It shares the target's embedding and LM head (so `hidden_size` equals the target's), fuses the
    outputs of `target_layers` of the target into context features, and predicts block_size - 1
    draft marginals per pass.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"  # or "yarn" (the Kimi drafters), with the fields below as in HF configs
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (default, yarn)")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one bonus token + at least one mask), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.target_layers:
            raise ValueError("target_layers must name at least one target layer")

    @property
    def num_draft_tokens(self) -> int:
        """L = block_size - 1: the depth limit of the trees it feeds."""
        return self.block_size - 1


@dataclasses.dataclass(frozen=True)
class ChildHeadConfig:
    """A path-conditioned child head (issue #23; `models.child_head`): the distribution of a node's children
    from the drafter's hidden state at the children's depth and the parent token's embedding, through the
    target's LM head. hidden_size: the drafter's (= the target's); inner_size: the MLP's width."""

    hidden_size: int
    inner_size: int

    def __post_init__(self):
        for name in ("hidden_size", "inner_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChildHeadConfig.{name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Config:
    """DeepSeek-V3 / Kimi K2.x text model: MLA attention, dense first layers then MoE (models.md).

    RoPE applies to the qk_rope_head_dim part only (interleaved pairs when rope_interleave), with
    YaRN when rope_type == "yarn" (factor, original_max_position_embeddings, beta_fast / beta_slow,
    mscale / mscale_all_dim as in the HF config).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    tapped_layers: tuple[int, ...] = ()
    expert_format: str = "dense"  # "dense" or "int4" (compressed-tensors pack-quantized routed experts)

    def __post_init__(self):
        if self.expert_format not in ("dense", "int4"):
            raise ValueError(f"expert_format must be 'dense' or 'int4', got {self.expert_format!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be in [0, num_layers = {self.num_layers}]"
            )
        if self.n_group < 1:
            raise ValueError(f"n_group must be >= 1, got {self.n_group}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group = {self.n_group}]")
        if self.n_routed_experts:  # routing picks the top-k among the experts of the kept groups
            reachable = self.topk_group * (self.n_routed_experts // self.n_group)
            if not 1 <= self.num_experts_per_tok <= reachable:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, topk_group x experts a group "
                    f"= {reachable}]"
                )
        check_tapped_layers(self.tapped_layers, self.num_layers)
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (default, yarn)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace
