"""The `ddtree-jax` command line (also `python -m ddtree_jax`).

Subcommands:
  tree       build a DDTree from given (.npy) or synthetic draft logits and show it.
  generate   DDTree / DFlash-chain / AR generation from HF checkpoints (or a random tiny pair), timed.
  bench      AR vs DFlash chain vs DDTree (one column per budget) on the same prompts: a table, optional JSON;
             --profile adds per-stage times of one decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# dispatch.WEIGHT_DTYPES, written out: the parser is built before JAX is imported (--help stays fast);
# tests/test_cli.py checks the two agree
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def _tree_command(args: argparse.Namespace) -> int:
    if args.plot:
        _check_plot(args.plot)
    import jax
    import jax.numpy as jnp

    from ddtree_jax.engine.run import check_seed
    from ddtree_jax.tree import build_chain, build_tree
    from ddtree_jax.tree.render import depth_counts, format_tree, plot_tree, surrogate_tau
    from ddtree_jax.tree.synthetic import synthetic_draft_logits

    check_seed(args.seed)  # generate's check: an integer in [0, 2^32)
    if args.max_print is not None and args.max_print < 0:
        raise UsageError(f"--max-print must be >= 0, got {args.max_print}")
    if args.logits:
        logits = np.load(args.logits)
        if isinstance(logits, np.lib.npyio.NpzFile):  # an .npz archive: its one array, else ambiguous
            names = list(logits.files)
            if len(names) != 1:
                raise UsageError(f"{args.logits} holds {len(names)} arrays {names}: give a .npy or a one-array .npz")
            logits = logits[names[0]]
        if logits.ndim not in (2, 3):
            raise UsageError(f"{args.logits} holds an array of shape {logits.shape}: need [L, V] or [B, L, V]")
        if not np.issubdtype(logits.dtype, np.floating):
            raise UsageError(f"{args.logits} holds {logits.dtype} values: draft logits must be float")
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
        raise UsageError(f"--row {args.row} is out of range for {batch} rows")
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
        _make_parent(args.plot)
        plot_tree(tree, args.plot, args.row)
        print(f"plot written to {args.plot}")
    return 0


DEFAULT_PROMPTS = (  # bench's prompts when none are given and the pair has a tokenizer
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Q: What is 17 * 23? Show your work.\nA:",
)
DEFAULT_PROMPT_IDS = ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13])  # ... and without a tokenizer


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED_TARGET = os.path.join(REPO_ROOT, "checkpoints", "embedded", "target")  # generate / bench without --target
EMBEDDED_DRAFTER = os.path.join(REPO_ROOT, "checkpoints", "embedded", "drafter")


class UsageError(Exception):
    """A request the CLI cannot serve (printed as one `error: ...` line, exit code 2)."""


def _check_output(path: str, flag: str) -> None:
    """An output FILE (bench --json, tree --plot), checked before any work: not a directory, and in a
    directory that exists or can be created (its nearest existing ancestor a directory we may write in);
    `_make_parent` creates that directory when the file is written, as the training stages do."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; give a file name")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path!r} is not writable")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag} {path!r} cannot be written: {ancestor!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r} cannot be written: no write permission in {ancestor!r}")


def _make_parent(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def plot_formats() -> list[str]:
    """The extensions `tree --plot` takes: the file types matplotlib's Agg canvas writes, less pgf (that
    one needs a LaTeX installation)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return sorted(set(FigureCanvasAgg.get_supported_filetypes()) - {"pgf"})


def _check_plot(path: str) -> None:
    _check_output(path, "--plot")
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    formats = plot_formats()
    if extension not in formats:
        what = f"extension .{extension}" if extension else "no extension"
        raise UsageError(f"--plot {path!r} has {what}: matplotlib writes {', '.join(formats)}")


def _check_run_args(args: argparse.Namespace) -> None:
    """generate's and bench's options that need no pair, before anything loads or prints: --random-tiny
    alone (not with --target / --drafter / --child-head), an existing --child-head directory, the sampling
    values (`SamplingParams.create`'s validation), --seed (`check_seed`), --repeats (`check_repeats`)."""
    from ddtree_jax.engine.run import check_repeats, check_seed

    if args.random_tiny:
        pair_options = {"--target": args.target, "--drafter": args.drafter, "--child-head": args.child_head}
        given = [f"{flag} {value}" for flag, value in pair_options.items() if value]
        if given:
            raise UsageError(f"--random-tiny builds its own random pair: it cannot be combined with {', '.join(given)}")
    if args.child_head and not os.path.isdir(args.child_head):
        raise ValueError(f"--child-head directory {args.child_head!r} does not exist")
    if args.child_head and args.target and not args.drafter:
        raise ValueError("--child-head needs a drafter: give --drafter with --target")
    _check_sampling(args)
    check_seed(args.seed)
    check_repeats(args.repeats)
    # the request values that need no pair (the drafter's block-size limit is checked once it loads): a bad one
    # used to surface only after both checkpoints had loaded
    from ddtree_jax.options import DecodeOptions, check_block_size, check_ddtree_budget

    methods = args.methods.split(",") if hasattr(args, "methods") else [args.method]
    budgets = _parse_budgets(args.budget) if isinstance(args.budget, str) else [args.budget]
    if any(m in ("ddtree", "all") for m in methods):
        for budget in budgets:
            check_ddtree_budget(budget)
    if args.max_new < 1:
        raise ValueError(f"--max-new must be >= 1, got {args.max_new}")
    if args.block_size is not None:  # AR's only sizes its cache (>= 1); a drafter's upper bound once it loads
        check_block_size(args.block_size, least=1 if set(methods) == {"ar"} else 2)
    DecodeOptions(prefill_chunk=args.prefill_chunk)  # validates it (a ValueError naming the value)


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling values (`SamplingParams.create`'s validation), before anything loads or prints."""
    from ddtree_jax.sampling import SamplingParams

    SamplingParams.create(1, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)


def _load(args: argparse.Namespace):
    """The pair of --target/--drafter (or --random-tiny; without either, the embedded pair of
    checkpoints/embedded/), with the compilation cache set up."""
    from ddtree_jax.engine.run import (
        DEFAULT_CACHE_DIR,
        enable_compilation_cache,
        load_dtype,
        load_pair,
        random_tiny_pair,
    )

    if args.compilation_cache is None:  # DDTREE_COMPILATION_CACHE overrides the default ('' disables it)
        args.compilation_cache = os.environ.get("DDTREE_COMPILATION_CACHE", DEFAULT_CACHE_DIR)
    head = getattr(args, "child_head", None)
    if args.random_tiny and (args.target or args.drafter or head):  # _check_run_args says which option
        raise UsageError("--random-tiny cannot be combined with --target / --drafter / --child-head")
    enable_compilation_cache(args.compilation_cache or None)
    if args.random_tiny:
        return random_tiny_pair(args.seed)
    if args.target:
        return load_pair(
            args.target, args.drafter, dtype=load_dtype(args.dtype), check_finite=args.check_finite, child_head_dir=head
        )
    if args.drafter:
        raise ValueError("--drafter needs --target (the drafter runs on the target's embedding and head)")
    if not (os.path.isdir(EMBEDDED_TARGET) and os.path.isdir(EMBEDDED_DRAFTER)):
        raise ValueError(
            f"no --target given and the embedded pair ({EMBEDDED_TARGET}, {EMBEDDED_DRAFTER}) is not there: "
            "give --target DIR [--drafter DIR], or --random-tiny"
        )
    args.target, args.drafter = EMBEDDED_TARGET, EMBEDDED_DRAFTER
    return load_pair(
        args.target, args.drafter, dtype=load_dtype(args.dtype), check_finite=args.check_finite, child_head_dir=head
    )


def _encode(pair, texts: list[str], chat: bool, where: str) -> list[list[int]]:
    """Prompt texts -> ids with the pair's tokenizer (wrapped in its chat template with --chat)."""
    if pair.tokenizer is None:
        raise UsageError(
            "--prompt needs a tokenizer (tokenizer.json or tiktoken.model) in the target directory; use --prompt-ids"
        )
    if chat and not pair.tokenizer.has_chat_template:
        raise UsageError(
            f"--chat needs a chat template in {where} (chat_template.jinja or tokenizer_config.json's chat_template)"
        )
    prompts = []
    for text in texts:
        if chat:
            text = pair.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            prompts.append(pair.tokenizer.encode(text))  # the template writes the special tokens itself
        else:
            prompts.append(pair.tokenizer.encode(text, add_special_tokens=True))
    return prompts


def _stop_tokens(pair, chat: bool) -> list[int]:
    """With --chat: stop at the tokenizer's eos and end-of-turn tokens (<|im_end|> and kin)."""
    from ddtree_jax.engine.run import chat_stop_tokens

    return chat_stop_tokens(pair.tokenizer) if chat else []


def _sampling(args: argparse.Namespace) -> dict:
    from ddtree_jax.options import DecodeOptions

    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        options=DecodeOptions(order=args.order, prefill_chunk=args.prefill_chunk),
    )


def _profile_rows(pair, prompt, columns, args) -> list[tuple[str, dict]]:
    """stage_times of one decode step per (method, budget) column, on `prompt`."""
    from ddtree_jax.engine.profile import stage_times

    rows = []
    for method, budget in columns:
        times = stage_times(
            pair,
            prompt,
            method=method,
            budget=budget or 1,
            block_size=args.block_size,
            max_new_tokens=args.max_new,
            **_sampling(args),
            repeats=max(args.repeats, 10),
        )
        rows.append((method + ("" if budget is None else f" {budget}"), times))
    return rows


def _generate_command(args: argparse.Namespace) -> int:
    import jax

    from ddtree_jax.engine import run as run_module

    if args.chat and (args.prompt is None or args.prompt_ids is not None):
        raise UsageError("--chat wraps --prompt text as a user message; give --prompt (not --prompt-ids)")
    _check_run_args(args)
    pair = _load(args)
    methods = ["ar", "chain", "ddtree"] if args.method == "all" else [args.method]
    for method in methods:  # before anything compiles
        run_module.check_options(
            method,
            budget=args.budget,
            block_size=args.block_size,
            max_new_tokens=args.max_new,
            drafter=getattr(pair, "drafter", None),
        )
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids, "--prompt-ids")
    elif args.prompt is not None:
        prompt = _encode(pair, [args.prompt], args.chat, args.target)[0]
    else:
        prompt = [1, 2, 3, 4]
    for method in methods:  # the whole request (prompt, lengths, pair) before anything prints
        run_module.check_request(
            pair, [prompt], method=method, budget=args.budget, block_size=args.block_size, max_new_tokens=args.max_new
        )
    stop_tokens = _stop_tokens(pair, args.chat)
    decode = (lambda ids: pair.tokenizer.decode(ids, skip_special_tokens=True)) if pair.tokenizer else str
    print(
        f"device: {jax.devices()[0].platform}; prompt: {len(prompt)} tokens; T = {args.temperature}; "
        f"max_new_tokens = {args.max_new}" + (f"; stop tokens {stop_tokens}" if stop_tokens else ""),
        flush=True,
    )
    reports = {}
    for method in methods:
        report = run_module.run(
            pair,
            [prompt],
            method=method,
            budget=args.budget,
            block_size=args.block_size,
            max_new_tokens=args.max_new,
            **_sampling(args),
            stop_tokens=stop_tokens,
            repeats=args.repeats,
        )
        reports[method] = report
        print(
            f"\n[{method}{' budget ' + str(args.budget) if method == 'ddtree' else ''}] "
            f"tau = {report['tau']:.2f} tokens/step, {report['tokens_per_s']:.1f} tokens/s "
            f"(compile {report['compile_s']:.1f} s, run {report['run_s'] * 1e3:.0f} ms)"
        )
        if report.get("invalid_rows"):  # INVALID_TOKEN is no token id: say why there is no text (docs/sampling.md)
            print(
                "(the run marked this row invalid, e.g. non-finite logits from the weights: no text; check the "
                "checkpoint without --no-check-finite)",
                flush=True,
            )
        else:
            print(decode(report["tokens"][0]), flush=True)
    if "ar" in reports and len(reports) > 1:
        for method, report in reports.items():
            if method != "ar":  # tokens/s, as `bench`: with stop tokens or sampling the methods emit different counts
                speedup = report["tokens_per_s"] / reports["ar"]["tokens_per_s"]
                print(f"speedup over AR ({method}): {speedup:.2f}x on this machine")
    if args.profile:
        from ddtree_jax.engine.profile import format_stage_table

        columns = [(m, args.budget if m == "ddtree" else None) for m in methods]
        print(
            "\nper-stage times of one decode step:\n" + format_stage_table(_profile_rows(pair, prompt, columns, args))
        )
    return 0


def _bench_prompts(args: argparse.Namespace, pair) -> list[list[int]]:
    if args.chat and args.prompt_ids:
        raise UsageError("--chat wraps prompt texts as user messages; give --prompt / --prompt-file")
    if args.prompt_ids:
        return [_parse_ids(text, "--prompt-ids") for text in args.prompt_ids]
    texts = list(args.prompt or [])
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file!r} does not exist")
        with open(args.prompt_file, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f if line.strip()]  # a CRLF file's \r is not prompt text
        if not lines:
            raise ValueError(f"--prompt-file {args.prompt_file!r} has no prompts (one per line)")
        texts += lines
    if texts:
        return _encode(pair, texts, args.chat, args.target)
    if pair.tokenizer is not None:
        return _encode(pair, list(DEFAULT_PROMPTS), args.chat, args.target)
    if args.chat:
        raise UsageError("--chat needs a tokenizer with a chat template")
    return [list(p) for p in DEFAULT_PROMPT_IDS]


def _parse_budgets(text: str) -> list[int]:
    budgets = _parse_ids(text, "--budget")
    if not budgets:
        raise ValueError(f"--budget must be comma-separated integers, got {text!r}")
    return list(dict.fromkeys(budgets))


def _bench_command(args: argparse.Namespace) -> int:
    import jax

    from ddtree_jax.engine import run as run_module

    if args.json:  # before anything runs: an unwritable FILE would lose the results
        _check_output(args.json, "--json")
    budgets = _parse_budgets(args.budget)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in run_module.METHODS]
    if bad or not methods:
        raise ValueError(
            f"--methods must be a comma-separated subset of {','.join(run_module.METHODS)}, got {args.methods!r}"
        )
    _check_run_args(args)
    pair = _load(args)
    columns = run_module.bench_columns(budgets, methods)
    for method, budget in columns:  # before anything compiles
        run_module.check_options(
            method, budget=budget, block_size=args.block_size, max_new_tokens=args.max_new, drafter=pair.drafter
        )
    prompts = _bench_prompts(args, pair)
    for method, budget in columns:  # the whole request (prompts, lengths, pair) before anything prints
        run_module.check_request(
            pair, prompts, method=method, budget=budget, block_size=args.block_size, max_new_tokens=args.max_new
        )
    stop_tokens = _stop_tokens(pair, args.chat)
    device = jax.devices()[0]
    print(
        f"device: {device.platform} ({device.device_kind}); {len(prompts)} prompt(s) of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; T = {args.temperature}; "
        f"max_new_tokens = {args.max_new}; repeats = {args.repeats}"
        + (f"; stop tokens {stop_tokens}" if stop_tokens else ""),
        flush=True,
    )
    rows = run_module.benchmark(
        pair,
        prompts,
        budgets=budgets,
        block_size=args.block_size,
        max_new_tokens=args.max_new,
        **_sampling(args),
        stop_tokens=stop_tokens,
        repeats=args.repeats,
        methods=methods,
        progress=not args.no_progress,
    )
    header = f"{'method':<8}{'budget':>7}{'block':>6}{'tokens/s':>11}{'mean tau':>10}{'speedup':>9}{'compile s':>11}"
    print("\n" + header + "\n" + "-" * len(header))
    for row in rows:
        speedup = "" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        print(
            f"{row['method']:<8}{'' if row['budget'] is None else row['budget']:>7}"
            f"{'' if row['block_size'] is None else row['block_size']:>6}{row['tokens_per_s']:>11.1f}"
            f"{row['mean_tau']:>10.2f}{speedup:>9}{row['compile_s']:>11.1f}"
        )
    print(
        "(tokens/s: all prompts' tokens over their summed median run times, prefill included; "
        "speedup: tokens/s over AR's)"
    )
    if args.temperature == 0 and any(row.get("same_text_as_ar") is False for row in rows):
        differ = [
            row["method"] + ("" if row["budget"] is None else f" {row['budget']}")
            for row in rows
            if row.get("same_text_as_ar") is False
        ]
        print(f"note: greedy text differs from AR's for {', '.join(differ)} (near-ties in low precision)")
    profile = None
    if args.profile:
        from ddtree_jax.engine.profile import format_stage_table

        profile = _profile_rows(pair, prompts[0], columns, args)
        print("\nper-stage times of one decode step (prompt 0):\n" + format_stage_table(profile))
    if args.json:
        out = {
            "device": {"platform": device.platform, "kind": device.device_kind, "count": jax.device_count()},
            "settings": {
                "budgets": budgets,
                "methods": methods,
                "block_size": args.block_size,
                "max_new_tokens": args.max_new,
                "temperature": args.temperature,
                "top_k": args.top_k,
                "top_p": args.top_p,
                "min_p": args.min_p,
                "order": args.order,
                "seed": args.seed,
                "repeats": args.repeats,
                "stop_tokens": stop_tokens,
                "chat": args.chat,
                "target": args.target,
                "drafter": args.drafter,
                "random_tiny": args.random_tiny,
            },
            "prompts": prompts,
            "results": rows,
            "profile": None
            if profile is None
            else [{"method": m, "budget": b, **times} for (m, b), (_, times) in zip(columns, profile)],
        }
        _make_parent(args.json)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"results written to {args.json}")
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; None / False defaults (no value, a flag off) are said in
    the help text itself or not at all."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        help="HF directory of the target (config.json, safetensors, tokenizer.json or tiktoken.model) "
        "(default: the embedded pair, checkpoints/embedded/target with checkpoints/embedded/drafter)",
    )
    parser.add_argument("--drafter", help="HF directory of the DFlash drafter (default: none with --target: AR only)")
    parser.add_argument(
        "--child-head",
        help="a path-conditioned child head for the drafter (`python -m ddtree_jax.train child_head` writes one): "
        "DDTree then builds path-conditioned trees (default: none, DDTree's marginal trees)",
    )
    parser.add_argument(
        "--random-tiny", action="store_true", help="a random tiny pair instead (smoke run; default: off)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="the dtype the weights load in and the KV caches hold (default auto: on GPU the checkpoint's "
        "stored dtype, bfloat16 for the embedded pair; float32 elsewhere)",
    )
    parser.add_argument(
        "--no-check-finite",
        dest="check_finite",
        action="store_false",
        help="skip the check that every floating-point checkpoint tensor is finite (no NaN / inf) "
        "(default: checked, which reads every value once more on the host)",
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-size", type=int, default=None, help="drafter block size: slots per step (default: the drafter's)"
    )
    parser.add_argument(
        "--max-new",
        "--max-new-tokens",
        dest="max_new",
        type=int,
        default=64,
        help="tokens to generate per prompt (--max-new-tokens: the HF name)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = all")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    parser.add_argument(
        "--order", default="draft", choices=["draft", "reverse", "random"], help="sibling verification order"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="prompt tokens per prefill chunk (default 0: auto, chunks of 2,048 beyond 2,048 tokens; MoE targets "
        "~8,192 tokens over the batch)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after compilation, >= 1 (median reported)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also time each stage of one decode step alone (draft, tree, verify forward, "
        "verification, commit) next to the fused step (default: off)",
    )
    parser.add_argument(
        "--compilation-cache",
        default=None,
        help="persistent XLA cache dir, '' to disable "
        "(default: $DDTREE_COMPILATION_CACHE, else ~/.cache/ddtree_jax/xla)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tree = sub.add_parser("tree", help="build and show a DDTree from draft logits")
    tree.add_argument("--logits", help=".npy file of draft logits [L, V] or [B, L, V] (default: synthetic)")
    tree.add_argument("--budget", type=int, default=32, help="draft nodes, root not counted (default 32)")
    tree.add_argument("--depth", type=int, default=7, help="synthetic: depth limit L = block size - 1 (default 7)")
    tree.add_argument("--vocab", type=int, default=151936, help="synthetic: vocabulary size (default 151936)")
    tree.add_argument("--seed", type=int, default=0, help="synthetic: seed, an integer in [0, 2^32) (default 0)")
    tree.add_argument("--sharpness", type=float, default=3.0, help="synthetic: Zipf exponent at depth 1")
    tree.add_argument("--decay", type=float, default=0.85, help="synthetic: sharpness factor per depth")
    tree.add_argument("--row", type=int, default=0, help="which batch row to show")
    tree.add_argument("--max-print", type=int, default=None, help="print at most this many nodes")
    tree.add_argument(
        "--plot", metavar="FILE", help="also draw the tree to FILE (png/pdf/svg, or another type matplotlib writes)"
    )
    tree.set_defaults(func=_tree_command)

    gen = sub.add_parser(
        "generate",
        help="speculative generation from HF checkpoints, timed",
        description="Speculative generation (DDTree / DFlash chain / AR) from HF checkpoints, timed; "
        "without --target, the embedded pair of checkpoints/embedded/.",
        formatter_class=_HelpFormatter,
    )
    _add_pair_args(gen)
    gen.add_argument(
        "--prompt", help="prompt text, needs the target's tokenizer (default: --prompt-ids, else ids 1,2,3,4)"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap --prompt as one user message in the target's chat template (generation prompt added); "
        "generation stops at the tokenizer's eos / end-of-turn token (default: off)",
    )
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids (default: --prompt, else 1,2,3,4)")
    gen.add_argument(
        "--method", default="ddtree", choices=["ddtree", "chain", "ar", "all"], help="decoding method; all: each"
    )
    gen.add_argument("--budget", type=int, default=32, help="DDTree budget: draft nodes per step, root not counted")
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate_command)

    bench = sub.add_parser(
        "bench",
        help="AR vs DFlash chain vs DDTree on the same prompts: tokens/s, tau, speedup",
        description="AR vs the DFlash chain vs DDTree (one column per budget) on the same prompts: tokens/s, "
        "tau, speed-up; without --target, the embedded pair of checkpoints/embedded/.",
        formatter_class=_HelpFormatter,
    )
    _add_pair_args(bench)
    bench.add_argument(
        "--prompt",
        action="append",
        help="prompt text, repeatable; needs the target's tokenizer (default: built-in prompts, or ids without a "
        "tokenizer)",
    )
    bench.add_argument("--prompt-file", help="a text file of prompts, one per line (default: none)")
    bench.add_argument(
        "--prompt-ids", action="append", help="comma-separated prompt token ids, repeatable (default: none)"
    )
    bench.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the chat template; stop at end of turn (default: off)"
    )
    bench.add_argument("--budget", default="32", help="DDTree budget(s), comma-separated: one column each (16,64,256)")
    bench.add_argument("--methods", default="ar,chain,ddtree", help="columns to run, comma-separated")
    _add_sampling_args(bench)
    bench.add_argument(
        "--json", metavar="FILE", help="also write every number (per prompt too) to FILE (default: none)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    bench.set_defaults(func=_bench_command)

    plan = sub.add_parser(
        "dispatch", help="what one decode step runs: every 'auto' choice for a target, method and budget"
    )
    plan.add_argument(
        "--config",
        default="configs/kimi_k2_6.json",
        help="HF config.json of the target, or a directory holding one (default configs/kimi_k2_6.json)",
    )
    plan.add_argument("--backend", default=None, choices=["gpu", "cpu", "tpu"], help="default: this machine's")
    plan.add_argument("--method", default="ddtree", choices=["ddtree", "chain", "ar"])
    plan.add_argument("--budget", type=int, default=32)
    plan.add_argument("--block-size", type=int, default=16, help="drafter block size (chain slots; default 16)")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument(
        "--context",
        type=int,
        default=None,
        help="committed tokens before the step (the cache's rows: these + the step's slots, in whole 128-row blocks; default unknown: no short-cache rule)",
    )
    plan.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="the weights' dtype, as generate's --dtype (default auto: on GPU the config's torch_dtype)",
    )
    for name in ("attn-impl", "matmul-impl", "moe-impl", "verify-impl", "layer-loop", "topk-impl"):
        plan.add_argument(f"--{name}", default="auto", help=f"DecodeOptions.{name.replace('-', '_')} (default auto)")
    plan.set_defaults(func=_dispatch_command)
    return parser


def _dispatch_command(args: argparse.Namespace) -> int:
    from ddtree_jax import dispatch
    from ddtree_jax.checkpoint.hf_config import parse_config, read_config
    from ddtree_jax.config import DFlashConfig
    from ddtree_jax.options import MAX_BUDGET, DecodeOptions

    options = DecodeOptions(
        attn_impl=args.attn_impl,
        matmul_impl=args.matmul_impl,
        moe_impl=args.moe_impl,
        verify_impl=args.verify_impl,
        layer_loop=args.layer_loop,
        topk_impl=args.topk_impl,
    )
    if not 1 <= args.budget <= MAX_BUDGET or args.block_size < 2 or args.batch < 1:
        raise ValueError(
            f"--budget in [1, {MAX_BUDGET}], --block-size >= 2 and --batch >= 1, got {args.budget}, {args.block_size}, "
            f"{args.batch}"
        )
    if args.context is not None and args.context < 0:
        raise ValueError(f"--context must be >= 0 (tokens committed before the step), got {args.context}")
    raw = read_config(args.config)  # a directory's config.json or a config file; errors name the file
    config = parse_config(raw)
    if isinstance(config, DFlashConfig):
        raise UsageError(
            f"--config {args.config} is a drafter (DFlash) config, not a target's: dispatch plans the target's "
            "step; give the target's config.json"
        )
    backend = args.backend or dispatch.backend()
    weights = dispatch.weights_dtype(args.dtype, backend)
    # HF's names for the stored dtype, at the top level or in a wrapper's text_config (Kimi K2.x)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    stored = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    if weights == "checkpoint" and stored is None:
        print(f"note: {args.config} states no torch_dtype: planned for float32 weights (--dtype bfloat16 otherwise)")
    dtype = (stored or "float32") if weights == "checkpoint" else weights
    rows = dispatch.decode_plan(
        options,
        config,
        method=args.method,
        budget=args.budget,
        block_size=args.block_size,
        batch=args.batch,
        float32=dtype == "float32",
        keys=args.context,
        backend_name=backend,
    )
    print(
        f"{type(config).__name__} ({args.config}), {args.method}"
        f"{f' budget {args.budget}' if args.method == 'ddtree' else ''}, batch {args.batch}, backend {backend}, "
        f"weights {dtype}"
    )
    width = max(len(r.stage) for r in rows)
    for r in rows:
        print(f"  {r.stage:<{width}}  {r.choice:<10}  {r.why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ddtree_jax.checkpoint.errors import CheckpointError  # after parsing: --help imports no JAX

    try:
        return args.func(args)
    except (UsageError, CheckpointError, ValueError, OSError) as err:  # bad input: one clear line, no traceback
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
