"""The jit-compiled DDTree builder: the best-first heap's tree without a host round trip.

Two stages, each with a Pallas kernel and an XLA form (`ddtree_kernels.tree_build`, `impl` below):

1. top-K per depth (K = min(budget, V)) of the float32 log-softmax, equal values -> lower token id:
   the kernel `tree_topk_logits` (the log-softmax, the dead-depth / invalid-row flags and the top-K in one
   launch from the raw logits; rows longer than `tree_build.MAX_ROW`: the exact chunk-max prefilter of
   `tree.select`, then `tree_topk`), or `lax.top_k` / the prefilter (`tree.select.top_k_log_probs`).
2. the best-first selection of `budget` prefixes by key (-logw, ranks tuple), laid out as the tree: the
   kernel `tree_slots` runs the heap itself on chip and writes the tree's fields; its twin
   `tree_slots_reference` is the parallel level-by-level formulation in XLA (`tree_select_reference`, whose
   docstring says why it is exact) plus the same layout. Both give the same slots, bit for bit, from the
   same log-probabilities.

The only divergence from the numpy heap (`tree.reference`) is where float32 rounding makes two different
real sums equal (|delta logw| ~ 1 ulp): near-ties, which may swap (`tree.compare`). (The kernel's
log-softmax sums in its own order, so its log-normaliser may differ from XLA's by an ulp: the same kind of
near-tie.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax import dispatch
from ddtree_jax.dispatch import BUILD_TOPK_IMPLS, TREE_IMPLS
from ddtree_jax.options import MAX_BUDGET
from ddtree_jax.tree.draft_tree import PAD_DEPTH, PAD_PARENT, PAD_RANK, PAD_TOKEN, DraftTree
from ddtree_jax.tree.select import prefilter_candidates, top_k_log_probs
from ddtree_jax.tree.vocab_parallel import sharded_top_k_log_probs
from ddtree_kernels import tree_build
from ddtree_kernels.tree_build import (
    tree_slots,
    tree_slots_reference,
    tree_topk,
    tree_topk_logits,
    tree_topk_logits_chunked,
)


def _as_array(draft_logits):
    """A list or other array-like as a numpy array (its own dtype kept for the checks: jnp.asarray would
    turn int64 into int32 before the dtype error could name it)."""
    return (
        draft_logits if hasattr(draft_logits, "ndim") and hasattr(draft_logits, "dtype") else np.asarray(draft_logits)
    )


def check_budget(budget) -> None:
    """ValueError naming the budget unless it is an int in [1, MAX_BUDGET] (`ddtree_jax.options`): a budget is
    static, so this raises under jit too. A budget above the nodes a shape can reach (V + V^2 + ... + V^L) is
    allowed: those slots are padding."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    if budget > MAX_BUDGET:
        raise ValueError(f"budget must be at most MAX_BUDGET = {MAX_BUDGET} (ddtree_jax.options), got {budget}")


def _check_inputs(draft_logits, budget: int) -> None:
    check_budget(budget)
    if draft_logits.ndim != 3:
        raise ValueError(f"draft_logits must have shape [B, L, V], got shape {tuple(draft_logits.shape)}")
    if not jnp.issubdtype(draft_logits.dtype, jnp.floating):
        raise ValueError(f"draft_logits must be a float array (float32 or bfloat16), got {draft_logits.dtype}")
    if 0 in draft_logits.shape:
        raise ValueError(f"draft_logits must be non-empty, got shape {tuple(draft_logits.shape)}")


def _check_finite(draft_logits) -> None:
    """Eager NaN/+inf check (one device->host sync); skipped when traced. -inf is a valid logit
    (probability 0: a masked token, which never enters the tree)."""
    if isinstance(draft_logits, jax.core.Tracer):
        return
    bad = np.asarray(_invalid_entries(draft_logits))
    if bad.any():
        row, depth, token = np.argwhere(bad)[0]
        raise ValueError(
            f"draft_logits contain NaN/+inf (first at row {row}, depth index {depth}, token {token}); "
            "under jit such a row yields a root-only tree instead"
        )


def _check_root_tokens(root_tokens, vocab: int) -> None:
    """Eager check (skipped when traced): root tokens lie in [0, vocab)."""
    if isinstance(root_tokens, jax.core.Tracer):
        return
    roots = np.asarray(root_tokens)
    bad = (roots < 0) | (roots >= vocab)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"root_tokens[{row}] = {int(roots[row])} is outside the vocabulary [0, V={vocab})")


def _invalid_entries(draft_logits: jax.Array) -> jax.Array:
    """bool, the shape of draft_logits: NaN or +inf (-inf is a valid logit)."""
    return jnp.isnan(draft_logits) | (draft_logits == jnp.inf)


def _mask_dead_depths(draft_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits with every all -inf depth replaced by zeros, dead bool [B, L]): a depth whose entries are
    all -inf has no candidates; its log-softmax would be NaN, so the caller sets its log-probs to -inf."""
    dead = (draft_logits == -jnp.inf).all(axis=-1)
    return jnp.where(dead[..., None], jnp.zeros((), draft_logits.dtype), draft_logits), dead


def kernel_top_k(draft_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per-depth top-K by the `tree_topk` kernel: the whole row when it fits the kernel, else the
    prefilter's candidates (or `lax.top_k` when even those do not fit). [B, L, V] -> f32, int32 [B, L, K]."""
    batch, depth_limit, vocab = draft_logits.shape
    log_probs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1).reshape(batch * depth_limit, vocab)
    if vocab <= tree_build.MAX_ROW:
        values, ids = tree_topk(log_probs, k)
    else:
        candidates, candidate_ids = prefilter_candidates(log_probs, k, dispatch.prefilter_chunk(vocab, k))
        if candidates.shape[-1] <= tree_build.MAX_ROW:
            values, pos = tree_topk(candidates, k)
        else:
            values, pos = lax.top_k(candidates, k)
        ids = jnp.take_along_axis(candidate_ids, pos, axis=-1)
    return values.reshape(batch, depth_limit, k), ids.reshape(batch, depth_limit, k)


def kernel_top_k_logits_fits(vocab: int, k: int) -> bool:
    """Whether `kernel_top_k_logits` takes rows of `vocab` logits at this k (else: XLA log-softmax + prefilter)."""
    return vocab <= tree_build.MAX_ROW or dispatch.tree_topk_chunk(vocab, k) is not None


def kernel_top_k_logits(draft_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas builder's top-K stage from the raw logits [B, L, V]: the log-softmax, the dead-depth /
    invalid-row flags and the top-K in one kernel (`tree_topk_logits`), or for rows longer than the kernel's a
    top-K of every chunk then one of their candidates (`tree_topk_logits_chunked`, `dispatch.tree_topk_chunk`).
    Returns (log-probs f32 [B, L, K], token ids int32 [B, L, K], flags int32 [B, L])."""
    batch, depth_limit, vocab = draft_logits.shape
    rows = draft_logits.reshape(batch * depth_limit, vocab)
    chunk = dispatch.tree_topk_chunk(vocab, k)
    lp, ids, flags = tree_topk_logits(rows, k) if chunk is None else tree_topk_logits_chunked(rows, k, chunk=chunk)
    return tuple(x.reshape((batch, depth_limit) + x.shape[1:]) for x in (lp, ids, flags))


@functools.partial(jax.jit, static_argnames=("budget", "topk_impl", "impl"))
def build_tree_unchecked(draft_logits, root_tokens, *, budget: int, topk_impl: str, impl: str = "xla") -> DraftTree:
    """`build_tree` without its eager input checks: the jitted builder itself (draft_logits [B, L, V],
    root_tokens int32 [B], static budget, topk_impl in BUILD_TOPK_IMPLS and impl "xla" / "pallas")
    -> DraftTree [B, budget + 1].
    A row with NaN/+inf logits gets a root-only tree; -inf entries never enter the tree, and a depth whose
    entries are all -inf has no candidates (the row's tree stops above it)."""
    batch, depth_limit, vocab = draft_logits.shape
    k = min(budget, vocab)
    if impl == "pallas" and topk_impl == "auto" and kernel_top_k_logits_fits(vocab, k):
        lp, ids, flags = kernel_top_k_logits(draft_logits, k)
        dead = (flags & tree_build.DEAD_DEPTH) != 0
        row_finite = ~((flags & tree_build.INVALID_ROW) != 0).any(axis=1)
    else:
        row_finite = ~_invalid_entries(draft_logits).any(axis=(1, 2))
        draft_logits, dead = _mask_dead_depths(draft_logits)
        if topk_impl == "vocab_parallel":  # the vocabulary split over the mesh's "model" axis (LM head under TP)
            lp, ids = sharded_top_k_log_probs(draft_logits, k)
        elif impl == "pallas" and topk_impl == "auto":
            lp, ids = kernel_top_k(draft_logits, k)
        else:
            lp, ids = top_k_log_probs(draft_logits, k, impl=topk_impl)  # [B, L, K] f32, int32
    # the selection and the tree's layout: in one kernel, or its XLA twin (the level-by-level selection). Dead
    # depths read as -inf log-probs (padding, never real); a row with NaN/+inf logits gets a root-only tree
    # (documented; the eager path raises instead).
    layout = tree_slots if impl == "pallas" else tree_slots_reference
    tokens, parents, depths, ranks, logw, num_nodes = layout(
        lp, ids, ~dead, root_tokens, row_finite, budget, pads=(PAD_TOKEN, PAD_PARENT, PAD_DEPTH, PAD_RANK)
    )
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        ranks=ranks,
        logw=logw,
        num_nodes=num_nodes,
        max_depth=depth_limit,
    )


def build_tree(
    draft_logits: jax.Array,
    budget: int,
    root_tokens: jax.Array | None = None,
    *,
    topk_impl: str = "auto",
    impl: str = "auto",
    check_finite: bool = True,
) -> DraftTree:
    """Builds the DDTree draft tree of N = budget + 1 slots for each row.

    Args:
      draft_logits: float32 or bfloat16 [B, L, V], the drafter's logits for depths 1..L (no temperature).
      budget: static number of draft nodes (root not counted): an int in [1, MAX_BUDGET = 1024]
        (`ddtree_jax.options.MAX_BUDGET`; ValueError otherwise, under jit too: the budget is static). Any V and
        L are allowed: fewer reachable nodes than `budget` (a small V x L, -inf logits, dead depths) leave
        padding slots.
      root_tokens: int32 [B] tokens for slot 0 (the bonus tokens), or None for 0.
      topk_impl: per-depth top-K selection: one of `dispatch.TOPK_IMPLS`, or
        "vocab_parallel" for logits whose vocabulary is split over the "model" axis of the mesh set with
        `jax.set_mesh` (`tree.vocab_parallel`: local top-K and a K-candidate gather instead of
        gathering the logits; 1.15-1.9x faster on 2 H200s, BENCHMARKS.md; without a mesh it is "xla").
        "auto" under impl "pallas" is the top-K kernel.
      impl: one of `dispatch.TREE_IMPLS`: the Pallas kernels ("pallas"; interpreted off GPU), the XLA
        builder ("xla"), or "auto" (`dispatch.tree_impl`: the kernels on GPU). Same trees.
      check_finite: when called eagerly, raise ValueError on NaN/+inf logits (costs one host sync).
        Under an outer jit the check cannot raise; such a row yields a root-only tree. -inf logits are
        valid (probability 0): those tokens never enter the tree, and a depth whose logits are all -inf
        has no candidates, so the tree stops above it.

    Returns:
      DraftTree with tokens/parents/depths/ranks int32 [B, N], logw float32 [B, N], num_nodes int32 [B].
    """
    draft_logits = _as_array(draft_logits)
    _check_inputs(draft_logits, budget)
    draft_logits = jnp.asarray(draft_logits)
    if check_finite:
        _check_finite(draft_logits)
    batch = draft_logits.shape[0]
    if root_tokens is None:
        root_tokens = jnp.zeros((batch,), jnp.int32)
    root_tokens = jnp.asarray(root_tokens, jnp.int32)
    if root_tokens.shape != (batch,):
        raise ValueError(f"root_tokens must have shape [B] = ({batch},), got {tuple(root_tokens.shape)}")
    _check_root_tokens(root_tokens, draft_logits.shape[2])
    if topk_impl not in BUILD_TOPK_IMPLS:
        raise ValueError(f"topk_impl must be one of {BUILD_TOPK_IMPLS}, got {topk_impl!r}")
    if impl not in TREE_IMPLS:
        raise ValueError(f"impl must be one of {TREE_IMPLS}, got {impl!r}")
    return build_tree_unchecked(
        draft_logits, root_tokens, budget=int(budget), topk_impl=topk_impl, impl=dispatch.tree_impl(impl)
    )


@jax.jit
def _build_chain_jit(draft_logits, root_tokens) -> DraftTree:
    batch, depth_limit, _ = draft_logits.shape
    row_finite = ~_invalid_entries(draft_logits).any(axis=(1, 2))
    draft_logits, dead = _mask_dead_depths(draft_logits)
    lp_full = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    top_token = jnp.argmax(lp_full, axis=-1).astype(jnp.int32)  # ties -> lowest id
    top_lp = jnp.max(lp_full, axis=-1)  # [B, L]
    logw = [top_lp[:, 0]]
    for level in range(1, depth_limit):  # left-to-right float32 sum, like the heap
        logw.append(logw[-1] + top_lp[:, level])
    slots = depth_limit + 1
    # the chain stops above the first depth with no candidates (all -inf); NaN/+inf rows are root-only
    alive = jnp.cumprod(~dead, axis=1).astype(bool) & row_finite[:, None]  # [B, L]
    real = jnp.concatenate([jnp.ones((batch, 1), bool), alive], axis=1)

    def per_slot(values, pad_value):
        return jnp.where(real, jnp.broadcast_to(values, (batch, slots)), pad_value)

    return DraftTree(
        tokens=per_slot(jnp.concatenate([root_tokens[:, None], top_token], axis=1), PAD_TOKEN),
        parents=per_slot(jnp.arange(-1, depth_limit, dtype=jnp.int32), PAD_PARENT),
        depths=per_slot(jnp.arange(slots, dtype=jnp.int32), PAD_DEPTH),
        ranks=per_slot(jnp.where(jnp.arange(slots) == 0, -1, 0).astype(jnp.int32), PAD_RANK),
        logw=per_slot(jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), jnp.stack(logw, axis=1)], axis=1), -jnp.inf),
        num_nodes=real.sum(axis=1, dtype=jnp.int32),
        max_depth=depth_limit,
    )


def build_chain(
    draft_logits: jax.Array, root_tokens: jax.Array | None = None, *, check_finite: bool = True
) -> DraftTree:
    """The linear DFlash chain: the root plus the top-1 token at each depth (L + 1 slots).

    Not `build_tree(budget=L)`, which branches. Same `DraftTree` form; all slots are real, except that a
    row stops above its first depth whose logits are all -inf (no candidates: padding after it), and a
    row with NaN/+inf logits is root-only under jit (eagerly, with check_finite, ValueError).
    """
    draft_logits = _as_array(draft_logits)
    _check_inputs(draft_logits, 1)
    draft_logits = jnp.asarray(draft_logits)
    if check_finite:
        _check_finite(draft_logits)
    batch = draft_logits.shape[0]
    root_tokens = jnp.zeros((batch,), jnp.int32) if root_tokens is None else jnp.asarray(root_tokens, jnp.int32)
    if root_tokens.shape != (batch,):
        raise ValueError(f"root_tokens must have shape [B] = ({batch},), got {tuple(root_tokens.shape)}")
    _check_root_tokens(root_tokens, draft_logits.shape[2])
    return _build_chain_jit(draft_logits, root_tokens)
