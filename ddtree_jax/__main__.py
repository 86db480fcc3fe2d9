"""The `ddtree-jax` command line (also `python -m ddtree_jax`).

Subcommands:
  tree       build a DDTree from given (.npy) or synthetic draft logits and show it.
  generate   DDTree / DFlash-chain / AR generation from HF checkpoints (or a random tiny pair), timed.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _tree_command(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from ddtree_jax.tree import build_chain, build_tree
    from ddtree_jax.tree.render import depth_counts, format_tree, plot_tree, surrogate_tau
    from ddtree_jax.tree.synthetic import synthetic_draft_logits

    if args.logits:
        logits = np.load(args.logits)
        if logits.ndim == 2:
            logits = logits[None]
        source = f"logits from {args.logits}"
    else:
        logits = synthetic_draft_logits(
            jax.random.key(args.seed), 1, args.depth, args.vocab, sharpness=args.sharpness, decay=args.decay
        )
        source = f"synthetic drafter (seed {args.seed}, sharpness {args.sharpness}, decay {args.decay})"
    logits = jnp.asarray(logits)
    batch, depth, vocab = logits.shape
    if not 0 <= args.row < batch:
        raise SystemExit(f"error: --row {args.row} is out of range for {batch} rows")
    start = time.perf_counter()
    tree = build_tree(logits, args.budget)
    jax.block_until_ready(tree)
    elapsed = time.perf_counter() - start
    chain = build_chain(logits)
    print(f"DDTree draft tree: budget {args.budget}, depth limit L = {depth}, vocab V = {vocab}; {source}")
    print(f"(built in {elapsed * 1e3:.1f} ms incl. compilation on {jax.devices()[0].platform})\n")
    print(format_tree(tree, args.row, max_nodes=args.max_print))
    counts = depth_counts(tree)[args.row]
    print("\nnodes per depth: " + "  ".join(f"d{d + 1}:{c}" for d, c in enumerate(counts) if c))
    print(f"real nodes: {int(tree.num_nodes[args.row]) - 1} of budget {args.budget}")
    print(f"surrogate expected acceptance tau = 1 + sum_u q(u) = {surrogate_tau(tree)[args.row]:.4f}")
    print(f"  (DFlash chain of {depth} tokens on the same marginals: {surrogate_tau(chain)[args.row]:.4f})")
    if args.plot:
        plot_tree(tree, args.plot, args.row)
        print(f"plot written to {args.plot}")
    return 0


def _generate_command(args: argparse.Namespace) -> int:
    import jax

    from ddtree_jax.engine.run import enable_compilation_cache, load_pair, random_tiny_pair, run

    if args.chat and (args.prompt is None or args.prompt_ids):
        raise SystemExit("error: --chat wraps --prompt text as a user message; give --prompt (not --prompt-ids)")
    if args.compilation_cache is None:
        from ddtree_jax.engine.run import DEFAULT_CACHE_DIR

        args.compilation_cache = DEFAULT_CACHE_DIR
    enable_compilation_cache(args.compilation_cache or None)
    if args.random_tiny:
        pair = random_tiny_pair(args.seed)
    elif args.target:
        pair = load_pair(args.target, args.drafter)
    else:
        raise SystemExit("error: give --target DIR [--drafter DIR], or --random-tiny")
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    elif args.prompt is not None:
        if pair.tokenizer is None:
            raise SystemExit("error: --prompt needs a tokenizer (tokenizer.json or tiktoken.model) in the target "
                             "directory; use --prompt-ids")
        if args.chat:
            if not pair.tokenizer.has_chat_template:
                raise SystemExit(f"error: --chat needs a chat template in {args.target} (chat_template.jinja or "
                                 "tokenizer_config.json's chat_template)")
            text = pair.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                      add_generation_prompt=True)
            prompt = pair.tokenizer.encode(text)  # the template writes the special tokens itself
        else:
            prompt = pair.tokenizer.encode(args.prompt, add_special_tokens=True)
    else:
        prompt = [1, 2, 3, 4]
    decode = (lambda ids: pair.tokenizer.decode(ids, skip_special_tokens=True)) if pair.tokenizer else str
    methods = ["ar", "chain", "ddtree"] if args.method == "all" else [args.method]
    print(f"device: {jax.devices()[0].platform}; prompt: {len(prompt)} tokens; T = {args.temperature}; "
          f"max_new_tokens = {args.max_new}", flush=True)
    reports = {}
    for method in methods:
        report = run(pair, [prompt], method=method, budget=args.budget, block_size=args.block_size,
                     max_new_tokens=args.max_new, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     min_p=args.min_p, seed=args.seed, order=args.order, repeats=args.repeats)
        reports[method] = report
        print(f"\n[{method}{' budget ' + str(args.budget) if method == 'ddtree' else ''}] "
              f"tau = {report['tau']:.2f} tokens/step, {report['tokens_per_s']:.1f} tokens/s "
              f"(compile {report['compile_s']:.1f} s, run {report['run_s'] * 1e3:.0f} ms)")
        print(decode(report["tokens"][0]))
    if "ar" in reports and len(reports) > 1:
        for method, report in reports.items():
            if method != "ar":
                print(f"speedup over AR ({method}): {reports['ar']['run_s'] / report['run_s']:.2f}x on this machine")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tree = sub.add_parser("tree", help="build and show a DDTree from draft logits")
    tree.add_argument("--logits", help=".npy file of draft logits [L, V] or [B, L, V] (default: synthetic)")
    tree.add_argument("--budget", type=int, default=32, help="draft nodes, root not counted (default 32)")
    tree.add_argument("--depth", type=int, default=7, help="synthetic: depth limit L = block size - 1 (default 7)")
    tree.add_argument("--vocab", type=int, default=151936, help="synthetic: vocabulary size (default 151936)")
    tree.add_argument("--seed", type=int, default=0)
    tree.add_argument("--sharpness", type=float, default=3.0, help="synthetic: Zipf exponent at depth 1")
    tree.add_argument("--decay", type=float, default=0.85, help="synthetic: sharpness factor per depth")
    tree.add_argument("--row", type=int, default=0, help="which batch row to show")
    tree.add_argument("--max-print", type=int, default=None, help="print at most this many nodes")
    tree.add_argument("--plot", metavar="FILE", help="also draw the tree to FILE (png/pdf/svg)")
    tree.set_defaults(func=_tree_command)

    gen = sub.add_parser("generate", help="speculative generation from HF checkpoints, timed")
    gen.add_argument("--target", help="HF directory of the target (config.json, safetensors, tokenizer.json or "
                     "tiktoken.model)")
    gen.add_argument("--drafter", help="HF directory of the DFlash drafter")
    gen.add_argument("--random-tiny", action="store_true", help="a random tiny pair instead (smoke run)")
    gen.add_argument("--prompt", help="prompt text (needs the target's tokenizer)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap --prompt as one user message in the target's chat template (generation prompt added)")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--method", default="ddtree", choices=["ddtree", "chain", "ar", "all"])
    gen.add_argument("--budget", type=int, default=32)
    gen.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    gen.add_argument("--max-new", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--order", default="draft", choices=["draft", "reverse", "random"])
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--repeats", type=int, default=3, help="timed runs after compilation (median reported)")
    gen.add_argument("--compilation-cache", default=None, help="persistent XLA cache dir ('' to disable)")
    gen.set_defaults(func=_generate_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
