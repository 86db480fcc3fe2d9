"""The generation loop: on-device `lax.while_loop` (`engine.generate`) vs host-driven async dispatch
(`engine.host_loop.generate_host_loop`, sync every k steps), end to end, on the same requests.

For each method it compiles both loops, checks that they emit the same tokens, and times whole
generations. Each timing is the median of --runs, with `block_until_ready`, compilation excluded.
Reported: ms per decode step and tokens/s. With random weights the steps accept what they accept; both
loops run the same steps.

Usage: python -m benchmarks.bench_loop --commit $(git rev-parse --short HEAD) [--shape tiny|qwen3-8b]
       [--methods ar,ddtree --budget 64 --sync-every none]   # the on-device loop only
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_engine import SHAPES, random_pair
from benchmarks.common import device_description, markdown_table, median_seconds, write_result
from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.host_loop import generate_host_loop
from ddtree_jax.engine.run import request_args
from ddtree_jax.options import DecodeOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--methods", default="ar,ddtree")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument(
        "--sync-every", default="1,8", help='host loops to time, syncing every k steps ("" or "none": while_loop only)'
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--matmul-impl", default="auto", help="DecodeOptions.matmul_impl (e.g. xla, mosaic)")
    parser.add_argument("--attn-impl", default="auto", help="DecodeOptions.attn_impl")
    args = parser.parse_args()
    dtype = jnp.bfloat16 if args.shape != "tiny" else jnp.float32
    pair = random_pair(args.shape, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, pair.target_config.vocab_size - 1, args.prompt_len).tolist() for _ in range(args.batch)]
    request = request_args(pair, prompts, temperature=1.0, seed=0, max_new_tokens=args.max_new)
    block = pair.drafter.config.block_size
    print(f"device: {device_description()}; commit {args.commit}; shape {args.shape}; B={args.batch}", flush=True)
    rows = []
    for method in args.methods.split(","):
        static = dict(
            max_new_tokens=args.max_new,
            method=method,
            budget=args.budget,
            block_size=block,
            cache_dtype=dtype,
            options=DecodeOptions(matmul_impl=args.matmul_impl, attn_impl=args.attn_impl),
        )
        loops = {"while_loop": lambda: generate(*request, **static)}
        for k in (int(v) for v in args.sync_every.split(",") if v not in ("", "none")):
            loops[f"host, sync every {k}"] = lambda k=k: generate_host_loop(*request, **static, sync_every=k)
        reference = None
        for name, run in loops.items():
            start = time.perf_counter()
            result = jax.block_until_ready(run())  # compiles (first call)
            first_s = time.perf_counter() - start
            tokens = np.asarray(result.tokens)
            if reference is None:
                reference = tokens
            same = bool(np.array_equal(tokens, reference))
            seconds = median_seconds(run, runs=args.runs)
            steps = int(np.asarray(result.steps).max())
            generated = int(np.asarray(result.num_generated).sum())
            row = {
                "method": method,
                "loop": name,
                "matmul_impl": args.matmul_impl,
                "attn_impl": args.attn_impl,
                "steps": steps,
                "tokens": generated,
                "ms_per_step": seconds * 1e3 / max(steps, 1),
                "tokens_per_s": generated / seconds,
                "first_call_s": first_s,
                "same_tokens": same,
            }
            rows.append(row)
            print(
                f"{method:6s} {name:20s}: {row['ms_per_step']:8.3f} ms/step  {row['tokens_per_s']:9.1f} tok/s  "
                f"(steps {steps}, first call {first_s:.1f} s, same tokens: {same})",
                flush=True,
            )
            write_result(
                f"loop_{args.shape}_matmul-{args.matmul_impl}",
                {"rows": rows, "batch": args.batch, "max_new": args.max_new},
                args.commit,
            )
    print(
        "\n"
        + markdown_table(
            ["method", "loop", "steps", "ms / step", "tokens/s", "same tokens"],
            [[r["method"], r["loop"], r["steps"], r["ms_per_step"], r["tokens_per_s"], r["same_tokens"]] for r in rows],
        )
    )


if __name__ == "__main__":
    main()
