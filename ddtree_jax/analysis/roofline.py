"""Roofline of one decode step: bytes, FLOPs and collectives per device -> step time, tokens/s, break-even tau.

Methods (per row, per step): AR verifies 1 token; the DFlash chain verifies `block_size` tokens (bonus + L
drafts); DDTree verifies budget + 1 tree slots. Chain and DDTree also run the drafter: one forward over
its block (block_size tokens) with the target's lm_head over the L = block_size - 1 draft positions.

Per device, each phase (draft, then verify) costs
    time = max(bytes / hbm_bytes_per_s, flops / peak_flops) + collectives
and step = draft + verify + `overhead_s` (tree building, verification, commit, launches: 0 by default,
i.e. a pure roofline; BENCHMARKS.md has measured stage times to put here). tokens/s per row = tau / step;
the break-even tau of a method is step(method) / step(AR): the mean accepted length it needs to match AR.

Bytes (reads, per device; weights from analysis/memory.py's inventory and layouts):
- every non-expert weight the device holds (attention incl. the replicated q_a / kv_a, dense FFN, shared
  expert, router, norms, lm_head); the embedding only for the looked-up rows.
- routed experts: a step of n tokens in a data shard touches each expert with probability
  p(n) = 1 - (1 - k / E)^n (independent uniform routing), i.e. E * p(n) distinct experts per MoE layer
  (384 * (1 - (1 - 8/384)^n): 8 at n = 1, ~116 at n = 17, ~286 at n = 65; n = rows * tokens per row).
  TP: every device reads its column shard of every touched expert: E * p(n) * expert_bytes / model.
  EP: a device reads the whole experts it owns that were touched, and the layer waits for the busiest
  device: E[max over the model ranks of Binomial(E / model, p(n))] * expert_bytes (ranks treated as
  independent). Tree tokens share a context and route alike, so for trees this is an upper bound.
- caches: the target's KV / latent cache over S + T keys per row (MLA: the whole latent cache on every
  model rank, since it is replicated) plus the T new rows written; the drafter's context cache.
- logits: float32 [tokens, V / model] written, gathered to [tokens, V] and read once for sampling.
FLOPs: 2 x tokens x the parameters a device multiplies (its weight shards; replicated ones in full;
routed experts k per token, spread evenly over the devices) + attention cores: absorbed MLA
2 (S + T)(2 kv_lora + rope) per token, local head and layer; GQA 4 (S + T) head_dim.
Collectives (only over "model"; data replicas are independent), latency + bytes / bandwidth (ring):
  all-reduce 2 (p-1)/p B / bw, all-gather and all-to-all (p-1)/p B / bw.
  TP: 2 all-reduces of the [tokens, hidden] bf16 activations per layer (attention output, FFN / MoE
  output), one for the vocab-parallel embedding lookup, one all-gather of the float32 logits.
  EP, ep_collective="allreduce" (default; what rules.py describes: tokens gathered by the attention
  all-reduce, each rank runs its local experts, results combined by the all-reduce): the same as TP.
  EP, ep_collective="all_to_all" (a DeepEP-style alternative): per MoE layer, after the attention
  all-reduce, an all-to-all dispatch of each rank's 1/p of the tokens to their k experts' owners, an
  all-to-all combine back, and an all-gather of the combined tokens for the next (head-parallel)
  attention: 4 collectives per MoE layer.
  Drafter under TP / EP: 2 all-reduces per layer, the embedding all-reduce, the logits gather (its fc is
  replicated, as in rules.py).

Hardware constants (`Hardware`, H200 defaults; each sourced or marked as an assumption):
  hbm_bytes_per_s 4.3e12: device-to-device copy measured on the H200 (KINDS.md; vendor peak 4.8e12;
      plain XLA copies reach ~3.1e12: BENCHMARKS.md).
  peak_flops 790e12: 8192^3 bf16 matmul measured (KINDS.md; datasheet dense bf16 ~990e12).
  link_bytes_per_s 450e9: NVLink 4 on H200 SXM, 900 GB/s bidirectional per GPU (vendor), i.e. 450 GB/s
      each way; NVLink multicast / NVLS is off on these machines (KINDS.md), so ring algorithms.
  allreduce_latency_s 15e-6, all_to_all_latency_s 20e-6: ASSUMPTIONS (typical small-message NCCL times
      on one 8-GPU NVLink host, 10-20 us; not measured here). Custom one-shot all-reduces reach ~5 us.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from ddtree_jax.analysis.memory import (
    MeshLayout,
    cache_bytes_per_token,
    drafter_cache_bytes_per_token,
    drafter_inventory,
    format_bytes,
    local_shape,
    parse_layout,
    weight_inventory,
)
from ddtree_jax.config import DeepSeekV3Config, DFlashConfig, Qwen3Config
from ddtree_jax.options import check_method
from ddtree_jax.presets import preset_pair

EP_COLLECTIVES = ("allreduce", "all_to_all")
ACT_BYTES = 2  # bf16 activations on the wire


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device ceilings and interconnect model (module docstring: sources and assumptions)."""

    name: str = "H200"
    hbm_bytes_per_s: float = 4.3e12
    peak_flops: float = 790e12
    link_bytes_per_s: float = 450e9
    allreduce_latency_s: float = 15e-6
    all_to_all_latency_s: float = 20e-6

    def __post_init__(self):
        for f in ("hbm_bytes_per_s", "peak_flops", "link_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        for f in ("allreduce_latency_s", "all_to_all_latency_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)!r}")

    def all_reduce(self, nbytes: float, p: int) -> float:
        return 0.0 if p == 1 else self.allreduce_latency_s + 2 * (p - 1) / p * nbytes / self.link_bytes_per_s

    def all_gather(self, total_bytes: float, p: int) -> float:
        return 0.0 if p == 1 else self.allreduce_latency_s + (p - 1) / p * total_bytes / self.link_bytes_per_s

    def all_to_all(self, bytes_per_rank: float, p: int) -> float:
        return 0.0 if p == 1 else self.all_to_all_latency_s + (p - 1) / p * bytes_per_rank / self.link_bytes_per_s


H200 = Hardware()


# --- routed experts --------------------------------------------------------------------------------------------


def expected_distinct_experts(n: int, num_experts: int = 384, top_k: int = 8) -> float:
    """E[#distinct experts] that n tokens touch in one MoE layer, uniform independent top-k routing:
    num_experts * (1 - (1 - top_k / num_experts)^n)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k!r}")
    return num_experts * (1 - (1 - top_k / num_experts) ** n)


def expected_max_group_experts(n: int, num_experts: int, top_k: int, groups: int) -> float:
    """E[max over `groups` equal expert groups (EP ranks) of the touched experts in the group]: each expert
    touched independently with p = 1 - (1 - k/E)^n, group counts iid Binomial(E / groups, p).
    groups = 1 gives expected_distinct_experts."""
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups must divide num_experts = {num_experts}, got {groups!r}")
    m = num_experts // groups
    p = expected_distinct_experts(n, num_experts, top_k) / num_experts
    if groups == 1:
        return m * p
    cdf, acc, out = [], 0.0, 0.0
    for j in range(m + 1):
        acc += math.comb(m, j) * p**j * (1 - p) ** (m - j)
        cdf.append(min(acc, 1.0))
    for j in range(1, m + 1):  # E[max] = sum_j P(max >= j) = sum_j 1 - F(j - 1)^groups
        out += 1 - cdf[j - 1] ** groups
    return out


# --- one phase / one step ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
    """One forward (draft or verify) on one device: bytes by kind, FLOPs, collectives."""

    name: str
    tokens: int  # tokens this device's rows process (rows x tokens per row)
    bytes: dict
    flops: float
    collectives_s: float
    num_collectives: int
    hardware: Hardware

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def memory_s(self) -> float:
        return self.total_bytes / self.hardware.hbm_bytes_per_s

    @property
    def compute_s(self) -> float:
        return self.flops / self.hardware.peak_flops

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.collectives_s


@dataclasses.dataclass(frozen=True)
class StepCost:
    method: str
    budget: int | None
    tokens_per_row: int
    batch: int
    layout: MeshLayout
    verify: Phase
    draft: Phase | None
    overhead_s: float
    experts_per_layer: float  # routed experts read per MoE layer (TP: distinct experts; EP: busiest rank x ranks)

    @property
    def phases(self) -> tuple[Phase, ...]:
        return (self.draft, self.verify) if self.draft is not None else (self.verify,)

    @property
    def step_s(self) -> float:
        return sum(p.time_s for p in self.phases) + self.overhead_s

    @property
    def total_bytes(self) -> float:
        return sum(p.total_bytes for p in self.phases)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.phases)

    @property
    def memory_s(self) -> float:
        return sum(p.memory_s for p in self.phases)

    @property
    def compute_s(self) -> float:
        return sum(p.compute_s for p in self.phases)

    @property
    def collectives_s(self) -> float:
        return sum(p.collectives_s for p in self.phases)

    def tokens_per_s(self, tau: float = 1.0) -> float:
        """Per-row tokens/s at mean accepted length tau (AR: tau = 1); times batch for the aggregate."""
        return tau / self.step_s


def break_even_tau(cost: StepCost, ar: StepCost) -> float:
    """The tau at which `cost` matches AR's tokens/s: step(cost) / step(AR)."""
    return cost.step_s / ar.step_s


def _head(config):
    return "embed" if config.tie_word_embeddings else "lm_head"


def _verify_phase(
    config,
    layout: MeshLayout,
    *,
    rows: int,
    tokens_per_row: int,
    context: int,
    expert_format,
    dense_format: str,
    cache_dtype: str,
    hw: Hardware,
    ep_collective: str,
):
    c = config
    tokens = rows * tokens_per_row
    inventory = weight_inventory(c, expert_format=expert_format, dense_format=dense_format)
    weights = expert_bytes = 0.0
    dense_params = 0
    experts_per_layer = 0.0
    moe = isinstance(c, DeepSeekV3Config) and c.num_moe_layers > 0
    if moe:
        e, k = c.n_routed_experts, c.num_experts_per_tok
        if layout.kind == "ep":
            if e % layout.model:
                raise ValueError(
                    f"{e} routed experts do not divide over {layout.model} devices (layout {layout.name!r})"
                )
            touched = expected_max_group_experts(tokens, e, k, layout.model)  # whole experts on the busiest rank
            experts_per_layer = touched * layout.model
        else:
            touched = expected_distinct_experts(tokens, e, k)  # column shards of every touched expert
            experts_per_layer = touched
    for t in inventory:
        local = local_shape(t, layout)
        nbytes = format_bytes(local, t.fmt, t.path)
        if t.component == "routed_experts":
            if not t.layers:  # a DeepSeek-V3 config of dense layers only: no experts to read
                continue
            per_expert = nbytes / (t.layers * local[1])
            expert_bytes += touched * per_expert * t.layers
        elif t.path == "embed" and _head(c) != "embed":
            weights += min(tokens, local[0]) * local[1] * 2  # the looked-up rows only
        else:
            weights += nbytes
            if len(local) - (t.axes[0] == "layers") >= 2:
                dense_params += math.prod(local)
    flops = 2.0 * tokens * dense_params
    if moe:  # k experts per token, spread evenly over the model ranks
        expert_params = 3 * c.moe_intermediate_size * c.hidden_size
        flops += 2.0 * tokens * k * expert_params * c.num_moe_layers / layout.model
    keys = context + tokens_per_row
    heads_local = c.num_heads // layout.split("q_heads")
    if isinstance(c, DeepSeekV3Config):
        flops += 2.0 * tokens * c.num_layers * heads_local * keys * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    else:
        flops += 4.0 * tokens * c.num_layers * heads_local * keys * c.head_dim
    per_token = cache_bytes_per_token(c, layout, cache_dtype)
    vocab_local = c.vocab_size // layout.split("vocab")
    nbytes = {
        "weights": weights,
        "routed_experts": expert_bytes,
        "kv_cache": rows * keys * per_token + tokens * per_token,
        "logits": tokens * vocab_local * 4 + 2 * tokens * c.vocab_size * 4,
    }
    p, act = layout.model, tokens * c.hidden_size * ACT_BYTES
    coll, count = 0.0, 0
    if p > 1:
        coll += hw.all_reduce(act, p) + hw.all_gather(tokens * c.vocab_size * 4, p)  # embedding, logits
        count += 2
        for layer in range(c.num_layers):
            is_moe = moe and layer >= c.first_k_dense_replace
            if layout.kind == "ep" and is_moe and ep_collective == "all_to_all":
                dispatch = tokens / p * c.num_experts_per_tok * c.hidden_size * ACT_BYTES
                coll += hw.all_reduce(act, p) + 2 * hw.all_to_all(dispatch, p) + hw.all_gather(act, p)
                count += 4
            else:
                coll += 2 * hw.all_reduce(act, p)
                count += 2
    phase = Phase("verify", tokens, nbytes, flops, coll, count, hw)
    return phase, experts_per_layer


def _draft_phase(
    config, drafter: DFlashConfig, layout: MeshLayout, *, rows: int, context: int, cache_dtype: str, hw: Hardware
):
    c, d = config, drafter
    block = d.block_size
    tokens = rows * block
    draft_positions = rows * d.num_draft_tokens
    weights = 0.0
    params = 0
    for t in drafter_inventory(d, c.hidden_size):
        local = local_shape(t, layout)
        weights += format_bytes(local, t.fmt, t.path)
        if len(local) - (t.axes[0] == "layers") >= 2:
            params += math.prod(local)
    head = next(t for t in weight_inventory(c) if t.path == _head(c))
    head_local = local_shape(head, layout)
    weights += format_bytes(head_local, "bf16", head.path) + tokens * c.hidden_size * 2 / layout.split("vocab")
    heads_local = d.num_heads // layout.split("q_heads")
    keys = context + block
    # all drafter matmuls over the block (fc over the committed tokens, at most a block: an upper bound)
    flops = 2.0 * tokens * params + 4.0 * tokens * d.num_layers * heads_local * keys * d.head_dim
    flops += 2.0 * draft_positions * math.prod(head_local)
    per_token = drafter_cache_bytes_per_token(d, layout, cache_dtype)
    vocab_local = c.vocab_size // layout.split("vocab")
    nbytes = {
        "weights": weights,
        "kv_cache": rows * keys * per_token,
        "logits": draft_positions * vocab_local * 4 + 2 * draft_positions * c.vocab_size * 4,
    }
    p, act = layout.model, tokens * c.hidden_size * ACT_BYTES
    coll, count = 0.0, 0
    if p > 1:
        coll = (2 * d.num_layers + 1) * hw.all_reduce(act, p) + hw.all_gather(draft_positions * c.vocab_size * 4, p)
        count = 2 * d.num_layers + 2
    return Phase("draft", tokens, nbytes, flops, coll, count, hw)


def step_cost(
    config,
    *,
    drafter: DFlashConfig | None = None,
    method: str = "ddtree",
    budget: int | None = None,
    layout="tp8",
    batch: int = 1,
    context: int = 4096,
    expert_format: str | None = None,
    dense_format: str = "bf16",
    cache_dtype: str = "bf16",
    hardware: Hardware = H200,
    ep_collective: str = "allreduce",
    overhead_s: float = 0.0,
) -> StepCost:
    """The roofline of one decode step of `method` ("ar", "chain", "ddtree" with `budget`)."""
    check_method(method)
    if not isinstance(config, (DeepSeekV3Config, Qwen3Config)):
        raise ValueError(f"config must be a DeepSeekV3Config or Qwen3Config, got {type(config).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    if ep_collective not in EP_COLLECTIVES:
        raise ValueError(f"ep_collective must be one of {EP_COLLECTIVES}, got {ep_collective!r}")
    if overhead_s < 0:
        raise ValueError(f"overhead_s must be >= 0, got {overhead_s!r}")
    layout = parse_layout(layout)
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter config")
    if method == "ddtree":
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"ddtree needs an integer budget >= 1, got {budget!r}")
        tokens_per_row = budget + 1
    else:
        budget = None
        tokens_per_row = 1 if method == "ar" else drafter.block_size
    rows = -(-batch // layout.data)
    verify, experts = _verify_phase(
        config,
        layout,
        rows=rows,
        tokens_per_row=tokens_per_row,
        context=context,
        expert_format=expert_format,
        dense_format=dense_format,
        cache_dtype=cache_dtype,
        hw=hardware,
        ep_collective=ep_collective,
    )
    draft = None
    if method != "ar":
        draft = _draft_phase(config, drafter, layout, rows=rows, context=context, cache_dtype=cache_dtype, hw=hardware)
    return StepCost(method, budget, tokens_per_row, batch, layout, verify, draft, overhead_s, experts)


# --- tables ----------------------------------------------------------------------------------------------------------

# --model name: (the preset pair of ddtree_jax.presets.PAIRS, default layout, default budgets)
MODELS = {
    "k2.6": ("kimi-k2.6", "tp8", (8, 16, 32, 64)),
    "qwen3-8b": ("qwen3-8b", "single", (16, 64, 256)),
}


def roofline_table(
    config,
    drafter: DFlashConfig,
    *,
    layout="tp8",
    batch: int = 1,
    context: int = 4096,
    budgets=(8, 16, 32, 64),
    chain: bool = True,
    **kwargs,
) -> list[StepCost]:
    """AR, the DFlash chain (the drafter's block) and DDTree at each budget; kwargs go to step_cost."""
    common = dict(layout=layout, batch=batch, context=context, **kwargs)
    rows = [step_cost(config, method="ar", **common)]
    if chain:
        rows.append(step_cost(config, drafter=drafter, method="chain", **common))
    rows += [step_cost(config, drafter=drafter, method="ddtree", budget=b, **common) for b in budgets]
    return rows


def format_table(costs: list[StepCost], taus=()) -> str:
    """A markdown table; the first row must be AR (the break-even reference). GB = 1e9 bytes, per device."""
    ar = costs[0]
    if ar.method != "ar":
        raise ValueError(f"the first row must be AR, got {ar.method!r}")
    head = [
        "method",
        "tokens/row",
        "experts read/layer",
        "GB read",
        "TFLOP",
        "memory ms",
        "compute ms",
        "collectives ms",
        "step ms",
        "break-even tau",
    ] + [f"tok/s/row @ tau={t:g}" for t in taus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in costs:
        name = c.method if c.budget is None else f"{c.method} {c.budget}"
        experts = f"{c.experts_per_layer:.1f}" if c.experts_per_layer else "-"
        cells = [
            name,
            f"{c.tokens_per_row}",
            experts,
            f"{c.total_bytes / 1e9:.2f}",
            f"{c.flops / 1e12:.3f}",
            f"{c.memory_s * 1e3:.2f}",
            f"{c.compute_s * 1e3:.2f}",
            f"{c.collectives_s * 1e3:.2f}",
            f"{c.step_s * 1e3:.2f}",
            f"{break_even_tau(c, ar):.2f}",
        ]
        cells += [f"{c.tokens_per_s(1.0 if c.method == 'ar' else t):.0f}" for t in taus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_tokens_per_second(costs: list[StepCost], path: str, max_tau: float = 16.0) -> None:
    """tokens/s per row vs tau for each speculative row, with AR's line (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ar = costs[0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    taus = [1 + i * (max_tau - 1) / 100 for i in range(101)]
    for c in costs[1:]:
        label = c.method if c.budget is None else f"{c.method} {c.budget}"
        ax.plot(taus, [c.tokens_per_s(t) for t in taus], label=f"{label} (break-even {break_even_tau(c, ar):.2f})")
    ax.axhline(ar.tokens_per_s(), color="k", linestyle="--", label="AR")
    ax.set_xlabel("mean accepted tokens per step (tau)")
    ax.set_ylabel("tokens/s per row (roofline)")
    ax.set_title(f"{ar.layout.name}, batch {ar.batch}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_jax.analysis.roofline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="k2.6")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tp", type=int, help="tensor-parallel degree (K2.6 default: --tp 8)")
    group.add_argument("--ep", type=int, help="expert-parallel degree (attention stays head-parallel)")
    parser.add_argument("--data", type=int, default=1, help="data-parallel (batch) degree")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budgets", type=str, default=None, help="comma-separated DDTree budgets")
    parser.add_argument("--tau", type=float, action="append", default=[], help="add a tokens/s column at this tau")
    parser.add_argument(
        "--overhead-us", type=float, default=0.0, help="fixed per-step overhead (tree, sampling, launches)"
    )
    parser.add_argument("--ep-collective", choices=EP_COLLECTIVES, default="allreduce")
    parser.add_argument("--plot", help="write tokens/s vs tau to this PNG")
    args = parser.parse_args(argv)
    pair_name, default_layout, default_budgets = MODELS[args.model]
    try:
        if args.tp is not None:  # 0 is a bad size (MeshLayout says so), not "not given"
            layout = MeshLayout("tp", args.tp, args.data)
        elif args.ep is not None:
            layout = MeshLayout("ep", args.ep, args.data)
        else:
            layout = parse_layout(default_layout)
            layout = MeshLayout(layout.kind, layout.model, args.data)
        budgets = tuple(int(b) for b in args.budgets.split(",")) if args.budgets else default_budgets
        costs = roofline_table(
            *preset_pair(pair_name),
            layout=layout,
            batch=args.batch,
            context=args.context,
            budgets=budgets,
            ep_collective=args.ep_collective,
            overhead_s=args.overhead_us * 1e-6,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.model} on {layout.devices} x {H200.name} ({layout.name}), batch {args.batch}, context {args.context:,}; "
        f"per device, HBM {H200.hbm_bytes_per_s / 1e12:.1f} TB/s, {H200.peak_flops / 1e12:.0f} TFLOP/s, "
        f"overhead {args.overhead_us:g} us"
    )
    print(format_table(costs, args.tau))
    if args.plot:
        plot_tokens_per_second(costs, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
