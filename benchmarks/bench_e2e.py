"""End-to-end decode benchmark on the embedded pair: AR, the DFlash chain and DDTree at several budgets on
the 16 held-out prompts, tokens per second with the prefill timed apart.

For each temperature setting (T = 0; T = 1 with top-p 0.95) and each column (AR, chain, DDTree at every
budget), one program is compiled per column (`engine.generate`, the prompts padded to one width); then
each prompt runs alone (B = 1, request key = prompt index) through every column in turn, `--repeats` times
each (the columns interleaved prompt by prompt, so a machine's drift over the run is shared):

  decode s      median wall time of the whole generation minus the median time of the same program with
                max_new = 1 (prefill and first token only: the rows are done before the first step; same
                compiled program, so the same shapes)
  tokens_per_s  (generated tokens - 1) over the summed decode seconds of all prompts: decode speed, the
                prefill excluded (reported apart as prefill_ms, per prompt)
  mean_tau      mean over prompts of the tokens per decode step

The prompts are `benchmarks/held_out_prompts_16x128.json`: 16 prompts of 128 tokens from the pair's
held-out files, written by `python -m experiments.held_out_prompts --n 16 --length 128
--min-continuation 256 --json ...` (pass another file with --prompts). The JSON follows the `ddtree-jax
bench --json` layout (`device`, `settings`, `results` rows with `method`, `budget`, `tokens_per_s`,
`mean_tau`), one file per temperature: `e2e_embedded_T0_<commit>.json`, `e2e_embedded_T1_<commit>.json`.

Targets (H200): T = 0, the best DDTree budget >= 2.0x AR and >= 1.25x the chain; T = 1, >= 1.2x AR and
>= 1.25x the chain.

Usage: python -m benchmarks.bench_e2e --commit $(git rev-parse --short HEAD) [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_description, markdown_table, out_dir_problem, time_calls, write_result
from ddtree_jax.dispatch import ATTENTION_IMPLS
from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.run import (
    DTYPE_CHOICES,
    bench_columns,
    check_request,
    generate_static,
    load_dtype,
    load_pair,
    pair_dtype,
    request_args,
    resolve_block_size,
)
from ddtree_jax.options import MAX_BUDGET, DecodeOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR_DIR = os.path.join(ROOT, "checkpoints", "embedded")
PROMPTS = os.path.join(ROOT, "benchmarks", "held_out_prompts_16x128.json")
SETTINGS = {"T0": dict(temperature=0.0, top_p=1.0), "T1": dict(temperature=1.0, top_p=0.95)}


def load_prompt_ids(path: str) -> list[list[int]]:
    """Token ids of a prompts JSON: a list of {"ids": [...]} (held_out_prompts --json) or of id lists."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts")
    ids = [p["ids"] if isinstance(p, dict) else p for p in data]
    if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in ids):
        raise ValueError(f"{path}: every prompt must be a non-empty list of token ids (or a dict with 'ids')")
    return ids


def compile_column(pair, prompt_ids, *, method: str, budget: int | None, max_new: int, setting: dict, options) -> dict:
    """One column's program, compiled once for every prompt (padded to one width)."""
    block = resolve_block_size(pair, method, None)
    check_request(pair, prompt_ids, method=method, budget=budget or 1, block_size=None, max_new_tokens=max_new)
    width = max(len(p) for p in prompt_ids)
    common = dict(seed=0, max_new_tokens=max_new, width=width, **setting)
    static = generate_static(
        pair, method=method, budget=budget or 1, block_size=block, max_new_tokens=max_new, options=options
    )
    start = time.perf_counter()
    compiled = generate.lower(*request_args(pair, prompt_ids[:1], request_ids=[0], **common), **static).compile()
    return {
        "method": method,
        "budget": budget,
        "block": block,
        "common": common,
        "compiled": compiled,
        "compile_s": time.perf_counter() - start,
    }


def time_prompt(pair, column: dict, prompt, index: int, repeats: int) -> dict:
    """One prompt through one compiled column: the full generation and the max_new = 1 run, each timed
    `repeats` times (medians)."""
    compiled = column["compiled"]
    args = request_args(pair, [prompt], request_ids=[index], **column["common"])[1:]  # the static config is baked in
    prefill_only = args[:-1] + (jnp.ones((1,), jnp.int32),)
    full = time_calls(compiled, [args], runs=repeats, warmup=1)
    prefill = time_calls(compiled, [prefill_only], runs=repeats, warmup=1)
    result = compiled(*args)
    n = int(np.asarray(result.num_generated)[0])
    return {
        "prompt": index,
        "num_tokens": n,
        "run_s": full.median,
        "prefill_s": prefill.median,
        "decode_s": max(full.median - prefill.median, 1e-9),
        "tau": float(np.asarray(result.tau)[0]),
        "steps": int(np.asarray(result.steps)[0]),
        "tokens": np.asarray(result.tokens)[0, :n].tolist(),
    }


def column_row(column: dict, per_prompt: list[dict]) -> dict:
    decode_s = sum(p["decode_s"] for p in per_prompt)
    decoded = sum(p["num_tokens"] - 1 for p in per_prompt)  # the first token comes from the prefill
    method = column["method"]
    return {
        "method": method,
        "budget": column["budget"],
        "block_size": None if method == "ar" else column["block"],
        "tokens_per_s": decoded / decode_s,
        "mean_tau": statistics.mean(p["tau"] for p in per_prompt),
        "prefill_ms": 1e3 * statistics.median(p["prefill_s"] for p in per_prompt),
        "decode_s": decode_s,
        "num_tokens": decoded,
        "compile_s": column["compile_s"],
        "speedup": None,
        "per_prompt": per_prompt,
    }


def run_setting(
    pair,
    prompt_ids,
    *,
    budgets,
    max_new: int,
    setting: dict,
    repeats: int,
    options: DecodeOptions,
    methods=("ar", "chain", "ddtree"),
) -> list[dict]:
    """Every column compiled first, then timed interleaved: prompt by prompt, each prompt through every
    column (the column order rotated by one per prompt), so a drift of the machine over the run (clocks,
    other work) lands on all columns alike instead of on whichever ran last."""
    columns = []
    for method, budget in bench_columns(budgets, methods):
        columns.append(
            compile_column(
                pair, prompt_ids, method=method, budget=budget, max_new=max_new, setting=setting, options=options
            )
        )
        print(f"  compiled {method} {budget or ''} ({columns[-1]['compile_s']:.0f} s)", flush=True)
    per_prompt = [[] for _ in columns]
    for i, prompt in enumerate(prompt_ids):
        for j in range(len(columns)):
            c = (i + j) % len(columns)
            per_prompt[c].append(time_prompt(pair, columns[c], prompt, i, repeats))
    rows = [column_row(column, timed) for column, timed in zip(columns, per_prompt)]
    for row in rows:
        print(
            f"  {row['method']:<7}{'' if row['budget'] is None else row['budget']:>5}  {row['tokens_per_s']:9.1f} tok/s  "
            f"tau {row['mean_tau']:5.2f}  prefill {row['prefill_ms']:7.2f} ms  (compile {row['compile_s']:.0f} s)",
            flush=True,
        )
    ar = next((r for r in rows if r["method"] == "ar"), None)
    chain = next((r for r in rows if r["method"] == "chain"), None)
    for row in rows:
        if ar is not None:
            row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"]
        if chain is not None:
            row["over_chain"] = row["tokens_per_s"] / chain["tokens_per_s"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown", help="the commit measured (recorded in the JSON)")
    parser.add_argument("--pair", default=PAIR_DIR, help="directory holding target/ and drafter/ (default: embedded)")
    parser.add_argument("--prompts", default=PROMPTS, help="prompts JSON (default: the 16 held-out prompts)")
    parser.add_argument("--budgets", default=None, help="DDTree budgets (default 16,32,64,128,256; --quick: 16,64)")
    parser.add_argument("--methods", default="ar,chain,ddtree", help="columns (default ar,chain,ddtree)")
    parser.add_argument(
        "--steps-per-iteration", type=int, default=1, help="DecodeOptions.steps_per_iteration (default 1)"
    )
    parser.add_argument("--max-new", type=int, default=None, help="new tokens per prompt (default 256; --quick: 64)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per prompt (default 3; --quick: 1; medians)"
    )
    parser.add_argument("--settings", default="T0,T1", help="T0 (greedy) and / or T1 (T = 1, top-p 0.95)")
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="weights and KV caches (default auto: on GPU the checkpoints' bf16)",
    )
    parser.add_argument(
        "--attn-impl",
        choices=ATTENTION_IMPLS,
        default="auto",
        help="DecodeOptions.attn_impl (default auto: the dispatch rule); not auto: the JSON name says it",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 prompts; budgets 16 and 64, 64 new tokens, 1 repeat unless --budgets / --max-new / --repeats say otherwise",
    )
    parser.add_argument("--out", default=None, help="directory for the JSON (default $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if args.max_new is None:  # --quick's defaults only where the option is not given
        args.max_new = 64 if args.quick else 256
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    try:
        budgets = [int(b) for b in (args.budgets or ("16,64" if args.quick else "16,32,64,128,256")).split(",")]
    except ValueError:
        raise SystemExit(f"error: --budgets {args.budgets!r}: expected comma-separated integers") from None
    methods = tuple(args.methods.split(","))
    names = args.settings.split(",")
    bad = [n for n in names if n not in SETTINGS]
    bad_methods = [m for m in methods if m not in ("ar", "chain", "ddtree")]
    if bad or bad_methods or any(not 1 <= b <= MAX_BUDGET for b in budgets) or args.max_new < 2 or args.repeats < 1:
        raise SystemExit(
            f"error: --settings from {sorted(SETTINGS)}, --methods from ar,chain,ddtree, budgets in 1 .. {MAX_BUDGET}, "
            f"--max-new >= 2, --repeats >= 1 (got {args.settings}, {args.methods}, {budgets}, {args.max_new}, "
            f"{args.repeats})"
        )
    problem = out_dir_problem(args.out)
    if problem:
        raise SystemExit(f"error: --out {problem}")
    prompt_ids = load_prompt_ids(args.prompts)
    if args.quick:
        prompt_ids = prompt_ids[:4]
    pair = load_pair(os.path.join(args.pair, "target"), os.path.join(args.pair, "drafter"), load_dtype(args.dtype))
    print(
        f"device: {device_description()}; commit {args.commit}; {len(prompt_ids)} prompts of "
        f"{len(prompt_ids[0])} tokens, {args.max_new} new; weights {jnp.dtype(pair_dtype(pair)).name}",
        flush=True,
    )
    options = DecodeOptions(steps_per_iteration=args.steps_per_iteration, attn_impl=args.attn_impl)
    suffix = "" if args.attn_impl == "auto" else f"_attn-{args.attn_impl}"
    written = []
    for name in names:
        setting = SETTINGS[name]
        print(f"{name}: temperature {setting['temperature']}, top-p {setting['top_p']}", flush=True)
        rows = run_setting(
            pair,
            prompt_ids,
            budgets=budgets,
            max_new=args.max_new,
            setting=setting,
            repeats=args.repeats,
            options=options,
            methods=methods,
        )
        payload = {
            "device": {
                "platform": jax.devices()[0].platform,
                "kind": jax.devices()[0].device_kind,
                "count": jax.device_count(),
                "description": device_description(),
            },
            "settings": {
                "budgets": budgets,
                "max_new_tokens": args.max_new,
                "repeats": args.repeats,
                "prompts": os.path.relpath(args.prompts, ROOT) if args.prompts.startswith(ROOT) else args.prompts,
                "num_prompts": len(prompt_ids),
                "prefill": "excluded, reported apart",
                "steps_per_iteration": args.steps_per_iteration,
                "dtype": jnp.dtype(pair_dtype(pair)).name,  # as loaded (--dtype auto resolved)
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "attn_impl": args.attn_impl,
                **setting,
            },
            "results": rows,
        }
        written.append(write_result(f"e2e_embedded_{name}_{args.commit}{suffix}", payload, args.commit, args.out))
        print(
            markdown_table(
                ["method", "budget", "tokens/s", "x AR", "x chain", "mean tau", "prefill ms"],
                [
                    [
                        r["method"],
                        r["budget"] or "",
                        r["tokens_per_s"],
                        "" if r["speedup"] is None else f"{r['speedup']:.2f}",
                        "" if "over_chain" not in r else f"{r['over_chain']:.2f}",
                        f"{r['mean_tau']:.2f}",
                        r["prefill_ms"],
                    ]
                    for r in rows
                ],
            ),
            flush=True,
        )
    print("written: " + ", ".join(written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
