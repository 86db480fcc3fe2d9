"""Shared machinery of the studies on a trained target + DFlash drafter pair.

`study_generate` is the engine's own generation (`engine.generate.generate_recorded`: the same prefill and
while_loop of `engine.step.traced_decode_step` as `generate`) with an observer of each step's trace that
records, for every row and decode step: the number of accepted draft tokens, the drafter's **surrogate**
for that step's tree (1 + sum over non-root nodes of the drafter's path probability,
`tree.render.surrogate_tau`, computed from the tree actually built) and the **exact-mode expectation** of
the step's acceptance length given that tree and the target's logits at its slots (1 + sum over non-root
nodes of the product of the target's processed probabilities along the path: the analytic E[tau | tree]
of exact tree verification). The sibling order and the lossy thresholds are `DecodeOptions` fields (one
compilation per order and threshold pair); per-row stopping before `max_new_tokens` (`row_max_new`) uses
the engine's per-row max_new, so short runs reuse a long run's program.

With exact thresholds it emits exactly what `generate` emits for the same request keys (it is the same
loop; tested), so its tau is the engine's tau.

Where the pair lives: `pair_dirs()` reads `DDTREE_PAIR_DIR` (a directory holding `target/` and
`drafter/`, as `python -m ddtree_jax.train` writes them), else `checkpoints/embedded`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ancestor_problem
from ddtree_jax.engine.generate import generate_recorded
from ddtree_jax.engine.progress import LineProgress, progress_bar  # noqa: F401  (re-exported to the studies)
from ddtree_jax.engine.run import Pair, check_request, load_pair, request_args, resolve_block_size
from ddtree_jax.engine.step import StepTrace
from ddtree_jax.options import ORDER_POLICIES, DecodeOptions
from ddtree_jax.sampling import processed_probs
from ddtree_jax.tree import DraftTree
from experiments.held_out_prompts import DEFAULT_PAIR_DIR, PAIR_ENV, check_span, load_prompts, pair_root

__all__ = ["DEFAULT_PAIR_DIR", "PAIR_ENV", "pair_root"]  # re-exported: the studies' drivers read them here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT = (1.0, 1.0)  # (threshold_acc, threshold_single) of exact verification


# --- the pair --------------------------------------------------------------------------------------------------------


def pair_dirs(root: str | None = None) -> tuple[str, str]:
    """(target dir, drafter dir) under the pair root (`pair_root`)."""
    root = root or pair_root()
    return os.path.join(root, "target"), os.path.join(root, "drafter")


def load_study_pair(target_dir: str | None = None, drafter_dir: str | None = None, dtype=jnp.float32) -> Pair:
    """`engine.run.load_pair` with the studies' defaults (float32 weights unless `dtype` says otherwise: a jnp
    dtype, or "auto" for the checkpoint's own, bf16 for the embedded pair) and a clear message when the pair is
    missing."""
    default_target, default_drafter = pair_dirs()
    target_dir, drafter_dir = target_dir or default_target, drafter_dir or default_drafter
    for role, path in (("target", target_dir), ("drafter", drafter_dir)):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"no trained {role} at {path!r}. Train the pair first (python -m ddtree_jax.train all --config "
                f"configs/train_default.json --out checkpoints/embedded; configs/train_tiny.json for a CPU toy) or "
                f"point {PAIR_ENV} / --target / --drafter at one."
            )
    pair = load_pair(target_dir, drafter_dir, dtype)
    if pair.tokenizer is None:
        raise ValueError(f"the target directory {target_dir!r} has no tokenizer (tokenizer.json)")
    return pair


def read_provenance(target_dir: str) -> dict | None:
    """The pair's provenance.json (next to target/), or None."""
    path = os.path.join(os.path.dirname(os.path.abspath(target_dir)), "provenance.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pair_summary(target_dir: str, drafter_dir: str, pair: Pair) -> dict:
    """What a result file records about the pair: paths, sizes, block size, training commit and losses."""
    prov = read_provenance(target_dir) or {}
    cfg = pair.target_config
    out = {
        "target": os.path.relpath(os.path.abspath(target_dir), REPO)
        if os.path.abspath(target_dir).startswith(REPO)
        else os.path.abspath(target_dir),
        "drafter": os.path.relpath(os.path.abspath(drafter_dir), REPO)
        if os.path.abspath(drafter_dir).startswith(REPO)
        else os.path.abspath(drafter_dir),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "block_size": pair.drafter.max_block_size,
        "recipe": prov.get("recipe"),
        "trained_at_commit": prov.get("commit"),
    }
    for part in ("target", "drafter"):
        if part in prov:
            out[f"{part}_training"] = {
                k: prov[part].get(k)
                for k in ("params", "steps", "heldout_loss", "heldout_ppl", "heldout_accept_length")
                if k in prov[part]
            }
    return out


# --- per-step quantities ---------------------------------------------------------------------------------------------


def surrogate_tau_jnp(tree: DraftTree) -> jax.Array:
    """float32 [B]: 1 + sum over non-root nodes of exp(logw) (padding has logw = -inf): the drafter's own
    expected acceptance for this tree (`tree.render.surrogate_tau`, on device)."""
    return 1.0 + jnp.exp(tree.logw[:, 1:].astype(jnp.float32)).sum(axis=1)


def expected_tau_exact(tree: DraftTree, target_logits: jax.Array, sampling) -> jax.Array:
    """float32 [B]: E[accepted + 1 | tree] under exact tree verification: 1 + sum over non-root real nodes v
    of prod_{u on the path to v} q(token_u | u's parent slot), q = the target's processed probabilities
    (temperature and filters; one-hot for greedy rows, where this is 1 + the greedy path's length)."""
    probs = processed_probs(target_logits, sampling)  # [B, N, V]
    batch, slots, vocab = probs.shape
    parents = jnp.maximum(tree.parents, 0)
    flat = probs.reshape(batch, slots * vocab)
    p_edge = jnp.take_along_axis(flat, parents * vocab + jnp.clip(tree.tokens, 0, vocab - 1), axis=1)  # [B, N]
    real = tree.is_real & (jnp.arange(slots)[None, :] > 0)
    p_edge = jnp.where(real, p_edge, 0.0)
    root = jnp.arange(slots)[None, :] == 0
    path = jnp.where(root, 1.0, p_edge)
    for _ in range(tree.max_depth):  # a node's parent has a smaller depth: max_depth rounds settle every path
        path = jnp.where(root, 1.0, p_edge * jnp.take_along_axis(path, parents, axis=1))
    return 1.0 + jnp.where(root, 0.0, path).sum(axis=1)


# --- the generation loop with records --------------------------------------------------------------------------------


def spine_hits(tree: DraftTree, result, active: jax.Array) -> dict:
    """int32 [B] each: how the walk fared on and off the tree's spine. The spine is the path of rank-0 children
    from the root (each node its parent's most probable child: the chain inside the tree); a node is visited
    when its parent was accepted (the walk tried its parent's children) and hit when it was accepted.
    Returns spine_visited, spine_hit, off_visited, off_hit (0 for inactive rows)."""
    batch, slots = tree.tokens.shape
    width = result.accept_index.shape[1]
    on_path = (jnp.arange(width)[None, :] >= 1) & (jnp.arange(width)[None, :] <= result.num_accepted[:, None])
    where = jnp.where(on_path, result.accept_index, slots)  # slots: dropped
    accepted = jnp.zeros((batch, slots), bool).at[jnp.arange(batch)[:, None], where].set(True, mode="drop")
    accepted = accepted.at[:, 0].set(True)  # the root
    real = tree.is_real & (jnp.arange(slots)[None, :] > 0)
    parents = jnp.maximum(tree.parents, 0)
    root = jnp.arange(slots)[None, :] == 0
    spine = root | (real & (tree.ranks == 0))
    for _ in range(tree.max_depth):  # parents precede children: max_depth rounds settle every path
        spine = root | (real & (tree.ranks == 0) & jnp.take_along_axis(spine, parents, axis=1))
    visited = real & jnp.take_along_axis(accepted, parents, axis=1) & active[:, None]
    hit = visited & accepted
    count = lambda m: m.sum(axis=1).astype(jnp.int32)  # noqa: E731
    return {
        "spine_visited": count(visited & spine),
        "spine_hit": count(hit & spine),
        "off_visited": count(visited & ~spine),
        "off_hit": count(hit & ~spine),
    }


def spine_record(trace: StepTrace, sampling) -> dict:
    """`step_record` and the step's `spine_hits`, plus the budget the step verified (the cost-aware budget's
    choice; the fixed budget otherwise)."""
    return {
        **step_record(trace, sampling),
        **spine_hits(trace.tree, trace.result, trace.active),
        "budget": jnp.where(trace.active, trace.budget, -1),
    }


def step_record(trace: StepTrace, sampling) -> dict:
    """The observer of `generate_recorded`: per row, the step's accepted count (-1 when inactive), the
    drafter's surrogate and the exact-mode expectation for the tree built, and whether the row was active."""
    return {
        "accepted": jnp.where(trace.active, trace.result.num_accepted, -1),
        "surrogate": surrogate_tau_jnp(trace.tree),
        "expected": expected_tau_exact(trace.tree, trace.target_logits, sampling),
        "active": trace.active,
    }


def study_generate(
    pair: Pair,
    prompt_ids: list[list[int]],
    *,
    method: str = "ddtree",
    budget: int = 32,
    block_size: int | None = None,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    request_ids=None,
    stop_tokens=(),
    order: str = "draft",
    threshold_acc: float = 1.0,
    threshold_single: float = 1.0,
    verify_impl: str = "auto",
    batch_size: int | None = None,
    width: int | None = None,
    row_max_new: int | None = None,
    recorder=step_record,
    options: DecodeOptions | None = None,
) -> dict:
    """Generates for every prompt (one row each) and returns numpy arrays:

      tokens [B, max_new] (-1 padded), num_generated / steps / accepted_total [B], tau [B] (the engine's
      (accepted + steps) / steps; NaN for a row with no decode step), and per decode step [S, B]
      (S = max_new_tokens, rows past their last step inactive): accepted (-1 when inactive),
      surrogate, expected (exact-mode E[tau | tree]), active.

    Row b uses request key `request_ids[b]` (default b) folded from `seed`, as `engine.run.request_args`.
    batch_size: rows per compiled call (the last chunk is padded with copies and trimmed), to bound memory.
    row_max_new: stop every row after this many tokens (<= max_new_tokens, which only sizes the buffers and the
    compiled program: runs that differ in row_max_new share one compilation).
    recorder: the per-step observer (`step_record`, or `spine_record` for the spine statistics too); every
    record it returns is [S, B]. options: the run's `DecodeOptions` (e.g. a budget policy) with the order,
    thresholds and verify_impl given here put in.
    """
    if row_max_new is not None and not 1 <= row_max_new <= max_new_tokens:
        raise ValueError(f"row_max_new must be in [1, max_new_tokens = {max_new_tokens}], got {row_max_new}")
    if not 0.0 < threshold_acc <= 1.0 or not 0.0 < threshold_single <= 1.0:
        raise ValueError(
            f"thresholds must be in (0, 1], got threshold_acc={threshold_acc}, threshold_single={threshold_single}"
        )
    check_request(pair, prompt_ids, method=method, budget=budget, block_size=block_size, max_new_tokens=max_new_tokens)
    block = resolve_block_size(pair, method, block_size)
    total = len(prompt_ids)
    request_ids = np.arange(total) if request_ids is None else np.asarray(request_ids)
    if request_ids.shape != (total,):
        raise ValueError(f"request_ids must have one id per prompt ({total}), got shape {request_ids.shape}")
    width = width or max(len(p) for p in prompt_ids)
    chunk = batch_size or total  # every call has `chunk` rows: runs of any size share one compilation
    if order not in ORDER_POLICIES:
        raise ValueError(f"order must be one of {ORDER_POLICIES}, got {order!r}")
    options = (options or DecodeOptions()).replace(
        order=order,
        threshold_acc=float(threshold_acc),
        threshold_single=float(threshold_single),
        verify_impl=verify_impl,
    )
    static = dict(
        max_new_tokens=max_new_tokens,
        method=method,
        budget=budget,
        block_size=block,
        options=options,
        recorder=recorder,
    )
    parts = []
    for start in range(0, total, chunk):
        idx = list(range(start, min(start + chunk, total)))
        real = len(idx)
        idx += [idx[-1]] * (chunk - real)  # same shapes for every chunk: one compilation
        args = request_args(
            pair,
            [prompt_ids[i] for i in idx],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop_tokens=stop_tokens,
            max_new_tokens=max_new_tokens,
            width=width,
            request_ids=request_ids[idx],
        )
        if row_max_new is not None:
            args = args[:-1] + (jnp.full((chunk,), row_max_new, jnp.int32),)
        result, records = jax.device_get(generate_recorded(*args, **static))
        out = {
            "tokens": result.tokens,
            "num_generated": result.num_generated,
            "steps": result.steps,
            "accepted_total": result.accepted,
            **records,
        }
        out["accepted"] = np.where(out["active"], out["accepted"], -1)  # steps after the loop ended: inactive
        parts.append({k: np.asarray(v)[:, :real] if k in records else np.asarray(v)[:real] for k, v in out.items()})
    res = {k: np.concatenate([p[k] for p in parts], axis=1 if k in records else 0) for k in parts[0]}
    steps = res["steps"]
    with np.errstate(invalid="ignore", divide="ignore"):
        res["tau"] = np.where(steps > 0, (res["accepted_total"] + steps) / np.maximum(steps, 1), np.nan)
    return res


def step_records(res: dict) -> dict[str, np.ndarray]:
    """The active decode steps of a `study_generate` result, flattened: measured (accepted + 1), surrogate,
    expected, and the row each step belongs to."""
    active = res["active"]
    rows = np.broadcast_to(np.arange(active.shape[1])[None, :], active.shape)
    return {
        "measured": (res["accepted"][active] + 1).astype(np.float64),
        "surrogate": res["surrogate"][active].astype(np.float64),
        "expected": res["expected"][active].astype(np.float64),
        "row": rows[active],
    }


def pooled_tau(res: dict) -> float:
    """All tokens of all decode steps over all decode steps (a step-weighted mean of tau)."""
    steps = res["steps"].sum()
    return float((res["accepted_total"].sum() + steps) / steps) if steps else float("nan")


def mean_and_se(values) -> tuple[float, float]:
    """Mean and standard error over the finite values (NaN, NaN when none)."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


def eos_stop_tokens(pair: Pair) -> list[int]:
    """Stop at the tokenizer's eos (the file separator of the training corpus) when it has one."""
    eos = pair.tokenizer.eos_token_id if pair.tokenizer is not None else None
    return [] if eos is None else [int(eos)]


TAU_HEAD = ["T", "method", "budget", "mean tau", "+- se", "pooled tau", "surrogate"]


def tau_cells(row: dict) -> list[str]:
    """The first cells (`TAU_HEAD`) of a study's tau table line for one summarised row: temperature, method,
    budget ("" for none), mean tau, its standard error, pooled tau and the mean step surrogate."""
    return [
        f"{row['temperature']:g}",
        row["method"],
        "" if row["budget"] is None else str(row["budget"]),
        f"{row['mean_tau']:.3f}",
        f"{row['se_tau']:.3f}",
        f"{row['pooled_tau']:.3f}",
        f"{row['step_surrogate_mean']:.3f}",
    ]


def output_problem(path: str) -> str | None:
    """Why `path` cannot be written as a file (a directory; a parent that is a file or not writable), else None:
    checked before a long run, so a bad --out fails at once instead of after the sweep."""
    if os.path.isdir(path):
        return f"{path!r} is a directory; give a file path"
    return ancestor_problem(path, os.path.dirname(os.path.abspath(path)))  # write_json makes the folders


def save_figure(fig, path: str | None):
    """Lays fig out (tight); with a path, saves it there (dpi 120, folders made) and closes it. Returns fig."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


def write_json(payload: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    return path


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def setup(
    target_dir: str | None = None,
    drafter_dir: str | None = None,
    *,
    num_prompts: int,
    prompt_len: int,
    max_new: int,
    prompt_seed: int = 0,
    min_continuation: int | None = None,
    dtype=jnp.float32,
) -> tuple[Pair, list[dict], dict]:
    """(pair, held-out prompts, pair summary) for a study: the pair from `load_study_pair`, `num_prompts`
    prompts of `prompt_len` tokens from its held-out files (`held_out_prompts.load_prompts`, followed by at
    least `max_new` tokens of real text unless `min_continuation` says otherwise), a warning when prompt +
    max_new runs past the training sequence length. dtype: the weights' (`load_study_pair`)."""
    default_target, default_drafter = pair_dirs()
    target_dir, drafter_dir = target_dir or default_target, drafter_dir or default_drafter
    pair = load_study_pair(target_dir, drafter_dir, dtype)
    root = os.path.dirname(os.path.abspath(target_dir))
    check_span(root, prompt_len, max_new)
    prompts = load_prompts(
        root,
        pair.tokenizer,
        n=num_prompts,
        length=prompt_len,
        seed=prompt_seed,
        min_continuation=max_new if min_continuation is None else min_continuation,
    )
    return pair, prompts, pair_summary(target_dir, drafter_dir, pair)
