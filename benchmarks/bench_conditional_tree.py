"""The path-conditioned tree builder's cost, by part (issue #23: the head's share of the DDTree step).

At the embedded pair's shapes (hidden 256, head inner 512, V = 8192, L = 16 draft depths, B = 1; random
weights: the cost does not depend on their values), per tree, inside one jit that builds 8 trees from 8
different inputs (lax.map, so nothing is hoisted):

  marginal            build_tree (the DDTree builder, kernels on GPU): the baseline the head adds to
  conditional/<impl>  build_conditional_tree with the child head, the parents' top-K by impl (pallas / xla)
  head only           the head's child logits at every level (L - 1 calls on `budget` parents), nothing else
  top-K only          the top-K of those logits per level (`kernel_top_k_logits`, what impl pallas runs)

FLOPs and bytes: the head's matmuls are 2 x budget x (2D x inner + inner x D + D x V) per level, about
0.3 GFLOP per tree at budget 64: microseconds at the bf16 peak, so the builder is bound by its L - 1
sequential levels of small launches, not by arithmetic; the table's "floor" column is that arithmetic at
the peak, for scale.

Usage: python -m benchmarks.bench_conditional_tree --commit $(git rev-parse --short HEAD) [--quick]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import device_description, markdown_table, time_calls, write_result
from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.models import child_head
from ddtree_jax.tree import build_tree
from ddtree_jax.tree.build import kernel_top_k_logits
from ddtree_jax.tree.conditional import build_conditional_tree

BF16_PEAK = 989e12  # dense bf16 FLOP/s of the H200 (SXM), for the floor column


def _draft_inputs(key, batch, depth, vocab, hidden_size, dtype):
    """One tree's varying inputs: the draft pass's logits [B, L, V] and hidden states [B, L, D]."""
    k1, k2 = jax.random.split(key)
    draft_logits = jax.random.normal(k1, (batch, depth, vocab), jnp.float32) * 3.0
    return draft_logits.astype(dtype), jax.random.normal(k2, (batch, depth, hidden_size), dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="small shapes, few reps (CPU smoke run)")
    parser.add_argument("--budgets", default="16,64,128")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    depth, vocab, hidden_size, inner = (16, 8192, 256, 512) if not args.quick else (4, 512, 32, 64)
    budgets = [int(b) for b in args.budgets.split(",")] if not args.quick else [8]
    reps = args.reps if not args.quick else 2
    batch, trees, dtype = 1, 8, jnp.bfloat16
    config = ChildHeadConfig(hidden_size=hidden_size, inner_size=inner)
    shapes = child_head.param_shapes(config)  # random out_proj too (init_params zeroes it): a trained head's work
    params = {
        name: jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype) * 0.02
        for i, (name, (shape, _)) in enumerate(shapes.items())
    }
    fn = functools.partial(child_head.head_child_logits, config)
    keys = jax.random.split(jax.random.key(0), trees)
    draft, hidden = jax.vmap(lambda k: _draft_inputs(k, batch, depth, vocab, hidden_size, dtype))(keys)
    # one model: its tables do not vary between trees, the draft inputs do
    embed, lm_head = (
        (jax.random.normal(jax.random.key(seed), (vocab, hidden_size), jnp.float32) * 0.05).astype(dtype)
        for seed in (10, 11)
    )
    print(f"device: {device_description()}; L = {depth}, V = {vocab}, D = {hidden_size}, inner = {inner}", flush=True)

    def per_tree(body):
        step = jax.jit(lambda d, h: jax.lax.map(lambda xs: body(*xs), (d, h)))
        return time_calls(step, [(draft, hidden)], runs=reps, warmup=2).median * 1e6 / trees

    rows, records = [], []
    for budget in budgets:
        roots = jnp.zeros((batch,), jnp.int32)

        def inputs_of(h):
            return child_head.HeadInputs(params=params, hidden=h, embed=embed, lm_head=lm_head)

        def head_only(d, h, budget=budget):
            tokens = jnp.argsort(-d[:, 0].astype(jnp.float32), axis=-1)[:, :budget].astype(jnp.int32)
            return [fn(inputs_of(h), level, tokens + level).sum() for level in range(1, depth)]

        def topk_only(d, h, budget=budget):
            logits = jnp.broadcast_to(d[:, :1].astype(jnp.float32), (batch, budget, vocab))
            return [kernel_top_k_logits(logits + level, min(budget, vocab))[0] for level in range(1, depth)]

        parts = {
            "marginal": lambda d, h, budget=budget: build_tree(d, budget, roots, check_finite=False).tokens,
            "conditional/pallas": lambda d, h, budget=budget: build_conditional_tree(
                d[:, 0], fn, inputs_of(h), budget, depth, roots, impl="pallas"
            ).tokens,
            "conditional/xla": lambda d, h, budget=budget: build_conditional_tree(
                d[:, 0], fn, inputs_of(h), budget, depth, roots, impl="xla"
            ).tokens,
            "head only": head_only,
            "top-K only": topk_only,
        }
        flops = 2 * budget * (2 * hidden_size * inner + inner * hidden_size + hidden_size * vocab) * (depth - 1)
        rec = {
            "budget": budget,
            "depth": depth,
            "vocab": vocab,
            "head_flops": flops,
            "floor_us": flops / BF16_PEAK * 1e6,
        }
        for name, body in parts.items():
            rec[name] = per_tree(body)
            print(f"  budget {budget} {name}: {rec[name]:.1f} us per tree", flush=True)
            write_result("bench_conditional_tree", {"cases": records + [rec]}, args.commit)
        records.append(rec)
        rows.append([budget] + [rec[name] for name in parts] + [rec["floor_us"]])
    table = markdown_table(["budget", *(f"{name} us" for name in parts), "head FLOP floor us"], rows)
    path = write_result("bench_conditional_tree", {"cases": records, "table": table}, args.commit)
    print(table)
    print(f"written {path}")


if __name__ == "__main__":
    main()
