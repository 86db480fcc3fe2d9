"""Whole-forward benchmark: the Qwen3-8B-shaped target's AR-step and tree-verify forwards with
the weight-streaming matmul kernel against plain XLA, the layer loop against `lax.scan`, and the
weight-read roofline.

For each batch B, slot count T (T = 1: the AR step's forward; T = 9, 17, 65: the verify forwards of
budgets 8, 16, 64, here a causal chain of T slots), matmul impl and layer loop, it compiles
`qwen3.verify` (lowering + compilation timed apart) on a bf16 cache holding --context committed tokens
and times it (median, `block_until_ready`; the cache donated and fed back, as in the engine's loop). Roofline per forward:

  weight bytes   every layer weight + the final norm + the LM head (the embedding is a T-row gather)
  KV bytes       B * context * layers * 2 (K, V) * kv_heads * head_dim * 2 bytes read by attention
  roofline ms    (weight + KV bytes) / the copy bandwidth measured in the same run (1 GiB read + write)

Targets: the AR step (T = 1) at B = 1 within 1.5x of the weight-read roofline; the T = 65
verify forward within 1.3x of the AR step. Rows are printed as they finish and the JSON is rewritten
after each, so a time-out keeps them.

Usage: python -m benchmarks.bench_forward --commit $(git rev-parse --short HEAD) [--shape tiny]
       [--batches 1,8] [--slots 1,9,17,65] [--matmul-impls xla,auto,pallas] [--loops scan,unrolled]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_engine import SHAPES
from benchmarks.common import copy_bandwidth, device_description, markdown_table, median_seconds, write_result
from ddtree_jax.models import qwen3, target_module
from ddtree_jax.models.cache import KVCache


def weight_bytes(params: dict) -> int:
    """Bytes a forward reads from the weights: everything but the embedding table (a T-row gather)."""
    leaves = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if jax.tree_util.keystr(path) != "['embed']"
    ]
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    if "lm_head" not in params:  # tied: the head is the embedding, read whole
        total += params["embed"].size * params["embed"].dtype.itemsize
    return total


def kv_bytes(config, batch: int, context: int, dtype=jnp.bfloat16) -> int:
    return batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def filled_cache(config, batch: int, context: int, slots: int, key) -> KVCache:
    """A bf16 cache in the target's own layout (K / V for Qwen3, latent / rope key for MLA) of capacity
    context + slots, with `context` committed rows of random values."""
    empty = target_module(config).create_cache(config, batch, context + slots, jnp.bfloat16)
    k_key, v_key = jax.random.split(key)
    return KVCache(
        jax.random.normal(k_key, empty.k.shape, jnp.bfloat16),
        jax.random.normal(v_key, empty.v.shape, jnp.bfloat16),
        jnp.full((batch,), context, jnp.int32),
    )


def bench_forward(
    config, params, batch: int, slots: int, *, context: int, matmul_impl: str, layer_loop: str, runs: int, seed: int = 0
) -> dict:
    """One row: compile and time `qwen3.verify` over a chain of `slots` tokens."""
    key = jax.random.key(seed)
    cache = filled_cache(config, batch, context, slots, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (batch, slots), 0, config.vocab_size, jnp.int32)
    depths = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((slots, slots), bool)), (batch, slots, slots))

    def forward(params, cache, tokens, depths, mask):
        logits, _, cache = qwen3.tree_forward(
            config, params, cache, tokens, depths, mask, matmul_impl=matmul_impl, layer_loop=layer_loop
        )
        return logits, cache

    start = time.perf_counter()
    # the cache is donated and fed back, as in the engine's decode loop: its rows are written in place
    lowered = jax.jit(forward, donate_argnums=1).trace(params, cache, tokens, depths, mask).lower()
    lower_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lower_s
    fed_back = {"cache": cache}

    def call():  # the donated cache of each call is the next call's input
        logits, fed_back["cache"] = compiled(params, fed_back["cache"], tokens, depths, mask)
        return logits, fed_back["cache"]

    forward_ms = median_seconds(call, runs=runs, warmup=2) * 1e3
    return {
        "B": batch,
        "T": slots,
        "context": context,
        "matmul_impl": matmul_impl,
        "layer_loop": layer_loop,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "forward_ms": forward_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--slots", default="1,9,17,65")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--matmul-impls", default="xla,auto,pallas")
    parser.add_argument("--loops", default="scan,unrolled", help="cases run loop by loop, in this order")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    config = SHAPES[args.shape][0]
    dtype = jnp.bfloat16 if args.shape != "tiny" else jnp.float32
    params = qwen3.init_params(config, jax.random.key(0), dtype)
    copy_bw = copy_bandwidth() if jax.default_backend() == "gpu" else float("nan")
    weights = weight_bytes(params)
    print(
        f"device: {device_description()}; commit {args.commit}; shape {args.shape}; weights {weights / 1e9:.2f} GB; "
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s",
        flush=True,
    )
    rows = []
    for loop in args.loops.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for slots in (int(t) for t in args.slots.split(",")):
                for impl in args.matmul_impls.split(","):
                    row = bench_forward(
                        config,
                        params,
                        batch,
                        slots,
                        context=args.context,
                        matmul_impl=impl,
                        layer_loop=loop,
                        runs=args.runs,
                    )
                    row["weight_GB"] = weights / 1e9
                    row["kv_GB"] = kv_bytes(config, batch, args.context) / 1e9
                    row["roofline_ms"] = (weights + kv_bytes(config, batch, args.context)) / copy_bw * 1e3
                    row["over_roofline"] = row["forward_ms"] / row["roofline_ms"]
                    rows.append(row)
                    print(
                        f"{loop:8s} B={batch} T={slots:3d} matmul={impl:6s}: {row['forward_ms']:8.2f} ms "
                        f"({row['over_roofline']:.2f}x roofline {row['roofline_ms']:.2f} ms)  lower {row['lower_s']:5.1f} s "
                        f"compile {row['compile_s']:5.1f} s",
                        flush=True,
                    )
                    write_result(f"forward_{args.shape}", {"rows": rows, "copy_bandwidth_Bps": copy_bw}, args.commit)
    ar = {(r["B"], r["matmul_impl"], r["layer_loop"]): r["forward_ms"] for r in rows if r["T"] == 1}
    header = [
        "loop",
        "B",
        "T",
        "matmul",
        "forward ms",
        "roofline ms",
        "x roofline",
        "x AR step",
        "lower s",
        "compile s",
    ]
    table = [
        [
            r["layer_loop"],
            r["B"],
            r["T"],
            r["matmul_impl"],
            r["forward_ms"],
            r["roofline_ms"],
            f"{r['over_roofline']:.2f}",
            f"{r['forward_ms'] / ar[(r['B'], r['matmul_impl'], r['layer_loop'])]:.2f}"
            if (r["B"], r["matmul_impl"], r["layer_loop"]) in ar
            else "",
            f"{r['lower_s']:.1f}",
            f"{r['compile_s']:.1f}",
        ]
        for r in rows
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
