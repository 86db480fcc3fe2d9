"""The jit-compiled DDTree builder: the best-first heap's tree without a sequential loop.

Parallel formulation (exact). The heap pops prefixes in the total order
    key(p) = (-logw(p), ranks tuple of p)          (lexicographic; a prefix sorts before its extensions)
because every prefix's heap predecessor (its parent, or its previous sibling) has a strictly smaller
key, and float32 rounding of `logw + lp` is monotone. The tree S is therefore the `budget` smallest
keys over all prefixes, in key order. We find it level by level:

1. top-K per depth (K = min(budget, V)) of the float32 log-softmax, equal values -> lower token id.
2. C_1 = the K depth-1 prefixes. C_{l+1} = the `budget` best keys among C_l x {ranks}, where only the
   pairs (i, r) with (i + 1) * (r + 1) <= budget can qualify (every (i', r') <= (i, r) precedes (i, r),
   and all of them would have to be in S). Every node of S at length l + 1 has its parent in S, hence
   in C_l, so S is contained in the union of the C_l.
3. The union, laid out in lexicographic (DFS preorder) order of the ranks tuples, goes through one
   `lax.top_k`, whose lower-index-first tie-break is then exactly the heap's tie-break.

Within a level the ranks-tuple order of a child is (parent's lexicographic rank, own rank), so each
level's selection is one two-key sort; the global preorder comes from subtree sizes.
The only divergence from the heap is where float32 rounding makes two different real sums equal
(|delta logw| ~ 1 ulp): near-ties, which may swap (`tree.compare`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax.dispatch import BUILD_TOPK_IMPLS
from ddtree_jax.tree.draft_tree import PAD_DEPTH, PAD_PARENT, PAD_RANK, PAD_TOKEN, DraftTree
from ddtree_jax.tree.select import top_k_log_probs
from ddtree_jax.tree.vocab_parallel import sharded_top_k_log_probs


def _check_inputs(draft_logits, budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
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


@functools.cache
def _candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (parent position, rank) pairs with (i + 1) * (r + 1) <= budget, r < k, i < budget."""
    parent_pos, rank = [], []
    for i in range(budget):
        for r in range(min(k, budget // (i + 1))):
            parent_pos.append(i)
            rank.append(r)
    return np.array(parent_pos, dtype=np.int32), np.array(rank, dtype=np.int32)


def _sort_key(logw: jax.Array) -> jax.Array:
    # Ascending sort key for descending logw; `+ 0.0` maps -0.0 to +0.0 so both compare equal in
    # lax.sort's total order. -inf (padding) becomes +inf and sorts last.
    return -logw + 0.0


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _build_row(lp: jax.Array, budget: int) -> tuple[jax.Array, ...]:
    """One row. lp: float32 [L, K] per-depth top-K log-probs (rank order).

    Returns, for the `budget` draft slots in pop order: level (depth - 1) int32, rank int32,
    parent slot int32 (0 = root), logw float32 (-inf = padding).
    """
    depth_limit, k = lp.shape
    pair_parent, pair_rank = (jnp.asarray(a) for a in _candidate_pairs(budget, k))
    positions = jnp.arange(budget, dtype=jnp.int32)

    # Each level l holds `budget` entries in key order: logw, rank, parent (position in level l - 1),
    # lexrank (position in the level's lexicographic order) and lex_order (its inverse permutation).
    pad = budget - k
    logw = jnp.concatenate([lp[0], jnp.full((pad,), -jnp.inf, jnp.float32)]) + 0.0
    rank = jnp.concatenate([jnp.arange(k, dtype=jnp.int32), jnp.zeros((pad,), jnp.int32)])
    parent = jnp.zeros((budget,), jnp.int32)
    levels = [(logw, rank, parent, positions, positions)]  # level 1: lex order = rank order

    for level in range(1, depth_limit):
        prev_logw, _, _, prev_lexrank, _ = levels[-1]
        parent_logw = prev_logw[pair_parent]
        cand_logw = jnp.where(jnp.isfinite(parent_logw), parent_logw + lp[level, pair_rank], -jnp.inf)
        cand_lex = prev_lexrank[pair_parent] * k + pair_rank  # (parent lexrank, rank): distinct
        key_sorted, lex_sorted, parent_sorted, rank_sorted = lax.sort(
            (_sort_key(cand_logw), cand_lex, pair_parent, pair_rank), num_keys=2
        )
        logw = -key_sorted[:budget] + 0.0  # the exact candidate sums, no recomputation
        lex_key = lex_sorted[:budget]
        lex_order = jnp.argsort(lex_key).astype(jnp.int32)
        lexrank = jnp.zeros((budget,), jnp.int32).at[lex_order].set(positions)
        # materialise each level: keeps XLA from re-deriving (and duplicating) earlier levels
        levels.append(
            lax.optimization_barrier((logw, rank_sorted[:budget], parent_sorted[:budget], lexrank, lex_order))
        )

    # Global lexicographic (DFS preorder) index of every entry, from subtree sizes: an entry's
    # preorder = its parent's + 1 + the sizes of the siblings before it (siblings are contiguous in
    # the level's lex order, by rank).
    num_levels = len(levels)
    sizes = [None] * num_levels
    sizes[-1] = jnp.ones((budget,), jnp.int32)
    for level in range(num_levels - 2, -1, -1):
        child_parent = levels[level + 1][2]
        sizes[level] = 1 + jax.ops.segment_sum(sizes[level + 1], child_parent, num_segments=budget)
    preorder = [_exclusive_cumsum(sizes[0])]  # level 1 in lex (= rank) order, root excluded
    for level in range(1, num_levels):
        _, _, parent, _, lex_order = levels[level]
        size_lex = sizes[level][lex_order]
        parent_lex = parent[lex_order]
        before = _exclusive_cumsum(size_lex)
        first = jnp.concatenate([jnp.ones((1,), bool), parent_lex[1:] != parent_lex[:-1]])
        group_base = lax.cummax(jnp.where(first, before, 0))
        pre_lex = preorder[level - 1][parent_lex] + 1 + before - group_base
        preorder.append(jnp.zeros((budget,), jnp.int32).at[lex_order].set(pre_lex))

    # Lay the pool out in preorder: lax.top_k's lower-index-first tie-break is then the ranks-tuple
    # tie-break of the heap, and top_k returns the `budget` best keys in pop order.
    pool_logw = jnp.concatenate([lv[0] for lv in levels])
    pool_pre = jnp.concatenate(preorder)
    pool_size = pool_logw.shape[0]
    by_pre_logw = jnp.full((pool_size,), -jnp.inf, jnp.float32).at[pool_pre].set(pool_logw)
    by_pre_pool = jnp.zeros((pool_size,), jnp.int32).at[pool_pre].set(jnp.arange(pool_size, dtype=jnp.int32))
    slot_logw, chosen_pre = lax.top_k(by_pre_logw, budget)  # -inf entries (padding) come last
    chosen = by_pre_pool[chosen_pre]  # pool index (= level * budget + position) of slots 1..budget
    slot_level = chosen // budget
    slot_rank = jnp.concatenate([lv[1] for lv in levels])[chosen]
    parent_pool = jnp.concatenate([lv[2] + (lvl - 1) * budget for lvl, lv in enumerate(levels)])[chosen]
    slot_of_pool = jnp.zeros((pool_size,), jnp.int32).at[chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    slot_parent = jnp.where(slot_level > 0, slot_of_pool[jnp.maximum(parent_pool, 0)], 0)
    return slot_level, slot_rank, slot_parent, slot_logw


@functools.partial(jax.jit, static_argnames=("budget", "topk_impl"))
def build_tree_unchecked(draft_logits, root_tokens, *, budget: int, topk_impl: str) -> DraftTree:
    """`build_tree` without its eager input checks: the jitted builder itself (draft_logits [B, L, V],
    root_tokens int32 [B], static budget and topk_impl in BUILD_TOPK_IMPLS) -> DraftTree [B, budget + 1].
    A row with NaN/+inf logits gets a root-only tree; -inf entries never enter the tree, and a depth whose
    entries are all -inf has no candidates (the row's tree stops above it)."""
    batch, depth_limit, vocab = draft_logits.shape
    k = min(budget, vocab)
    row_finite = ~_invalid_entries(draft_logits).any(axis=(1, 2))
    draft_logits, dead = _mask_dead_depths(draft_logits)
    if topk_impl == "vocab_parallel":  # the vocabulary split over the mesh's "model" axis (LM head under TP)
        lp, ids = sharded_top_k_log_probs(draft_logits, k)
    else:
        lp, ids = top_k_log_probs(draft_logits, k, impl=topk_impl)  # [B, L, K] f32, int32
    # -inf log-probs (masked tokens, dead depths) only ever give -inf log-weights: padding, never real
    lp = jnp.where(dead[..., None], -jnp.inf, lp)
    level, rank, parent, logw = jax.vmap(functools.partial(_build_row, budget=budget))(lp)

    # A row with NaN/+inf logits gets a root-only tree (documented; the eager path raises instead).
    real = jnp.isfinite(logw) & row_finite[:, None]  # [B, budget]
    token = jnp.take_along_axis(ids.reshape(batch, depth_limit * k), level * k + rank, axis=1)

    def with_root(root_value, slots, pad_value):
        slots = jnp.where(real, slots, pad_value)
        return jnp.concatenate([jnp.broadcast_to(root_value, (batch, 1)).astype(slots.dtype), slots], axis=1)

    return DraftTree(
        tokens=with_root(root_tokens[:, None], token, PAD_TOKEN),
        parents=with_root(PAD_PARENT, parent, PAD_PARENT),
        depths=with_root(0, level + 1, PAD_DEPTH),
        ranks=with_root(-1, rank, PAD_RANK),
        logw=with_root(0.0, logw, -jnp.inf),
        num_nodes=1 + real.sum(axis=1, dtype=jnp.int32),
        max_depth=depth_limit,
    )


def build_tree(
    draft_logits: jax.Array,
    budget: int,
    root_tokens: jax.Array | None = None,
    *,
    topk_impl: str = "auto",
    check_finite: bool = True,
) -> DraftTree:
    """Builds the DDTree draft tree of N = budget + 1 slots for each row.

    Args:
      draft_logits: float32 or bfloat16 [B, L, V], the drafter's logits for depths 1..L (no temperature).
      budget: static number of draft nodes (root not counted), >= 1; any V and L are allowed
        (fewer reachable nodes than `budget` leave padding slots).
      root_tokens: int32 [B] tokens for slot 0 (the bonus tokens), or None for 0.
      topk_impl: per-depth top-K selection: one of `dispatch.TOPK_IMPLS`, or
        "vocab_parallel" for logits whose vocabulary is split over the "model" axis of the mesh set with
        `jax.set_mesh` (`tree.vocab_parallel`: local top-K and a K-candidate gather instead of
        gathering the logits; 1.15-1.9x faster on 2 H200s, BENCHMARKS.md; without a mesh it is "xla").
      check_finite: when called eagerly, raise ValueError on NaN/+inf logits (costs one host sync).
        Under an outer jit the check cannot raise; such a row yields a root-only tree. -inf logits are
        valid (probability 0): those tokens never enter the tree, and a depth whose logits are all -inf
        has no candidates, so the tree stops above it.

    Returns:
      DraftTree with tokens/parents/depths/ranks int32 [B, N], logw float32 [B, N], num_nodes int32 [B].
    """
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
    return build_tree_unchecked(draft_logits, root_tokens, budget=int(budget), topk_impl=topk_impl)


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
