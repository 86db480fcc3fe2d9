"""The cost-aware budget's own cost per decode step (issue #23): the policy's machinery with its choice forced.

A `BudgetPolicy` step builds the tree at the policy's largest budget, computes every sub-tree's surrogate, picks
a budget and runs that budget's verification inside a `lax.switch` (`engine.step`). Forced to one budget b (its
step_ms 1, every other budget's 1e6: the argmax is b whatever the surrogates), the run emits exactly the
fixed-budget-b tokens (tests/engine/test_budget.py), so the difference of the two step times is what the
machinery costs: the larger tree, the surrogates and the choice, the switch.

Variants (DDTree, the forced budget b = --budget, default 64), each one compiled `generate`:
  fixed             no policy, budget b
  policy b          policy (b,): the surrogates and the choice, the tree at b, no switch (a one-branch
                    `lax.switch` is a plain call)
  policy lo,b       policy (b / 4, b): a two-branch switch, the tree at b
  policy all        policy (b / 4, b / 2, b, 2 b): the tree at 2 b, a four-branch switch (at b = 64 the
                    float32 study's set)
  fixed 2b          no policy, budget 2 b: the larger tree's cost, verified at 2 b (for scale)
Step time: `engine.budget.time_short_long` (each prompt alone, B = 1, every row stopped after `--short` and
after `--long` new tokens, no stop tokens: the difference of the two wall times over the difference of their
steps; prefill, compile and the call's host round trip cancel), the median over repeats, then the median over
`--prompts` held-out prompts (one prompt of four read 0.49 against 0.31-0.33 ms in the first run: the mean
followed it). Overhead = variant - fixed, in ms and in % of the fixed step.

Usage (GPU): PYTHONPATH=.:kernels python -m benchmarks.bench_budget_overhead --commit $(git rev-parse --short HEAD)
CPU smoke: ... --prompts 1 --short 2 --long 6 --budget 8 --repeats 1 (timer noise; the machinery only).
Writes budget_overhead_T<T>_<commit>.json to --out / $OUT.
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

from benchmarks.bench_e2e import PAIR_DIR, PROMPTS, load_prompt_ids
from benchmarks.common import device_description, markdown_table, write_result
from ddtree_jax.engine.budget import time_short_long
from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.run import (
    DTYPE_CHOICES,
    generate_static,
    load_dtype,
    load_pair,
    request_args,
    resolve_block_size,
)
from ddtree_jax.options import BudgetPolicy, DecodeOptions


def forced_policy(budgets: tuple[int, ...], forced: int) -> BudgetPolicy:
    """A policy over `budgets` that picks `forced` at every step (its step time 1 ms, every other 1e6 ms)."""
    if forced not in budgets:
        raise ValueError(f"the forced budget {forced} is not in the policy's budgets {budgets}")
    step_ms = tuple(1.0 if b == forced else 1e6 for b in budgets)
    return BudgetPolicy(budgets=budgets, step_ms=step_ms, scale=(1.0,) * len(budgets))


def variants(budget: int) -> list[tuple[str, int, DecodeOptions]]:
    """(name, the run's budget, options) of the module docstring's variants for forced budget `budget`."""
    if budget < 4 or budget % 4:
        raise ValueError(f"--budget must be a multiple of 4 (>= 4): its set is b / 4, b / 2, b, 2 b; got {budget}")
    every = (budget // 4, budget // 2, budget, 2 * budget)
    return [
        ("fixed", budget, DecodeOptions()),
        (f"policy {budget}", budget, DecodeOptions(budget_policy=forced_policy((budget,), budget))),
        (
            f"policy {budget // 4},{budget}",
            budget,
            DecodeOptions(budget_policy=forced_policy((budget // 4, budget), budget)),
        ),
        ("policy " + ",".join(map(str, every)), 2 * budget, DecodeOptions(budget_policy=forced_policy(every, budget))),
        (f"fixed {2 * budget}", 2 * budget, DecodeOptions()),
    ]


def step_ms(pair, prompt_ids, *, budget: int, options: DecodeOptions, temperature: float, short, long, repeats):
    """(median over prompts of the per-prompt median step ms, the per-prompt medians) for one variant."""
    block = resolve_block_size(pair, "ddtree", None)
    static = generate_static(
        pair, method="ddtree", budget=budget, block_size=block, max_new_tokens=long, options=options
    )
    compiled = None
    per_prompt = []
    for ids in prompt_ids:
        args = request_args(pair, [ids], temperature=temperature, seed=0, max_new_tokens=long)
        short_args = args[:-1] + (jnp.full((1,), short, jnp.int32),)
        if compiled is None:  # every prompt has the same length: one program
            compiled = generate.lower(*args, **static).compile()
        per_repeat, _ = time_short_long(lambda call: compiled(*call[1:]), short_args, args, repeats)
        per_prompt.append(float(np.median(per_repeat)) if per_repeat else float("nan"))
    return float(np.median(per_prompt)), per_prompt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--pair", default=PAIR_DIR)
    parser.add_argument("--budget", type=int, default=64, help="the forced budget b (a multiple of 4)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts timed (each alone, B = 1)")
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="the pair's weights (auto: the checkpoint's on GPU)"
    )
    parser.add_argument("--out", default=None, help="directory for the JSON (default $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if not 1 <= args.short < args.long:
        raise SystemExit(f"error: need 1 <= --short < --long, got {args.short}, {args.long}")
    pair = load_pair(os.path.join(args.pair, "target"), os.path.join(args.pair, "drafter"), load_dtype(args.dtype))
    prompt_ids = load_prompt_ids(PROMPTS)[: args.prompts]
    print(f"device: {device_description()}; commit {args.commit}; forced budget {args.budget}", flush=True)
    rows = []
    for name, budget, options in variants(args.budget):
        median_ms, per_prompt = step_ms(
            pair,
            prompt_ids,
            budget=budget,
            options=options,
            temperature=args.temperature,
            short=args.short,
            long=args.long,
            repeats=args.repeats,
        )
        rows.append({"variant": name, "tree_budget": budget, "step_ms": median_ms, "per_prompt_ms": per_prompt})
        print(f"  {name:22s} tree {budget:4d}: {median_ms:.4f} ms/step", flush=True)
        base = rows[0]["step_ms"]
        for row in rows:
            row["overhead_ms"] = row["step_ms"] - base
            row["overhead_pct"] = 100 * (row["step_ms"] / base - 1)
        write_result(
            f"budget_overhead_T{args.temperature:g}_{args.commit}",
            {"settings": vars(args), "rows": rows},
            args.commit,
            args.out,
        )
    print(
        markdown_table(
            ["variant", "tree budget", "ms/step", "overhead ms", "overhead %"],
            [[r["variant"], r["tree_budget"], r["step_ms"], r["overhead_ms"], r["overhead_pct"]] for r in rows],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
