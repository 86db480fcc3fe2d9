"""`DecodeOptions`: the one frozen, hashable options object of a decode run (implementation choices and
verifier settings), taken by the engine (`generate`, `decode_step`, the host loop), the profiler, the
benchmarks and the studies. It is a static argument under jit: two equal options share one compilation.

The decode method, budget and block size stay separate arguments: they are what an experiment varies.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddtree_jax import dispatch

METHODS = ("ddtree", "chain", "ar")  # decode methods: DDTree's best-first tree, the DFlash chain, plain AR
VERIFIERS = ("sampling", "sample_then_walk")  # tree rejection walks: coin buckets (verify_sampling), the DDTree paper's
ORDER_POLICIES = ("draft", "reverse", "random")  # sibling verification orders
MAX_BUDGET = 1024  # the largest DDTree budget: build_tree / build_conditional_tree and --budget (N = budget + 1 slots)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def check_options(
    method: str,
    *,
    budget: int | None = None,
    block_size: int | None = None,
    max_new_tokens: int = 1,
    drafter=None,
    target_config=None,
) -> None:
    """The prompt-independent checks of a generation (`engine.run.check_request`, `engine.generate`): the method
    (and its drafter, for DDTree / chain), budget in [1, MAX_BUDGET] (DDTree), block size an int in [2, the
    drafter's max_block_size] (every method, AR's >= 1: it sizes AR's KV cache too; no upper bound without a
    drafter),
    max_new_tokens >= 1; with both a drafter and target_config, the target taps the layers the drafter reads
    (another count failed deep in the drafter's projection, another set ran with wrong features). ValueError naming
    the bad value."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    reads = getattr(getattr(drafter, "config", None), "target_layers", None)  # a DFlash drafter's (duck-typed)
    if method != "ar" and target_config is not None and reads is not None:
        taps, reads = tuple(target_config.tapped_layers), tuple(reads)
        if taps != reads:
            raise ValueError(
                f"the target taps layers {taps} but the drafter reads target layers {reads}: set the target config's "
                "tapped_layers to the drafter's target_layers (`engine.run.load_pair` does)"
            )
    if block_size is not None:  # AR too (>= 1: it only sizes AR's KV cache), within the drafter's
        check_block_size(
            block_size, drafter.max_block_size if drafter is not None else None, least=1 if method == "ar" else 2
        )
    if method == "ddtree":
        check_ddtree_budget(budget)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def check_block_size(block_size, largest: int | None = None, least: int = 2) -> None:
    """A block size: an int in [least, largest] (largest: the drafter's; None: no upper bound). ValueError."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, (int, np.integer))
        or block_size < least
        or (largest is not None and block_size > largest)
    ):
        where = f"an int >= {least}" if largest is None else f"in [{least}, {largest}] (the drafter's block_size)"
        raise ValueError(f"block_size must be {where}, got {block_size}")


def check_ddtree_budget(budget) -> None:
    """A DDTree budget: an int in [1, MAX_BUDGET]. ValueError naming it."""
    if isinstance(budget, bool) or not (isinstance(budget, (int, np.integer)) and 1 <= budget <= MAX_BUDGET):
        raise ValueError(f"budget must be in [1, {MAX_BUDGET}], got {budget}")


def check_budgets(budgets) -> tuple[int, ...]:
    """The budgets as a strictly increasing tuple of ints >= 1 (ValueError naming the bad value)."""
    out = tuple(budgets)
    if not out:
        raise ValueError("a budget set needs at least one budget")
    for b in out:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"budgets must be ints >= 1, got {b!r} in {out}")
    if any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError(f"budgets must be strictly increasing, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class BudgetPolicy:
    """The cost-aware DDTree budget (issue #23): each decode step builds the tree at the largest budget of
    `budgets`, predicts each budget's tokens per step from its sub-tree's surrogate (`tree.budget`), and runs
    the verification of the budget with the most predicted tokens per millisecond (`tree.budget.
    choose_budget_index`), all on device (a `lax.switch` over one compiled branch per budget).

    Attributes:
      budgets: strictly increasing ints >= 1 (the compiled set, e.g. (8, 16, 32, 64, 128)).
      step_ms: the decode step's time per budget (measured at start-up: `engine.budget.fit_budget_policy`),
        positive floats, one per budget.
      scale: the surrogate's calibration per budget, positive floats: predicted tokens per step =
        1 + scale * (surrogate - 1), fitted on the accepted lengths of a calibration run (1.0: uncalibrated).
    """

    budgets: tuple[int, ...]
    step_ms: tuple[float, ...]
    scale: tuple[float, ...]

    def __post_init__(self):
        budgets = check_budgets(self.budgets)
        for name in ("step_ms", "scale"):
            values = tuple(getattr(self, name))
            if len(values) != len(budgets):
                raise ValueError(f"BudgetPolicy.{name} needs one value per budget {budgets}, got {values}")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
                    raise ValueError(f"BudgetPolicy.{name} must hold finite numbers > 0, got {v!r} in {values}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        object.__setattr__(self, "budgets", budgets)

    @property
    def max_budget(self) -> int:
        """The budget every step's tree is built at (the `budget` argument of a run with this policy)."""
        return self.budgets[-1]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How a decode step runs (what it computes is fixed by method, budget, block size and sampling).

    Attributes:
      attn_impl: target attention, one of `dispatch.ATTENTION_IMPLS`.
      matmul_impl: target matmuls, one of `dispatch.MATMUL_IMPLS`.
      moe_impl: MoE targets' expert dispatch, one of `dispatch.MOE_IMPLS` ("ep" under an expert-parallel mesh).
      verify_impl: the tree rejection walk's implementation, one of `dispatch.VERIFY_IMPLS` (the fused
        Pallas kernel or the XLA walk); the sample-then-walk verifier always runs in XLA.
      layer_loop: the target's layer loop, one of `dispatch.LAYER_LOOPS` ("auto": the model's default).
      tree_impl: the DDTree builder, one of `dispatch.TREE_IMPLS`: the Pallas top-K and best-first
        selection kernels, or the XLA builder.
      topk_impl: the per-depth top-K, one of `dispatch.BUILD_TOPK_IMPLS` ("auto": the kernel's own under
        tree_impl "pallas"; "vocab_parallel" under either builder).
      order: sibling verification order, one of ORDER_POLICIES.
      verifier: one of VERIFIERS.
      threshold_acc, threshold_single: the walk's acceptance thresholds in [0, 1]; 1.0 / 1.0 is exact, lower
        values are a LOSSY mode (biased, sibling-order dependent) kept for ablations.
      steps_per_iteration: decode steps per iteration of `generate`'s while_loop (an int >= 1). On a GPU each
        iteration costs a host round trip (the loop predicate read back, the next CUDA graph launched); k
        steps per iteration pay it once per k steps, and the steps run after every row is done (at most
        k - 1 at the end) change nothing but cost time. Outputs are identical for every k.
      prefill_chunk: prompt tokens per prefill chunk (an int >= 0): prompts longer than it are prefilled
        chunk by chunk (memory of one chunk, not of the whole prompt); 0 ("auto"): `dispatch.prefill_chunk`.
      budget_policy: None (the run's fixed budget) or a `BudgetPolicy`: DDTree's budget chosen per step on
        device; the run's `budget` must then be the policy's largest.
    Every "auto" is resolved by `ddtree_jax.dispatch` (see `dispatch.decode_plan`).
    """

    attn_impl: str = "auto"
    matmul_impl: str = "auto"
    moe_impl: str = "auto"
    verify_impl: str = "auto"
    layer_loop: str = "auto"
    tree_impl: str = "auto"
    topk_impl: str = "auto"
    order: str = "draft"
    verifier: str = "sampling"
    threshold_acc: float = 1.0
    threshold_single: float = 1.0
    steps_per_iteration: int = 1
    prefill_chunk: int = 0
    budget_policy: BudgetPolicy | None = None

    def __post_init__(self):
        for name, allowed in (
            ("attn_impl", dispatch.ATTENTION_IMPLS),
            ("matmul_impl", dispatch.MATMUL_IMPLS),
            ("moe_impl", dispatch.MOE_IMPLS),
            ("verify_impl", dispatch.VERIFY_IMPLS),
            ("layer_loop", dispatch.LAYER_LOOPS),
            ("tree_impl", dispatch.TREE_IMPLS),
            ("topk_impl", dispatch.BUILD_TOPK_IMPLS),
            ("order", ORDER_POLICIES),
            ("verifier", VERIFIERS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"DecodeOptions.{name} must be one of {allowed}, got {value!r}")
        for name in ("threshold_acc", "threshold_single"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"DecodeOptions.{name} must be a number in [0, 1], got {value!r}")
        steps = self.steps_per_iteration
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"DecodeOptions.steps_per_iteration must be an int >= 1, got {steps!r}")
        dispatch.prefill_chunk(self.prefill_chunk, 0)  # validates (a ValueError naming the value)
        if self.budget_policy is not None and not isinstance(self.budget_policy, BudgetPolicy):
            raise ValueError(f"DecodeOptions.budget_policy must be a BudgetPolicy or None, got {self.budget_policy!r}")
        if self.verifier == "sample_then_walk" and (self.threshold_acc, self.threshold_single) != (1.0, 1.0):
            raise ValueError(
                "DecodeOptions: the sample-then-walk verifier has no lossy thresholds; "
                f"got threshold_acc={self.threshold_acc}, threshold_single={self.threshold_single}"
            )

    def replace(self, **changes) -> DecodeOptions:
        return dataclasses.replace(self, **changes)

    def check_step(self, method: str, *, budget: int, block_size: int) -> None:
        """`check_options` for a step of `method` without a drafter at hand (`dispatch.decode_plan`, which cannot
        import this module): the method, a budget in [1, MAX_BUDGET] (DDTree), a block size >= 2 (AR: >= 1)."""
        check_method(method)
        if method == "ddtree":
            check_ddtree_budget(budget)
        check_block_size(block_size, None, least=1 if method == "ar" else 2)

    def target_impls(self, target_config) -> dict:
        """The implementation keywords of the target's prefill / tree forward: attention and matmul for every
        family, the MoE dispatch for MoE targets (DeepSeek-V3 / K2), and the layer loop unless "auto"."""
        impls = {"attn_impl": self.attn_impl, "matmul_impl": self.matmul_impl}
        if self.layer_loop != "auto":
            impls["layer_loop"] = self.layer_loop
        if hasattr(target_config, "n_routed_experts"):
            impls["moe_impl"] = self.moe_impl
        elif self.moe_impl != "auto":
            raise ValueError(
                f"moe_impl={self.moe_impl!r} needs an MoE target; {type(target_config).__name__} has no experts"
            )
        return impls
