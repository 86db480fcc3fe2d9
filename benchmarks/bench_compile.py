"""Compile time of the full 61-layer Kimi K2.6 tree-verify forward: `lax.scan` over the stacked layers vs a
Python loop (one copy per layer), from abstract shapes (no weights allocated: jax.eval_shape).

B = 1, N = 17 tree slots, a 4096-token latent cache, bf16 parameters (routed experts as bf16 arrays:
the program's size, not its memory, is what is timed), MoE dispatch "gather". Prints lowering and
compilation seconds per loop form and writes them under $OUT.

Usage: python -m benchmarks.bench_compile --commit $(git rev-parse --short HEAD) [--loops scan,unrolled]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import device_description, write_result
from ddtree_jax.models import deepseek_v3
from ddtree_jax.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--loops", default="scan,unrolled")
    parser.add_argument("--slots", type=int, default=17)
    parser.add_argument("--cache", type=int, default=4096)
    args = parser.parse_args()
    config = preset("kimi-k2.6")
    params = jax.eval_shape(lambda: deepseek_v3.init_params(config, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: deepseek_v3.create_cache(config, 1, args.cache, jnp.bfloat16))
    spec = jax.ShapeDtypeStruct
    inputs = (
        spec((1, args.slots), jnp.int32),
        spec((1, args.slots), jnp.int32),
        spec((1, args.slots, args.slots), bool),
    )
    print(f"device: {device_description()}; commit {args.commit}; K2.6 verify, {config.num_layers} layers", flush=True)
    rows = []
    for loop in args.loops.split(","):
        fn = jax.jit(
            lambda p, c, t, d, m, loop=loop: deepseek_v3.tree_forward(
                config, p, c, t, d, m, layer_loop=loop, moe_impl="gather"
            )
        )
        start = time.perf_counter()
        lowered = fn.trace(params, cache, *inputs).lower()
        lowered_s = time.perf_counter() - start
        lowered.compile()
        compile_s = time.perf_counter() - start - lowered_s
        rows.append({"layer_loop": loop, "lower_s": lowered_s, "compile_s": compile_s})
        print(f"{loop:9s} lower {lowered_s:6.1f} s  compile {compile_s:6.1f} s", flush=True)
    write_result("compile_k2_6_verify", {"rows": rows, "slots": args.slots, "cache": args.cache}, args.commit)


if __name__ == "__main__":
    main()
