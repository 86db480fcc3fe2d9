"""Shared pieces of the two training loops: optimizer and schedule, Orbax checkpoints, logs, dtypes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import optax

from ddtree_jax.checkpoint import restore_orbax, save_orbax

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

TRAIN_DEFAULTS = {
    "steps": 100,
    "batch_size": 8,
    "lr": 6e-4,
    "warmup_frac": 0.04,
    "end_lr_frac": 0.1,
    "weight_decay": 0.01,
    "b1": 0.9,
    "b2": 0.95,
    "clip": 1.0,
    "dtype": "float32",
    "eval_every": 0,
    "eval_batches": 8,
    "checkpoint_every": 0,
    "keep_checkpoints": 2,
    "log_every": 10,
}


# the integer settings and their least values (log_every 0 would divide by zero; the others 0: off)
_INT_MINIMUMS = {
    "steps": 1,
    "batch_size": 1,
    "eval_batches": 1,
    "log_every": 1,
    "eval_every": 0,
    "checkpoint_every": 0,
    "keep_checkpoints": 0,
    "num_anchors": 1,
}


def train_settings(cfg: dict) -> dict:
    """A stage's training settings over TRAIN_DEFAULTS, checked: known names, integers where counted (steps,
    batch_size, ...: `_INT_MINIMUMS`), lr / clip / gamma > 0, fractions and betas in [0, 1], dtype of DTYPES.
    ValueError naming the setting (a bad one used to fail at the first step, or train nothing and export)."""
    unknown = set(cfg) - set(TRAIN_DEFAULTS) - {"num_anchors", "gamma"}
    if unknown:
        raise ValueError(f"unknown training settings {sorted(unknown)}")
    out = {**TRAIN_DEFAULTS, **cfg}
    if out["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {out['dtype']!r}")
    for name, least in _INT_MINIMUMS.items():
        if name in out and (isinstance(out[name], bool) or not isinstance(out[name], int) or out[name] < least):
            raise ValueError(f"{name} must be an integer >= {least}, got {out[name]!r}")
    for name in ("lr", "clip", "gamma", "warmup_frac", "end_lr_frac", "weight_decay", "b1", "b2"):
        if name not in out:
            continue
        value = out[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if name in ("lr", "clip", "gamma") and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
        if name not in ("lr", "clip", "gamma") and not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return out


def schedule(settings: dict) -> optax.Schedule:
    """Linear warm-up over warmup_frac of the steps, then cosine decay to end_lr_frac * lr."""
    steps = settings["steps"]
    warmup = max(1, int(round(settings["warmup_frac"] * steps)))
    return optax.warmup_cosine_decay_schedule(
        0.0, settings["lr"], warmup, max(steps, warmup + 1), end_value=settings["lr"] * settings["end_lr_frac"]
    )


def optimizer(settings: dict) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; weight decay on matrices only (not norms)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(settings["clip"]),
        optax.adamw(
            schedule(settings),
            b1=settings["b1"],
            b2=settings["b2"],
            weight_decay=settings["weight_decay"],
            mask=decay_mask,
        ),
    )


def new_train_state(tx: optax.GradientTransformation, params: dict) -> dict:
    """The training state at step 0, as every trainer here (target, drafter, child head) carries and checkpoints
    it: {"params": params, "opt_state": tx.init(params), "step": int32 []}."""
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def apply_gradients(tx: optax.GradientTransformation, state: dict, grads) -> dict:
    """The training state after one optimizer step on `grads` (a tree like state["params"]): the params updated by
    tx, its opt_state advanced, step + 1."""
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "step": state["step"] + 1}


def cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def on_device(tree):
    """The tree committed to the default device: initial and restored states then share one compiled step
    (jit caches committed and uncommitted arguments apart, and Orbax restores committed arrays)."""
    return jax.device_put(tree, jax.devices()[0])


def count_params(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


class Checkpoints:
    """Orbax checkpoints of a training state under `directory`/step_XXXXXXXX, the last `keep` kept."""

    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        self.keep = max(1, keep)

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for n in os.listdir(self.directory) if (m := re.fullmatch(r"step_(\d{8})", n)))

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def save(self, step: int, state) -> None:
        os.makedirs(self.directory, exist_ok=True)
        save_orbax(self.path(step), state)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)

    def clear(self) -> None:
        """Removes every checkpoint (a run from step 0 replaces the earlier one)."""
        for step in self.steps():
            shutil.rmtree(self.path(step), ignore_errors=True)

    def restore_latest(self, like):
        """(step, state) of the newest checkpoint, or None."""
        steps = self.steps()
        if not steps:
            return None
        return steps[-1], on_device(restore_orbax(self.path(steps[-1]), like))


class Log:
    """Appends JSON lines (one per logged step / evaluation) to a file."""

    def __init__(self, path: str, fresh: bool = True, resumed_at: int | None = None):
        """fresh: start a new file (a run from step 0); else append (a resumed run), after dropping the records
        past `resumed_at` (the checkpoint's step: an interrupted run logged steps past it, which the resumed run
        logs again)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.start = time.perf_counter()
        if fresh and os.path.exists(path):
            os.remove(path)
        elif resumed_at is not None and os.path.exists(path):
            kept = self.records(resumed_at)
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, **record) -> None:
        record = {"time_s": round(time.perf_counter() - self.start, 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self, upto: int) -> list[dict]:
        """The records of steps <= upto already in the file (what a resumed run continues)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [r for r in map(json.loads, filter(str.strip, f)) if r.get("step", 0) <= upto]


def progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True, mininterval=1.0)


def open_checkpoints(checkpoint_dir: str | None, settings: dict, state, resume: bool):
    """(Checkpoints or None, first step, state): the newest checkpoint's step and state with `resume`, else
    step 0 with `state` (and any earlier checkpoints of that directory removed)."""
    checkpoints = Checkpoints(checkpoint_dir, settings["keep_checkpoints"]) if checkpoint_dir else None
    if checkpoints is None:
        return None, 0, state
    if resume and (found := checkpoints.restore_latest(state)) is not None:
        return checkpoints, found[0], found[1]
    checkpoints.clear()
    return checkpoints, 0, state


def training_loop(
    name: str,
    state,
    step_fn,
    *,
    steps: int,
    start: int,
    settings: dict,
    evaluate,
    checkpoints,
    log: Log | None,
    history: list,
    show_progress: bool,
):
    """Steps `start`..`steps` of a training run; returns (state, wall seconds).

    step_fn(state, step) -> (state, metrics): metrics holds "grad_norm" and the scalars that are averaged
    over each `log_every` window (logged, shown on the progress bar and appended to `history` as
    "train_<name>"). evaluate(state) -> (log record, history entry, message) runs every `eval_every`
    steps (not at the last: the caller evaluates the final state). Checkpoints every `checkpoint_every`
    steps and at the last."""
    lr = schedule(settings)
    window: list[dict] = []
    began = time.perf_counter()
    bar = progress(steps, start, name, show_progress)
    for step in range(start, steps):
        state, metrics = step_fn(state, step)
        window.append(metrics)
        done = step + 1
        if done % settings["log_every"] == 0 or done == steps:
            means = {k: float(jnp.mean(jnp.stack([m[k] for m in window]))) for k in metrics if k != "grad_norm"}
            window = []
            bar.set_postfix(**{k: f"{v:.3f}" for k, v in means.items()}, lr=f"{float(lr(done)):.2e}")
            if log:
                log.write(step=done, **means, grad_norm=float(metrics["grad_norm"]))
            history.append({"step": done, **{f"train_{k}": v for k, v in means.items()}})
        if settings["eval_every"] and done % settings["eval_every"] == 0 and done != steps:
            record, entry, message = evaluate(state)
            bar.write(f"{name} step {done}: {message}")
            if log:
                log.write(step=done, **record)
            history.append({"step": done, **entry})
        if checkpoints and settings["checkpoint_every"] and (done % settings["checkpoint_every"] == 0 or done == steps):
            checkpoints.save(done, state)
        bar.update(1)
    bar.close()
    return state, time.perf_counter() - began


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """A finished `run_training`: the final state, the step it started from (0, or the resumed checkpoint's),
    its Log (None without a log path), the history (a resumed run's earlier entries first), the loop's wall
    seconds."""

    state: dict
    start: int
    log: Log | None
    history: list
    wall_s: float

    def results(self, settings: dict, /, **fields) -> dict:
        """The results every trainer reports (trained parameter count, steps, resumed_from, batch_size), then
        `fields`, then wall_s and history."""
        return {
            "params": count_params(self.state["params"]),
            "steps": settings["steps"],
            "resumed_from": self.start or None,
            "batch_size": settings["batch_size"],
            **fields,
            "wall_s": round(self.wall_s, 2),
            "history": self.history,
        }


def run_training(
    name: str,
    state: dict,
    step_fn,
    *,
    settings: dict,
    evaluate,
    checkpoint_dir: str | None,
    log_path: str | None,
    resume: bool,
    show_progress: bool,
    resumed_entry=None,
) -> TrainingRun:
    """`training_loop` up to settings["steps"] from `state` (step 0), or with `resume` from the newest checkpoint
    in checkpoint_dir; logs to log_path (a new file from step 0, appended to on resume). On resume,
    resumed_entry(record) -> history entry or None rebuilds the earlier history from the log's records
    (None: the history starts empty)."""
    checkpoints, start, state = open_checkpoints(checkpoint_dir, settings, state, resume)
    log = Log(log_path, fresh=start == 0, resumed_at=start) if log_path else None
    records = log.records(start) if (log and start and resumed_entry) else []
    history = [entry for entry in map(resumed_entry, records) if entry is not None]
    state, wall = training_loop(
        name,
        state,
        step_fn,
        steps=settings["steps"],
        start=start,
        settings=settings,
        evaluate=evaluate,
        checkpoints=checkpoints,
        log=log,
        history=history,
        show_progress=show_progress,
    )
    return TrainingRun(state, start, log, history, wall)
