"""`python -m ddtree_jax.train {tokenizer,target,drafter,all,child_head} --config configs/train_tiny.json --out DIR`
(child_head: the path-conditioned head of an `all` run's pair, from the recipe's "child_head" section)."""

from __future__ import annotations

import argparse
import json
import sys

from ddtree_jax.train.pipeline import STAGES, Run, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_jax.train", description=__doc__)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument(
        "--config", required=True, help="the JSON recipe (configs/train_tiny.json, configs/train_default.json)"
    )
    parser.add_argument("--out", required=True, help="where target/, drafter/ and provenance.json go")
    parser.add_argument(
        "--work", default=None, help="manifest, tokenizer, token cache, Orbax checkpoints, logs (default OUT/work)"
    )
    parser.add_argument(
        "--commit", default=None, help="the code commit to record in provenance.json (default: git rev-parse HEAD)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue each training stage from its newest Orbax checkpoint"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe entry, e.g. --set target.train.steps=200 (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:  # a bad recipe, override or path: one error line (exit 2), as the ddtree-jax CLI; errors once a stage
        # runs keep their traceback
        cfg = load_config(args.config, args.overrides)
        run = Run(
            cfg,
            args.out,
            args.work,
            commit=args.commit,
            resume=args.resume,
            show_progress=not args.no_progress,
            config_path=args.config,
        )
        run.check(args.stage)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prov = run.run(args.stage)
    brief = {k: prov.get(k) for k in ("commit", "python_version", "total_size_mb", "wall_s")}
    for part in ("target", "drafter", "child_head"):
        if part in prov:
            brief[part] = {
                k: prov[part].get(k)
                for k in (
                    "params",
                    "size_mb",
                    "steps",
                    "final_train_loss",
                    "heldout_loss",
                    "heldout_ppl",
                    "heldout_accept_length",
                    "heldout_marginal_loss",
                )
                if k in prov[part]
            }
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
