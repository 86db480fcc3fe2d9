"""Engine benchmark: one DDTree / DFlash-chain / AR decode step of a random-weight Qwen3-8B-shaped target
with a Qwen3-8B-DFlash-b16-shaped drafter (bf16, one GPU), and where its time goes.

For each batch size B and method (AR; the DFlash chain at block 16; DDTree at each budget), after a
prefill of --context random tokens and one warm-up step, it times (medians, `block_until_ready`):

  step            the fused decode step (`engine.step.decode_step`, as `generate` runs it), called from the host
  loop step       the same step inside an on-device `fori_loop` (as `generate`'s while_loop runs it): the
                  marginal cost of a step, no host dispatch (`bench_case`)
  draft           the drafter's forward alone (`draft_stage`)
  tree_forward    the target's forward over the tree alone (`tree_forward_stage`, N = budget + 1 slots)
  plain_forward   a plain causal forward of the same N tokens on the same cache (`target.prefill`)
  walk            the tree rejection walk alone, XLA (`verify_step(impl="xla")`) and Pallas
                  (`impl="pallas"`, ddtree_kernels/tree_sampling.py) on the step's real logits
  non_forward     step - draft - tree_forward: tree building, the walk, commit, bookkeeping

Targets: non_forward <= 10% of the step; tree_forward at budget 64 within 1.3x of plain_forward. The
walk kernel is what `generate` uses on GPU (DecodeOptions.verify_impl "auto").
Rows are printed as they finish and the JSON is rewritten after each row, so a time-out keeps them.

Usage: python -m benchmarks.bench_engine --commit $(git rev-parse --short HEAD) [--shape tiny] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import device_description, markdown_table, median_seconds, write_result
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.engine.generate import prefill
from ddtree_jax.engine.run import Pair, enable_compilation_cache, request_args
from ddtree_jax.engine.step import append_stage, decode_step, draft_stage, tree_forward_stage, tree_stage, walk_stage
from ddtree_jax.models import dflash, qwen3, target_module
from ddtree_jax.options import METHODS, DecodeOptions
from ddtree_jax.presets import preset_pair

# --shape name -> (target config, drafter config), from the preset pairs of ddtree_jax.presets
SHAPES = {"qwen3-8b": preset_pair("qwen3-8b"), "tiny": preset_pair("qwen3-tiny")}


def random_pair(shape: str, dtype, seed: int = 0) -> Pair:
    target_config, drafter_config = SHAPES[shape]
    keys = jax.random.split(jax.random.key(seed))
    target_params = qwen3.init_params(target_config, keys[0], dtype)
    drafter = DFlashDrafter(
        drafter_config,
        dflash.init_params(drafter_config, target_config.hidden_size, keys[1], dtype),
        qwen3.embedding(target_params),
        qwen3.head(target_config, target_params),
    )
    return Pair(target_config, target_params, drafter)


def _compile(fn, args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def bench_case(
    pair: Pair,
    batch: int,
    method: str,
    budget: int,
    *,
    context: int,
    temperature: float,
    top_p: float,
    repeats: int,
    options: DecodeOptions = DecodeOptions(attn_impl="xla", matmul_impl="xla"),
    seed: int = 0,
    step_only: bool = False,
    profile_top: int = 0,
    hlo_path: str | None = None,
    loop_steps: int = 16,
) -> dict:
    """One row (module docstring); options: how the step runs (default XLA attention and matmuls);
    step_only: the fused step alone, without the per-stage breakdown (each stage is one more compilation
    of the model: 30-75 s per case for the Qwen3-8B shape on the H200); profile_top > 0: the step's
    `profile_top` largest ops by device time (`benchmarks.op_profile.op_times`, 3 traced steps) in
    row["op_profile"], with the launches and device time of the whole step, its device time by stage
    (row["stages"]) and the non-forward share of it (`op_profile.stage_shares`); hlo_path: the compiled step's
    HLO text written there (to name the profile's fusions).

    row["step_ms"] is one step called from the host (its dispatch included: for a model of many parameter
    arrays, milliseconds); row["loop_step_ms"] (loop_steps > 0) is a step as the engine's on-device loop runs
    it: one compiled `fori_loop` of decode steps, each fed the last one's state, timed at 1 + loop_steps and
    at 1 step, the difference divided by loop_steps (the program's dispatch and the first step cancel)."""
    config, block = pair.target_config, pair.drafter.config.block_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size - 1, context).tolist() for _ in range(batch)]
    max_new = 64
    _, params, drafter, ids, lengths, sampling, keys, stop, max_new_arr = request_args(
        pair, prompts, temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new
    )
    shape = dict(max_new_tokens=max_new, method=method, budget=budget, block_size=block)
    state = jax.jit(lambda *a: prefill(config, *a, **shape, cache_dtype=jnp.bfloat16, options=options))(
        params, drafter, ids, lengths, sampling, keys
    )
    row = {
        "B": batch,
        "method": method,
        "budget": budget if method == "ddtree" else None,
        "context": context,
        "attn_impl": options.attn_impl,
        "matmul_impl": options.matmul_impl,
        "moe_impl": options.moe_impl,
        "layer_loop": options.layer_loop,
    }

    step_fn = functools.partial(decode_step, config, method=method, budget=budget, block_size=block, options=options)
    step_args = (params, drafter, state, sampling, keys, stop, max_new_arr)
    step, row["step_compile_s"] = _compile(step_fn, step_args)
    state = step(*step_args)  # warm-up step: the drafter now has context features to append
    step_args = (params, drafter, state, sampling, keys, stop, max_new_arr)
    row["step_ms"] = median_seconds(step, *step_args, runs=repeats) * 1e3
    if loop_steps > 0:

        def loop_fn(params, drafter, state, sampling, keys, stop, max_new_arr, count):
            return lax.fori_loop(
                0, count, lambda _, s: step_fn(params, drafter, s, sampling, keys, stop, max_new_arr), state
            )

        loop, _ = _compile(loop_fn, (*step_args, jnp.int32(1)))
        one = median_seconds(loop, *step_args, jnp.int32(1), runs=repeats)
        many = median_seconds(loop, *step_args, jnp.int32(1 + loop_steps), runs=repeats)
        row["loop_step_ms"] = (many - one) / loop_steps * 1e3
        row["loop_steps"] = loop_steps
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(step.as_text())
    if profile_top > 0:
        from benchmarks.op_profile import (
            device_timeline,
            kind_table,
            op_kinds,
            op_sources,
            op_stages,
            op_times,
            stage_shares,
            stage_table,
            timeline_gaps,
        )

        ops = op_times(step, *step_args, runs=3)
        row["device_us"] = sum(r["us_per_run"] for r in ops)
        row["launches"] = sum(r["events_per_run"] for r in ops)
        hlo_text = step.as_text()  # a 61-layer step's text is large: printed once, read twice
        sources = op_sources(hlo_text)  # each op's JAX op path
        stages = op_stages(hlo_text)  # each op's decode-step stage (engine.step's named scopes)
        row["op_profile"] = [
            r | {"source": sources.get(r["op"], ""), "stage": stages.get(r["op"], "other")} for r in ops[:profile_top]
        ]
        row["op_kinds"] = kind_table(ops, op_kinds(hlo_text))  # by kind: GEMMs, each kernel, fusions
        # device time by stage over every op of the step, and its non-forward share (device_*: apart from the
        # host-timed non_forward_* of the stage breakdown below)
        row["stages"] = stage_table(ops, stages)
        row.update(stage_shares(row["stages"]))
        # one step as a timeline: its span on the device and the idle gaps between launches inside it. Traced, the
        # step usually runs without command buffers (XLA turns them off under the profiler, though a traced program
        # may keep some: op_profile.COMMAND_BUFFER): the gaps are those of kernels launched one by one, an upper
        # bound on a CUDA graph's
        gaps = timeline_gaps(device_timeline(step, *step_args))
        row["device_span_us"] = gaps["span_ns"] / 1e3
        row["device_idle_us"] = gaps["idle_ns"] / 1e3
    if step_only:
        row["slots"] = {"ar": 1, "chain": block}.get(method, budget + 1)
        return row

    draft_state = append_stage(drafter, state.draft_state, state.ctx_features, state.ctx_count, method=method)
    if method == "ar":
        draft_logits, row["draft_ms"] = None, 0.0
    else:
        fn, _ = _compile(
            lambda d, s, b: draft_stage(d, s, b, method=method, block_size=block), (drafter, draft_state, state.bonus)
        )
        row["draft_ms"] = median_seconds(fn, *(drafter, draft_state, state.bonus), runs=repeats) * 1e3
        draft_logits = fn(drafter, draft_state, state.bonus)
    tree = jax.jit(
        lambda l, b: tree_stage(
            l, b, method=method, budget=budget, topk_impl=options.topk_impl, tree_impl=options.tree_impl
        )
    )(draft_logits, state.bonus)
    slots = tree.tokens.shape[1]
    row["slots"] = slots

    fn, row["tree_forward_compile_s"] = _compile(
        lambda p, c, t: tree_forward_stage(config, p, c, t, options), (params, state.target_cache, tree)
    )
    row["tree_forward_ms"] = median_seconds(fn, *(params, state.target_cache, tree), runs=repeats) * 1e3
    logits = fn(params, state.target_cache, tree)[0]

    plain_ids = tree.tokens
    target = target_module(config)
    fn, _ = _compile(
        lambda p, c, t: target.prefill(
            config, p, c, t, jnp.full((batch,), slots, jnp.int32), **options.target_impls(config)
        ),
        (params, state.target_cache, plain_ids),
    )
    row["plain_forward_ms"] = median_seconds(fn, *(params, state.target_cache, plain_ids), runs=repeats) * 1e3

    for impl in ("xla", "pallas"):
        walk_options = options.replace(verify_impl=impl)
        fn, _ = _compile(
            lambda t, l, s, k, i: walk_stage(t, l, s, k, i, walk_options), (tree, logits, sampling, keys, state.step)
        )
        row[f"walk_{impl}_ms"] = median_seconds(fn, *(tree, logits, sampling, keys, state.step), runs=repeats) * 1e3
    row["non_forward_ms"] = row["step_ms"] - row["draft_ms"] - row["tree_forward_ms"]
    row["non_forward_share"] = row["non_forward_ms"] / row["step_ms"]
    row["tree_forward_over_plain"] = row["tree_forward_ms"] / row["plain_forward_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default=None, help="batch sizes (default 1,8; --quick: 1)")
    parser.add_argument("--budgets", default=None, help="DDTree budgets (default 16,64,256; --quick: 16,64)")
    parser.add_argument("--methods", default=None, help="methods (default ar,chain,ddtree; --quick: ar,ddtree)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--attn-impls", default="xla", help="comma-separated: xla, pallas, auto (one row set each)")
    parser.add_argument(
        "--matmul-impl",
        default="xla",
        choices=["xla", "pallas", "auto"],
        help="the target's dense matmuls (kernels/decode_matmul.py with pallas)",
    )
    parser.add_argument(
        "--layer-loop",
        default="auto",
        choices=["auto", "scan", "unrolled"],
        help="the target's layer loop (auto: the model's default)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="B = 1, budgets 16 and 64, AR + DDTree (where those options are not given)"
    )
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="time the fused step alone (no per-stage breakdown: about half the compilations)",
    )
    parser.add_argument(
        "--loop-steps",
        type=int,
        default=16,
        help="steps in the on-device loop timing (loop step ms; 0: off)",
    )
    parser.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="also profile each step (3 traced steps): device us, launches and the N largest ops",
    )
    args = parser.parse_args()
    defaults = ("1", "16,64", "ar,ddtree") if args.quick else ("1,8", "16,64,256", "ar,chain,ddtree")
    args.batches, args.budgets, args.methods = (
        given if given is not None else default
        for given, default in zip((args.batches, args.budgets, args.methods), defaults)
    )
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"--methods takes a comma-separated subset of {','.join(METHODS)}, got {args.methods!r}")
    enable_compilation_cache()
    dtype = jnp.bfloat16 if args.shape != "tiny" else jnp.float32
    start = time.perf_counter()
    pair = random_pair(args.shape, dtype)
    jax.block_until_ready(pair.target_params)
    print(
        f"device: {device_description()}; commit {args.commit}; shape {args.shape} ({dtype.__name__}); "
        f"init {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    cases = []
    for batch in (int(b) for b in args.batches.split(",")):
        for method in args.methods.split(","):
            for budget in [int(b) for b in args.budgets.split(",")] if method == "ddtree" else [0]:
                for attn_impl in args.attn_impls.split(","):
                    cases.append((batch, method, budget, attn_impl))
    rows = []
    for batch, method, budget, attn_impl in cases:
        row = bench_case(
            pair,
            batch,
            method,
            budget,
            context=args.context,
            temperature=args.temperature,
            top_p=args.top_p,
            repeats=args.repeats,
            step_only=args.step_only,
            profile_top=args.profile_top,
            loop_steps=args.loop_steps,
            options=DecodeOptions(attn_impl=attn_impl, matmul_impl=args.matmul_impl, layer_loop=args.layer_loop),
        )
        rows.append(row)
        head = (
            f"B={batch} {method:6s} budget={budget:4d} N={row['slots']:3d} attn={attn_impl}: step {row['step_ms']:8.2f}"
            f" ms, in the loop {row.get('loop_step_ms', float('nan')):8.2f} ms"
        )
        if "op_profile" in row:
            from benchmarks.op_profile import format_op_table

            head += (
                f"  [device {row['device_us'] / 1e3:.2f} ms in {row['launches']:.0f} launches; span "
                f"{row['device_span_us'] / 1e3:.2f} ms, idle {row['device_idle_us'] / 1e3:.2f} ms]"
            )
            print(format_op_table(row["op_profile"], args.profile_top), flush=True)
        if args.step_only:
            print(f"{head}  (compile step {row['step_compile_s']:.0f} s)", flush=True)
        else:
            print(
                f"{head}  draft {row['draft_ms']:7.2f}  tree fwd {row['tree_forward_ms']:8.2f}  plain fwd "
                f"{row['plain_forward_ms']:8.2f}  walk xla {row['walk_xla_ms']:7.3f} pallas "
                f"{row['walk_pallas_ms']:7.3f}  non-fwd {100 * row['non_forward_share']:5.1f}%  "
                f"(compile step {row['step_compile_s']:.0f} s)",
                flush=True,
            )
        write_result(
            f"engine_{args.shape}_matmul-{args.matmul_impl}_loop-{args.layer_loop}",
            {"rows": rows, "temperature": args.temperature, "top_p": args.top_p},
            args.commit,
        )
    if args.step_only:
        print(
            "\n"
            + markdown_table(
                ["B", "method", "budget", "N", "attention", "step ms", "loop step ms", "step compile s"],
                [
                    [
                        r["B"],
                        r["method"],
                        r["budget"] or "",
                        r["slots"],
                        r["attn_impl"],
                        r["step_ms"],
                        r.get("loop_step_ms", ""),
                        r["step_compile_s"],
                    ]
                    for r in rows
                ],
            )
        )
        return
    header = [
        "B",
        "method",
        "budget",
        "N",
        "attention",
        "step ms",
        "draft ms",
        "tree fwd ms",
        "plain fwd ms",
        "tree/plain",
        "walk xla ms",
        "walk pallas ms",
        "non-forward %",
    ]
    table = [
        [
            r["B"],
            r["method"],
            r["budget"] or "",
            r["slots"],
            r["attn_impl"],
            r["step_ms"],
            r["draft_ms"],
            r["tree_forward_ms"],
            r["plain_forward_ms"],
            f"{r['tree_forward_over_plain']:.2f}",
            f"{r['walk_xla_ms']:.3f}",
            f"{r['walk_pallas_ms']:.3f}",
            f"{100 * r['non_forward_share']:.1f}",
        ]
        for r in rows
    ]
    print("\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
