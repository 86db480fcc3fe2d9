"""The `ddtree-jax` command line (also `python -m ddtree_jax`).

Subcommands:
  tree   build a DDTree from given (.npy) or synthetic draft logits and show it.
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
