"""Where a DeepSeek-V3 / K2.6-width forward's time goes: each part of the model timed alone at T rows.

The K2.6-width target of `benchmarks.k26_model` (hidden 7168, MLA with 64 heads, 384 INT4 routed
experts; random weights) with `--layers` decoder layers (the first dense, the rest MoE), on one device.
For each slot count T (T = 1: the AR step; T = 9: a budget-8 tree), B = 1, a bf16 latent cache holding
--context tokens, it times (median of --runs calls, each part its own jit, inputs fixed):

  embed        the T-row embedding gather
  mla          one layer's absorbed MLA: q/kv LoRA projections, the latent-cache attention, o_proj
  dense_mlp    the dense layer's SwiGLU (18432 wide)
  moe:<impl>   one MoE layer's routed + shared experts for each --moe-impls entry (the engine's "auto"
               picks the decode kernels (INT4) at <= 16 assignments on GPU, `dispatch.GPU_GATHER_MAX_ASSIGNMENTS`)
  head         final RMSNorm + the LM head (163,840 x 7168) to float32 logits
  forward      the whole `deepseek_v3.prefill` over all layers for each --loops entry

and prints `sum of parts` = embed + layers * mla + dense_mlp + (layers - 1) * moe:auto + head beside the
measured forward: a forward much slower than its parts has a cost outside them (layer-loop copies,
cache writes), a part much slower at T = 1 than at T = 9 is the part to fix.

`--profile moe:gather,forward:scan` adds, for those parts, the device time of each XLA op (from a
`jax.profiler` trace, `benchmarks/op_profile.py`).

Usage: python -m benchmarks.bench_model_parts --commit $(git rev-parse --short HEAD) [--layers 2]
       [--slots 1,9] [--profile moe:gather] [--tiny]   (--tiny: the tiny K2-shaped model, a CPU check of the script)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_forward import filled_cache
from benchmarks.common import device_description, markdown_table, median_seconds, write_result
from benchmarks.k26_model import k26_config, random_int4_target
from benchmarks.op_profile import format_op_table, op_times
from ddtree_jax.models import deepseek_v3
from ddtree_jax.models.layers import linear, rms_norm, swiglu
from ddtree_jax.models.moe import moe


def layer_slice(stack: dict, index: int) -> dict:
    return jax.tree.map(lambda a: a[index], stack)


def time_parts(
    config, params, slots: int, *, context: int, runs: int, moe_impls, loops, profile: tuple[str, ...] = ()
) -> tuple[dict, dict]:
    """({part: ms}, {part: per-op rows}) at B = 1, T = slots (module docstring); the parts named in
    `profile` are also profiled op by op (`benchmarks.op_profile.op_times`)."""
    key = jax.random.key(slots)
    c = config
    tokens = jax.random.randint(key, (1, slots), 0, c.vocab_size - 1)
    x = (jax.random.normal(key, (1, slots, c.hidden_size), jnp.float32) * 0.5).astype(jnp.bfloat16)
    cache = filled_cache(c, 1, context, slots, key)
    positions = context + jnp.arange(slots, dtype=jnp.int32)[None, :]
    mask = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    dense0 = layer_slice(params["dense_layers"], 0)
    moe0 = layer_slice(params["moe_layers"], 0) if c.num_moe_layers else None
    ms, ops = {}, {}

    def timed(name, fn, *args, jitted=False):
        fn = fn if jitted else jax.jit(fn)
        ms[name] = median_seconds(fn, *args, runs=runs) * 1e3
        if name in profile:
            ops[name] = op_times(fn, *args, runs=runs)

    timed("embed", lambda e, t: e[t], params["embed"], tokens)

    def mla(p, x, latent, rope, positions, mask):
        cos, sin = deepseek_v3.rope_tables_half(c, positions)
        out, _, _ = deepseek_v3.mla_absorbed(
            c,
            p,
            rms_norm(x, p["input_norm"], c.rms_norm_eps),
            cos,
            sin,
            latent[0],
            rope[0],
            jnp.full((1,), context, jnp.int32),
            mask,
        )
        return out

    timed("mla", mla, dense0, x, cache.k, cache.v, positions, mask)
    timed("dense_mlp", lambda p, x: swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"]), dense0, x)
    if moe0 is not None:
        for impl in moe_impls:
            timed(f"moe:{impl}", lambda p, x, impl=impl: moe(c, p, x, impl=impl), moe0, x)
    timed(
        "head",
        lambda n, w, x: linear(rms_norm(x, n, c.rms_norm_eps), w).astype(jnp.float32),
        params["final_norm"],
        deepseek_v3.head(c, params),
        x,
    )
    for loop in loops:
        timed(
            f"forward:{loop}",
            lambda p, cache, t, loop=loop: deepseek_v3.prefill(
                c, p, cache, t, jnp.full((1,), slots, jnp.int32), layer_loop=loop
            )[0],
            params,
            cache,
            tokens,
        )
    moe_ms = ms.get("moe:auto", next((v for k, v in ms.items() if k.startswith("moe:")), 0.0))
    ms["sum_of_parts"] = (
        ms["embed"]
        + c.num_layers * ms["mla"]
        + c.first_k_dense_replace * ms["dense_mlp"]
        + c.num_moe_layers * moe_ms
        + ms["head"]
    )
    return ms, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--slots", default="1,9")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--moe-impls", default="auto,gather,pallas")
    parser.add_argument("--loops", default="scan,unrolled")
    parser.add_argument("--profile", default="", help="parts to profile op by op (e.g. moe:gather,forward:scan)")
    args = parser.parse_args()
    if args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    config = k26_config(args.layers, args.tiny)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    params = jax.jit(lambda k: random_int4_target(config, k, dtype))(jax.random.key(0))
    moe_impls = [m for m in args.moe_impls.split(",") if m]
    if args.tiny:  # the grouped kernel runs in interpret mode off GPU: slow, and not what is measured here
        moe_impls = [m for m in moe_impls if m != "pallas"]
    print(
        f"device: {device_description()}; layers {args.layers}; context {args.context}; commit {args.commit}",
        flush=True,
    )
    profile = tuple(p for p in args.profile.split(",") if p)
    results, op_rows = {}, {}
    for slots in (int(s) for s in args.slots.split(",")):
        results[slots], ops = time_parts(
            config,
            params,
            slots,
            context=args.context,
            runs=args.runs,
            moe_impls=moe_impls,
            loops=[lp for lp in args.loops.split(",") if lp],
            profile=profile,
        )
        print(f"T={slots}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[slots].items()), flush=True)
        for name, rows in ops.items():
            print(f"T={slots} {name}, per op:\n{format_op_table(rows)}", flush=True)
            op_rows[f"{slots}:{name}"] = rows[:40]
        write_result(
            "model_parts" + ("_tiny" if args.tiny else ""),
            {
                "layers": args.layers,
                "context": args.context,
                "ms": {str(k): v for k, v in results.items()},
                "ops": op_rows,
            },
            args.commit,
        )
    names = list(next(iter(results.values())))
    print(
        markdown_table(
            ["part (ms)"] + [f"T = {s}" for s in results],
            [[n] + [f"{results[s].get(n, float('nan')):.3f}" for s in results] for n in names],
        )
    )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
