"""Causal prefill attention of one chunk (issue #24): the Mosaic GPU kernel
(kernels/ddtree_kernels/prefill_attention_mgpu.py) vs the models' XLA blockwise path vs jax's FA3 kernel.

Shape: Qwen3-8B attention (Hq 32, Hkv 8, D 128, bf16), B = 1. Cases (T chunk, S cache capacity, start):
the last 2048-token chunk of an 8k and a 32k prompt (start 6144, S 8192; start 30720, S 32768), the first
chunk (start 0, S 8192), and a whole 8k prompt (T = S = 8192, start 0).

Counted first, per call: FLOPs = 4 * B * Hq * D * sum over queries t of the keys it sees (start + t + 1):
scores and values, causal (the useful work; the XLA path computes every key of the cache and masks).
Variants (each in its own try: a variant that fails to compile or run records its error and the rest go on):
  mgpu        causal_prefill_attention, block_kv 128 (2 K/V stages); mgpu_kv64: block_kv 64 (4 stages);
  xla         ddtree_jax.models.attention.blockwise_attention with the equivalent bool mask (the current
              path: an online softmax over every 1024-key block of the cache);
  jax_fa3     jax.experimental.pallas.ops.gpu.attention_mgpu.attention (block_q 64, block_kv 128, 2
              stages, causal), only where start = 0 and T = S (its causal mask has no offset); it has no
              scale argument, so it gets q * D ** -0.5.
Timing: `common.time_calls` rotating >= 3 fresh input sets (q, k, v; 3 sets of the 32k case hold 430 MB,
over 8x the 50 MB L2), pipeline = 2 x the sets (calls queued on the device, no host gap), median of 7.
Reported: us, TFLOP/s, the share of the 790 TFLOP/s bf16 peak (target >= 0.35), and ||out - ref|| / ||ref||
against `causal_prefill_attention_reference` on set 0 (bf16: expect ~3e-3). The CUDA runtime version is
recorded: jax refuses its own causal kernel on 12.8.0 - 12.9.0 (a ptxas miscompilation), check the mgpu
error there first.

Usage: PYTHONPATH=.:kernels python -m benchmarks.bench_prefill_attention --commit $(git rev-parse --short HEAD)
       [--quick] [--variants mgpu,mgpu_kv64,xla,jax_fa3] [--out DIR]
Writes prefill_attention_<commit>.json to --out (default $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_description, markdown_table, time_calls, write_result
from ddtree_jax.models.attention import blockwise_attention
from ddtree_kernels.prefill_attention_mgpu import (
    BLOCK_Q,
    causal_prefill_attention,
    causal_prefill_attention_reference,
    smem_plan,
)

PEAK_FLOPS = 790e12  # bf16 matmul rate measured on this H200
TARGET_SHARE = 0.35
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
SETS = 3
CASES = [(2048, 8192, 0), (2048, 8192, 6144), (2048, 32768, 30720), (8192, 8192, 0)]  # (T, S, start)
QUICK_CASES = [(2048, 8192, 6144)]
VARIANTS = ("mgpu", "mgpu_kv64", "xla", "jax_fa3")


def causal_mask(start: jax.Array, steps: int, capacity: int) -> jax.Array:
    """bool [B, T, S]: key s visible to query t iff s <= start[b] + t."""
    positions = start[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    return jnp.arange(capacity, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]


def jax_fa3(q, k, v, start):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    del start  # 0: asserted by `applies`
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return attention_mgpu.attention((q * HEAD_DIM**-0.5).astype(q.dtype), k, v, config)


ATTEND = {
    "mgpu": jax.jit(lambda q, k, v, start: causal_prefill_attention(q, k, v, start, block_kv=128)),
    "mgpu_kv64": jax.jit(lambda q, k, v, start: causal_prefill_attention(q, k, v, start, block_kv=64)),
    "xla": jax.jit(lambda q, k, v, start: blockwise_attention(q, k, v, causal_mask(start, q.shape[1], k.shape[1]))),
    "jax_fa3": jax.jit(jax_fa3),
}


def applies(variant: str, steps: int, capacity: int, start: int) -> bool:
    return variant != "jax_fa3" or (start == 0 and steps == capacity)


def flop_count(batch: int, steps: int, capacity: int, start: int) -> float:
    """4 * B * Hq * D * (keys seen, summed over the queries)."""
    seen = np.minimum(start + np.arange(steps, dtype=np.int64) + 1, capacity).sum()
    return float(4 * batch * Q_HEADS * HEAD_DIM * seen)


def input_sets(steps: int, capacity: int, start: int, key) -> list[tuple]:
    out = []
    for i in range(SETS):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
        out.append(
            (
                jax.random.normal(kq, (1, steps, Q_HEADS, HEAD_DIM), jnp.bfloat16),
                jax.random.normal(kk, (1, capacity, KV_HEADS, HEAD_DIM), jnp.bfloat16),
                jax.random.normal(kv, (1, capacity, KV_HEADS, HEAD_DIM), jnp.bfloat16),
                jnp.full((1,), start, jnp.int32),
            )
        )
    return out


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def cuda_runtime() -> str:
    try:
        from jax._src.lib import cuda_versions

        return str(cuda_versions.cuda_runtime_get_version())
    except Exception as err:  # noqa: BLE001 - recorded, not needed to run
        return f"unknown ({type(err).__name__})"


def run_case(steps: int, capacity: int, start: int, variants: list[str], key) -> dict:
    flops = flop_count(1, steps, capacity, start)
    tiles = -(-steps // (2 * BLOCK_Q))
    row = {
        "T": steps,
        "S": capacity,
        "start": start,
        "GFLOP": flops / 1e9,
        "mgpu_grid": [Q_HEADS, tiles, 1],
        "mgpu_stages_smem": {str(bkv): smem_plan(HEAD_DIM, HEAD_DIM, bkv, False) for bkv in (64, 128)},
    }
    sets = input_sets(steps, capacity, start, key)
    ref = None
    try:
        ref = causal_prefill_attention_reference(*sets[0])
    except Exception as err:  # noqa: BLE001 - recorded, the variants still run
        row["ref_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    q_scaled_ref = None
    for name in variants:
        if not applies(name, steps, capacity, start):
            continue
        try:
            out = ATTEND[name](*sets[0])
            if name == "jax_fa3":  # its own reference: the same scaled queries at scale 1
                q_scaled = (sets[0][0] * HEAD_DIM**-0.5).astype(jnp.bfloat16)
                q_scaled_ref = causal_prefill_attention_reference(q_scaled, *sets[0][1:], scale=1.0)
                row[f"{name}_rel_err"] = relative_error(out, q_scaled_ref)
            elif ref is not None:
                row[f"{name}_rel_err"] = relative_error(out, ref)
            del out
            timing = time_calls(ATTEND[name], sets, runs=7, warmup=len(sets), pipeline=2 * len(sets))
            seconds = timing.median
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_TFLOPs"] = flops / seconds / 1e12
            row[f"{name}_of_peak"] = flops / seconds / PEAK_FLOPS
        except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    del sets, ref, q_scaled_ref
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help=f"only (T, S, start) = {QUICK_CASES[0]}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    parser.add_argument("--out", help="directory for the JSON (default $OUT, else benchmarks/results)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    cases = QUICK_CASES if args.quick else CASES
    print(
        f"device: {device_description()}; CUDA runtime {cuda_runtime()}; commit {args.commit}; "
        f"peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    results = []
    key = jax.random.key(0)
    for steps, capacity, start in cases:
        row = run_case(steps, capacity, start, variants, jax.random.fold_in(key, steps + capacity + start))
        results.append(row)
        parts = [
            f"{name} {row[f'{name}_us']:9.1f} us {row[f'{name}_TFLOPs']:6.1f} TFLOP/s "
            f"({row[f'{name}_of_peak']:.2f} of peak, rel err {row.get(f'{name}_rel_err', float('nan')):.1e})"
            for name in variants
            if f"{name}_us" in row
        ]
        errors = [f"{k}: {v}" for k, v in row.items() if k.endswith("_error")]
        print(
            f"T={steps} S={capacity} start={start} ({row['GFLOP']:.0f} GFLOP): " + "; ".join(parts + errors), flush=True
        )
        write_result(
            f"prefill_attention_{args.commit}",
            {"rows": results, "peak_flops": PEAK_FLOPS, "cuda_runtime": cuda_runtime()},
            args.commit,
            args.out,
        )
    header = ["T", "S", "start", "GFLOP"] + [f"{name} TFLOP/s" for name in variants] + ["mgpu of peak", "mgpu rel err"]
    table = [
        [r["T"], r["S"], r["start"], r["GFLOP"]]
        + [r.get(f"{name}_TFLOPs", "-") for name in variants]
        + [f"{r.get('mgpu_of_peak', float('nan')):.2f}", f"{r.get('mgpu_rel_err', float('nan')):.1e}"]
        for r in results
    ]
    print("\n" + markdown_table(header, table))
    print(f"target: mgpu >= {TARGET_SHARE:.2f} of peak")


if __name__ == "__main__":
    main()
