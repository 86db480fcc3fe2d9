"""Sampling-correctness experiment: is DDTree's tree verification exact at temperature T?

A Markov-chain target (V tokens, transition logits drawn once from a seed) and a drafter table
correlated with it (`ddtree_jax.verify.markov`). For every configuration (temperature, filter,
sibling order, verification method, thresholds) many independent chains run three DDTree steps; the
joint law of their first three emitted tokens is compared with the exact law (enumeration), and the
first step's mean accepted length with the analytic sum over the tree's nodes of the path probability.

Reported per configuration: total-variation distance (and the TV of a direct multinomial draw of the
same size from the exact law: the noise floor), the chi-square p-value, analytic vs empirical E[tau],
and the z-score of their difference. Exact modes should show p-values spread over (0, 1) and |z| of
a few at most; the lossy rows (threshold_acc < 1) should fail both.

  python -m experiments.sampling_correctness --samples 1000000 --out results/   # GPU grid
  python -m experiments.sampling_correctness --quick                            # small CPU version
  python -m experiments.sampling_correctness --impl pallas --samples 200000      # through the fused kernel (GPU)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax.sampling import SamplingParams
from ddtree_jax.tree import build_tree
from ddtree_jax.verify.markov import (
    chi_square_pvalue,
    exact_law,
    expected_accepted,
    simulate,
    transition_probs,
)

FILTERS = {
    "none": dict(),
    "top-k 3": dict(top_k=3),
    "top-p 0.8": dict(top_p=0.8),
    "min-p 0.1": dict(min_p=0.1),
    "k5 p0.9 min-p0.05": dict(top_k=5, top_p=0.9, min_p=0.05),
}


@dataclasses.dataclass(frozen=True)
class Config:
    temperature: float
    filter: str
    order: str = "draft"
    method: str = "sampling"
    threshold_acc: float = 1.0
    budget: int = 10
    depth: int = 3

    @property
    def lossy(self) -> bool:
        return self.threshold_acc < 1.0


@dataclasses.dataclass(frozen=True)
class Problem:
    vocab: int = 6
    depth: int = 3
    budget: int = 10
    root: int = 2
    seed: int = 0

    def tables(self):
        rng = np.random.default_rng(self.seed)
        transition = rng.standard_normal((self.vocab, self.vocab)) * 1.5
        draft = transition[:, None, :] * 0.7 + rng.standard_normal((self.vocab, self.depth, self.vocab))
        return jnp.asarray(transition, jnp.float32), jnp.asarray(draft, jnp.float32)


def run_config(problem: Problem, config: Config, samples: int, chunk: int, seed: int, impl: str = "xla") -> dict:
    problem = dataclasses.replace(problem, budget=config.budget, depth=config.depth)
    transition, draft = problem.tables()
    filter_kwargs = FILTERS[config.filter]
    probs = transition_probs(transition, SamplingParams.create(1, temperature=config.temperature, **filter_kwargs))
    law = exact_law(probs, problem.root, 3)
    counts = np.zeros((problem.vocab,) * 3)
    acc_sum = acc_sq = 0.0
    done = 0
    start = time.perf_counter()
    while done < samples:
        n = min(chunk, samples - done)
        params = SamplingParams.create(n, temperature=config.temperature, **filter_kwargs)
        emitted, accepted = simulate(
            transition,
            draft,
            params,
            jnp.full((n,), problem.root, jnp.int32),
            jax.random.key(seed * 1000003 + done),
            budget=problem.budget,
            num_steps=3,
            order=config.order,
            verifier=config.method,
            threshold_acc=config.threshold_acc,
            impl=impl if config.method == "sampling" else "xla",
        )
        emitted, first = np.asarray(emitted), np.asarray(accepted[:, 0], np.float64)
        np.add.at(counts, (emitted[:, 0], emitted[:, 1], emitted[:, 2]), 1)
        acc_sum, acc_sq, done = acc_sum + first.sum(), acc_sq + (first**2).sum(), done + n
    elapsed = time.perf_counter() - start
    empirical = counts / counts.sum()
    tv = 0.5 * np.abs(empirical - law).sum()
    floor = (
        0.5
        * np.abs(
            np.random.default_rng(seed).multinomial(samples, law.ravel() / law.sum()) / samples
            - law.ravel() / law.sum()
        ).sum()
    )
    tree = build_tree(draft[problem.root][None], problem.budget, jnp.array([problem.root], jnp.int32))
    analytic = expected_accepted(tree, 0, probs) + 1.0
    mean = acc_sum / samples + 1.0
    stderr = np.sqrt(max(acc_sq / samples - (mean - 1.0) ** 2, 0.0) / samples)
    return {
        **dataclasses.asdict(config),
        "lossy": config.lossy,
        "samples": samples,
        "tv": float(tv),
        "tv_noise_floor": float(floor),
        "chi2_p": chi_square_pvalue(counts, law),
        "tau_analytic": analytic,
        "tau_empirical": mean,
        "tau_z": float((mean - analytic) / stderr) if stderr > 0 else 0.0,
        "seconds": elapsed,
    }


def default_grid(
    quick: bool, filters: tuple[str, ...] | None = None, shapes: tuple[tuple[int, int], ...] = ((10, 3),)
) -> list[Config]:
    """temperatures x filters x sibling orders (+ sample-then-walk, + the lossy contrast), per tree
    shape (budget, depth)."""
    grid = []
    for budget, depth in shapes:
        grid += [dataclasses.replace(c, budget=budget, depth=depth) for c in _grid_one_shape(quick, filters)]
    return grid


def _grid_one_shape(quick: bool, filters: tuple[str, ...] | None) -> list[Config]:
    temps = (0.7, 1.0) if quick else (0.3, 0.7, 1.0, 1.5)
    filters = filters or (("none", "top-k 3") if quick else tuple(FILTERS))
    unknown = [f for f in filters if f not in FILTERS]
    if unknown:
        raise ValueError(f"unknown filter(s) {unknown}; choose from {list(FILTERS)}")
    grid = [Config(t, f, order) for t in temps for f in filters for order in ("draft", "reverse", "random")]
    grid += [Config(t, f, "draft", "sample_then_walk") for t in temps for f in filters]
    grid += [Config(1.0, "none", order, threshold_acc=0.5) for order in ("draft", "reverse")]
    return grid


def run_grid(
    configs: list[Config],
    samples: int,
    chunk: int,
    seed: int = 1,
    problem: Problem = Problem(),
    progress: bool = True,
    on_row=None,
    impl: str = "xla",
) -> list[dict]:
    """Runs every configuration; `on_row(rows)` is called after each (e.g. to save partial results).
    impl: `verify_step`'s implementation for the exact-sampling rows ("pallas": the fused tree-sampling
    kernel of kernels/tree_sampling.py; the sample-then-walk rows always run in XLA)."""
    rows = []
    for i, config in enumerate(tqdm(configs, desc="configs", disable=not progress)):
        rows.append(run_config(problem, config, samples, chunk, seed + i, impl))
        if on_row is not None:
            on_row(rows)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        "| tree | T | filter | order | method | thr_acc | TV | TV floor | chi2 p | tau analytic | tau empirical | z |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| b{r.get('budget', 10)} d{r.get('depth', 3)} | {r['temperature']} | {r['filter']} | {r['order']} | {r['method']} | {r['threshold_acc']} | "
            f"{r['tv']:.5f} | {r['tv_noise_floor']:.5f} | {r['chi2_p']:.3g} | {r['tau_analytic']:.4f} | "
            f"{r['tau_empirical']:.4f} | {r['tau_z']:+.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--samples", type=int, default=None, help="chains per configuration (default 10^6, --quick 20000)"
    )
    parser.add_argument("--chunk", type=int, default=None, help="chains per device batch (bounds memory)")
    parser.add_argument("--quick", action="store_true", help="a small grid with few samples (CPU)")
    parser.add_argument("--filters", default=None, help="comma-separated subset of: " + ", ".join(FILTERS))
    parser.add_argument("--shapes", default="10x3", help="tree shapes BUDGETxDEPTH, comma-separated (default 10x3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--impl",
        default="xla",
        choices=["xla", "pallas", "auto"],
        help="verification implementation (pallas: the fused kernel; interpret mode off GPU)",
    )
    parser.add_argument("--commit", default="unknown", help="the commit being measured (recorded in the output)")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs"), help="directory for the JSON and CSV")
    args = parser.parse_args(argv)
    # every argument is checked before any chain runs (0 used to mean "the default", a malformed shape gave a
    # traceback, and repeated filters or shapes gave duplicate rows)
    for name in ("samples", "chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value}: must be at least 1")
    samples = 1_000_000 if args.samples is None else args.samples
    if args.quick and args.samples is None:
        samples = 20_000
    chunk = min(samples, 1_000_000) if args.chunk is None else args.chunk
    shapes = []
    for shape in args.shapes.split(","):
        try:
            budget, depth = (int(v) for v in shape.split("x"))
        except ValueError:
            parser.error(f"--shapes: {shape!r} is not BUDGETxDEPTH (two integers, e.g. 10x3; comma-separate several)")
        if budget < 1 or depth < 1:
            parser.error(f"--shapes: {shape!r}: budget and depth must be at least 1")
        shapes.append((budget, depth))
    if len(set(shapes)) != len(shapes):
        parser.error(f"--shapes {args.shapes!r}: each shape may appear only once")
    filters = None
    if args.filters is not None:
        filters = tuple(args.filters.split(","))
        if not args.filters or any(not f for f in filters):
            parser.error(f"--filters {args.filters!r}: empty filter name; choose from: {', '.join(FILTERS)}")
        unknown = [f for f in filters if f not in FILTERS]
        if unknown:
            parser.error(
                f"--filters: unknown filter(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(FILTERS)}"
            )
        if len(set(filters)) != len(filters):
            parser.error(f"--filters {args.filters!r}: each filter may appear only once")
    shapes = tuple(shapes)
    configs = default_grid(args.quick, filters, shapes)
    print(f"{len(configs)} configurations x {samples} chains on {jax.devices()[0].platform}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0]),
        "commit": args.commit,
        # the tree shapes actually run (Problem's own budget/depth are only defaults, replaced per configuration)
        "problem": {
            **{k: v for k, v in dataclasses.asdict(Problem()).items() if k not in ("budget", "depth")},
            "shapes": [{"budget": b, "depth": d} for b, d in shapes],
        },
        "samples": samples,
        "impl": args.impl,
    }

    def save(rows, table=None):
        with open(os.path.join(args.out, "sampling_correctness.json"), "w") as f:
            json.dump({**meta, "rows": rows, "table": table or format_table(rows)}, f, indent=2)

    rows = run_grid(configs, samples, chunk, args.seed, on_row=save, impl=args.impl)
    table = format_table(rows)
    print(table)
    exact = [r for r in rows if not r["lossy"]]
    print(
        f"\nexact modes: min chi2 p = {min(r['chi2_p'] for r in exact):.3g} over {len(exact)} tests; "
        f"max |z| = {max(abs(r['tau_z']) for r in exact):.2f}"
    )
    save(rows, table)
    with open(os.path.join(args.out, "sampling_correctness.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"written {args.out}/sampling_correctness.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
