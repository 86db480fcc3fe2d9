"""Path-conditioned draft trees: the best-first heap over per-node child distributions (issue #23).

DDTree's tree comes from the drafter's per-depth marginals: every node at depth d gets its children from the
same depth-(d + 1) distribution. A path-conditioned drafter (e.g. a small head over the drafter's depth-d
state and the parent's token) gives each node its own child distribution: q(. | depth, parent token). The
best-first tree generalises directly: a node's log-weight is the sum of its path's log-probabilities, each
under its parent's distribution, and the tree of budget B is the B best prefixes by the key (-logw, ranks
tuple), the ranks being positions in each parent's own top-K (K = min(B, V), ties: lower token id first).
The marginal tree is the case where the distribution ignores the parent (`build_conditional_tree_reference`
then equals `tree.reference.build_tree_reference` node for node; a test checks it).

  build_conditional_tree_reference   the heap, literally (numpy + heapq; one child distribution per
                                     (depth, parent token), computed when first needed): the oracle.
  build_conditional_tree             the jit builder at a fixed budget, level by level: each level keeps the
                                     B best entries of its candidates (the kept parents x their own top-K),
                                     evaluates the child distribution for those B parents at once, and one
                                     preorder top-K over the levels (`ddtree_kernels.tree_build.
                                     preorder_select`, the marginal builder's) gives the tree in pop order.

Why level by level is exact: log-probabilities are <= 0, so a node's key is larger (worse) than its parent's
and than its previous sibling's; the B best prefixes are therefore closed under parents, at most B of them lie
at any depth, and each is among the B best candidates of its depth. Unlike the marginal builder, no pair (i, r)
of a parent position and a child rank can be pruned by i (a later parent's distribution may be sharper), so
each level ranks all B x K candidates (one top-K: laid out in lexicographic order, ties to the lower index
give the key order).

Verification is unchanged: a `DraftTree` is a `DraftTree`, and target-only tree rejection sampling is exact
for any tree (tests/verify/test_law.py runs the law tests on conditional trees too).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax import dispatch
from ddtree_jax.tree.build import (
    _check_finite,
    _check_root_tokens,
    check_budget,
    kernel_top_k_logits,
    kernel_top_k_logits_fits,
)
from ddtree_jax.tree.draft_tree import PAD_DEPTH, PAD_PARENT, PAD_RANK, PAD_TOKEN, DraftTree
from ddtree_jax.tree.reference import log_softmax_f32, top_k_ranked
from ddtree_kernels import tree_build
from ddtree_kernels.tree_build import preorder_select

#: (inputs, parent_depth, parent_tokens int32 [B, P]) -> child logits float [B, P, V]: the distribution of the
#: children (at depth parent_depth + 1) of P parents per row at depth parent_depth (1 .. L - 1). `inputs` is
#: any pytree the function reads (e.g. a head's parameters and the drafter's per-depth states); the function
#: itself is a static argument of the jitted builder (hashable: a module-level function or a partial of one).
ChildLogitsFn = Callable[[Any, int, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ConditionalReferenceTree:
    """One row's path-conditioned tree, unpadded: arrays of length num_nodes (slot 0 = root).

    Attributes:
      tokens, parents, depths, ranks: int64 [num_nodes] (rank: position in the parent's own top-K)
      logw: float32 [num_nodes]
      paths: the ranks tuple of each node (root = ())
      frontier_logw: float32, the best log-weight left in the heap when the budget ran out (-inf if it emptied)
      child_lists: {(parent depth, parent token): (log-probs f32 [K], token ids int64 [K])}, every child
        distribution the heap read, in rank order (the root's under (0, root token))
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    logw: np.ndarray
    paths: tuple
    frontier_logw: np.float32
    child_lists: dict

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def has_near_tie(self, tol: float = 1e-5) -> bool:
        """True when two consecutive keys of the pop order (or the cut) lie within `tol`, or two different
        log-probabilities of one child list do among the ranks the tree reached (up to one past the deepest
        rank it took from that list): where a builder that rounds differently may swap two nodes."""
        ext = np.concatenate([self.logw[1:], [self.frontier_logw]]).astype(np.float64)
        gaps = -np.diff(ext[np.isfinite(ext)])
        if (gaps < tol).any():
            return True
        reached: dict[tuple[int, int], int] = {}
        for node in range(1, self.num_nodes):
            parent = self.parents[node]
            key = (int(self.depths[parent]), int(self.tokens[parent]))
            reached[key] = max(reached.get(key, 0), int(self.ranks[node]) + 2)
        for key, count in reached.items():
            rank_gaps = -np.diff(self.child_lists[key][0][:count].astype(np.float64))
            if ((rank_gaps > 0) & (rank_gaps < tol)).any():
                return True
        return False


def _check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")


def _check_depth_limit(depth_limit) -> None:
    if isinstance(depth_limit, bool) or not isinstance(depth_limit, (int, np.integer)) or depth_limit < 1:
        raise ValueError(f"depth_limit must be an integer >= 1, got {depth_limit!r}")


def _checked_logits(logits, vocab: int | None, what: str) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty [V] vector, got shape {x.shape}")
    if vocab is not None and x.shape[0] != vocab:
        raise ValueError(f"{what} has {x.shape[0]} entries, the first depth's logits {vocab}")
    x32 = x.astype(np.float32)
    if (np.isnan(x32) | (x32 == np.inf)).any():
        raise ValueError(f"{what} contain NaN/+inf (first at token {int(np.argmax(np.isnan(x32) | (x32 == np.inf)))})")
    return x32


def build_conditional_tree_reference(
    first_logits,
    child_logits: Callable[[int, int], np.ndarray],
    budget: int,
    depth_limit: int,
    root_token: int | None = None,
) -> ConditionalReferenceTree:
    """The best-first heap over per-node child distributions (one row).

    Args:
      first_logits: float [V], the root's children's logits (depth 1).
      child_logits: (parent_depth, parent_token) -> float [V], the logits of the children (at depth
        parent_depth + 1) of a node at parent_depth (1 .. depth_limit - 1) holding parent_token.
      budget: number of draft nodes (the root is not counted), >= 1.
      depth_limit: L, the deepest depth, >= 1.
      root_token: token of node 0 (0 if None).
    Raises:
      ValueError naming the bad value (shapes, budget, depth_limit, NaN/+inf logits; -inf is a valid logit).
    """
    _check_budget(budget)
    _check_depth_limit(depth_limit)
    root = root_token or 0
    first = _checked_logits(first_logits, None, "first_logits")
    vocab = first.shape[0]
    k = min(budget, vocab)
    lists: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def child_list(depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        if (depth, token) not in lists:
            x = (
                first
                if depth == 0
                else _checked_logits(child_logits(depth, token), vocab, f"child_logits({depth}, {token})")
            )
            lp, ids = top_k_ranked(log_softmax_f32(x[None]), k)
            lists[(depth, token)] = (lp[0], ids[0])
        return lists[(depth, token)]

    # Heap entries: (-logw, ranks tuple, parent node, depth, rank); a ranks tuple that is a prefix of another
    # compares smaller. A token of log-prob -inf is never pushed (lists are descending: none follow it).
    tokens, parents, depths, ranks, paths, logw_of = [root], [-1], [0], [-1], [()], [np.float32(0.0)]
    lp0, _ = child_list(0, root)
    heap = [(-lp0[0], (0,), 0, 1, 0)] if np.isfinite(lp0[0]) else []
    while heap and len(tokens) - 1 < budget:
        neg_logw, path, parent, depth, rank = heapq.heappop(heap)
        parent_lp, parent_ids = child_list(depths[parent], tokens[parent])
        node = len(tokens)
        tokens.append(int(parent_ids[rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        paths.append(path)
        logw_of.append(np.float32(-neg_logw))
        if rank + 1 < k and np.isfinite(parent_lp[rank + 1]):  # next sibling, under the same parent's list
            sibling = np.float32(logw_of[parent] + parent_lp[rank + 1])
            heapq.heappush(heap, (-sibling, path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < depth_limit:  # first child, under this node's own list
            own_lp, _ = child_list(depth, tokens[node])
            if np.isfinite(own_lp[0]):
                child = np.float32(logw_of[node] + own_lp[0])
                heapq.heappush(heap, (-child, path + (0,), node, depth + 1, 0))
    frontier = np.float32(-heap[0][0]) if heap else np.float32(-np.inf)
    return ConditionalReferenceTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        ranks=np.array(ranks, dtype=np.int64),
        logw=np.array(logw_of, dtype=np.float32),
        paths=tuple(paths),
        frontier_logw=frontier,
        child_lists=lists,
    )


def _top_k_lists(logits: jax.Array, k: int, impl: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probs f32 [B, P, k], ids int32 [B, P, k], invalid bool [B, P]) of logits [B, P, V]: the float32
    log-softmax's top-k (ties: lower id first), a distribution with no finite entry gives -inf log-probs,
    one with NaN/+inf is flagged invalid. impl "pallas": the marginal builder's top-K kernel (log-softmax, flags
    and top-K in one launch, `build.kernel_top_k_logits`) where it takes rows of V at this k; "xla": lax.top_k."""
    if impl == "pallas" and kernel_top_k_logits_fits(logits.shape[-1], k):
        lp, ids, flags = kernel_top_k_logits(logits, k)
        dead = (flags & tree_build.DEAD_DEPTH) != 0
        invalid = (flags & tree_build.INVALID_ROW) != 0
        return jnp.where(dead[..., None], -jnp.inf, lp), ids.astype(jnp.int32), invalid
    x = logits.astype(jnp.float32)
    invalid = (jnp.isnan(x) | (x == jnp.inf)).any(axis=-1)
    dead = (x == -jnp.inf).all(axis=-1)
    lp = jax.nn.log_softmax(jnp.where(dead[..., None], 0.0, x), axis=-1)
    lp, ids = lax.top_k(lp, k)
    return jnp.where(dead[..., None], -jnp.inf, lp), ids.astype(jnp.int32), invalid


def _next_level(prev_logw, prev_lex_order, child_lp, budget: int, impl: str):
    """The next level of every row: prev_logw [B, budget] (the kept parents, in key order), prev_lex_order
    [B, budget] (their positions in lexicographic order), child_lp [B, budget, K] (each parent's own top-K) ->
    the `budget` best children in key order (logw, rank, parent, lexrank, lex_order; each [B, budget]), the
    entries `preorder_select` reads.

    The key is (logw descending, lexicographic rank ascending). The candidates are laid out in lexicographic
    order, a child's flat index being its lexicographic rank (parent's lexrank x K + own rank), so one top-K
    whose ties go to the lower index (lax.top_k; the `tree_topk` kernel with impl "pallas") returns them in key
    order: no multi-key sort."""
    batch, _, k = child_lp.shape
    parent_logw = jnp.take_along_axis(prev_logw, prev_lex_order, axis=1)  # [B, budget] in lexicographic order
    lists = jnp.take_along_axis(child_lp, prev_lex_order[..., None], axis=1)
    cand_logw = jnp.where(jnp.isfinite(parent_logw)[..., None], parent_logw[..., None] + lists, -jnp.inf)
    # `+ 0.0`: -0.0 and +0.0 compare equal; -inf (padding) comes last, itself in lexicographic order
    cand_logw = cand_logw.reshape(batch, budget * k) + 0.0
    if impl == "pallas" and tree_build.fits_one_row(budget * k):
        logw, lex = tree_build.tree_topk(cand_logw, budget)
    else:
        logw, lex = lax.top_k(cand_logw, budget)
    lex = lex.astype(jnp.int32)
    parent = jnp.take_along_axis(prev_lex_order, lex // k, axis=1)
    lex_order = jnp.argsort(lex, axis=1).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(budget, dtype=jnp.int32), (batch, budget))
    lexrank = jnp.zeros((batch, budget), jnp.int32).at[jnp.arange(batch)[:, None], lex_order].set(positions)
    return logw, lex % k, parent, lexrank, lex_order


@functools.partial(jax.jit, static_argnames=("child_logits_fn", "budget", "depth_limit", "impl"))
def _build_conditional(
    first_logits, inputs, root_tokens, *, child_logits_fn, budget: int, depth_limit: int, impl: str = "xla"
):
    batch, vocab = first_logits.shape
    k = min(budget, vocab)
    positions = jnp.arange(budget, dtype=jnp.int32)
    lp, ids, invalid = (x[:, 0] for x in _top_k_lists(first_logits[:, None], k, impl))  # [B, K]
    pad = budget - k
    logw = jnp.concatenate([lp, jnp.full((batch, pad), -jnp.inf, jnp.float32)], axis=1) + 0.0
    rank = jnp.broadcast_to(jnp.concatenate([jnp.arange(k), jnp.zeros((pad,), int)]).astype(jnp.int32), (batch, budget))
    tokens = jnp.concatenate([ids, jnp.full((batch, pad), PAD_TOKEN, jnp.int32)], axis=1)
    first_level = (
        logw,
        rank,
        jnp.zeros((batch, budget), jnp.int32),
        *(jnp.broadcast_to(positions, (batch, budget)),) * 2,
    )
    levels, level_tokens = [first_level], [tokens]
    for parent_depth in range(1, depth_limit):
        prev_logw, _, _, _, prev_lex_order = levels[-1]
        child_logits = child_logits_fn(inputs, parent_depth, level_tokens[-1])  # [B, budget, V]
        child_lp, child_ids, child_invalid = _top_k_lists(child_logits, k, impl)
        # a NaN/+inf distribution of a real parent makes the row invalid (a padding parent's is never read)
        invalid = invalid | (child_invalid & jnp.isfinite(prev_logw)).any(axis=1)
        level = _next_level(prev_logw, prev_lex_order, child_lp, budget, impl)
        _, level_rank, level_parent, _, _ = level
        flat = level_parent * k + level_rank
        level_tokens.append(jnp.take_along_axis(child_ids.reshape(batch, budget * k), flat, axis=1))
        # materialise each level: keeps XLA from re-deriving (and duplicating) earlier levels
        levels.append(lax.optimization_barrier(level))
    per_row_levels = [tuple(jnp.asarray(a) for a in lv) for lv in levels]
    slot_level, slot_rank, slot_parent, slot_logw, chosen = jax.vmap(
        lambda lv: preorder_select(lv, budget), in_axes=(0,)
    )(per_row_levels)
    pool_tokens = jnp.concatenate(level_tokens, axis=1)  # [B, levels * budget]
    slot_token = jnp.take_along_axis(pool_tokens, chosen, axis=1)
    real = jnp.isfinite(slot_logw) & ~invalid[:, None]

    def with_root(root_value, values, pad_value):
        values = jnp.where(real, values, pad_value)
        return jnp.concatenate([jnp.broadcast_to(root_value, (batch, 1)).astype(values.dtype), values], axis=1)

    return DraftTree(
        tokens=with_root(root_tokens[:, None], slot_token, PAD_TOKEN),
        parents=with_root(PAD_PARENT, slot_parent, PAD_PARENT),
        depths=with_root(0, slot_level + 1, PAD_DEPTH),
        ranks=with_root(PAD_RANK, slot_rank, PAD_RANK),
        logw=with_root(0.0, slot_logw, -jnp.inf),
        num_nodes=1 + real.sum(axis=1, dtype=jnp.int32),
        max_depth=depth_limit,
    )


def build_conditional_tree(
    first_logits: jax.Array,
    child_logits_fn: ChildLogitsFn,
    inputs: Any,
    budget: int,
    depth_limit: int,
    root_tokens: jax.Array | None = None,
    impl: str = "auto",
) -> DraftTree:
    """The path-conditioned best-first tree of N = budget + 1 slots for each row, jit-compiled.

    Args:
      first_logits: float [B, V], the root's children's logits (depth 1).
      child_logits_fn: a `ChildLogitsFn` (static: one compilation per function): called once per depth
        1 .. depth_limit - 1 with the `budget` kept parents of that depth (padding parents hold token 0;
        their children are never real).
      inputs: the pytree the function reads (traced).
      budget: static number of draft nodes (root not counted): an int in [1, MAX_BUDGET = 1024], as in
        `build_tree` (ValueError otherwise, under jit too).
      depth_limit: static L, the deepest depth, >= 1.
      root_tokens: int32 [B] tokens for slot 0, or None for 0.
      impl: the two top-Ks of every level (each parent's child list, then the level's `budget` best
        candidates): "pallas" (the marginal builder's `tree_topk` kernels), "xla" (lax.top_k) or "auto"
        (`dispatch.tree_impl`: the kernels on GPU). The bookkeeping around them is XLA either way.
    Returns:
      DraftTree [B, budget + 1] in pop order (the heap's), as `build_tree` lays it out. A row whose first
      logits, or the child logits of one of its real parents, hold NaN/+inf gets a root-only tree (under jit
      nothing can raise: the row is marked by num_nodes = 1, never given plausible tokens); -inf logits are
      valid (never in the tree).
    """
    _check_budget(budget)
    _check_depth_limit(depth_limit)
    first_logits = jnp.asarray(first_logits)
    if first_logits.ndim != 2 or 0 in first_logits.shape:
        raise ValueError(f"first_logits must have shape [B, V] (non-empty), got shape {tuple(first_logits.shape)}")
    if not jnp.issubdtype(first_logits.dtype, jnp.floating):
        raise ValueError(f"first_logits must be a float array, got {first_logits.dtype}")
    check_budget(budget)  # an int in [1, MAX_BUDGET]
    batch = first_logits.shape[0]
    root_tokens = jnp.zeros((batch,), jnp.int32) if root_tokens is None else jnp.asarray(root_tokens, jnp.int32)
    if root_tokens.shape != (batch,):
        raise ValueError(f"root_tokens must have shape [B] = ({batch},), got {tuple(root_tokens.shape)}")
    # eagerly, as `build_tree` (skipped when traced: there such a row gets a root-only tree)
    _check_finite(first_logits[:, None, :])
    _check_root_tokens(root_tokens, first_logits.shape[1])
    return _build_conditional(
        first_logits,
        inputs,
        root_tokens,
        child_logits_fn=child_logits_fn,
        budget=int(budget),
        depth_limit=int(depth_limit),
        impl=dispatch.tree_impl(impl),
    )


def table_child_logits(table: jax.Array, parent_depth: int, parent_tokens: jax.Array) -> jax.Array:
    """A `ChildLogitsFn` over a table [L - 1, V, V] (or [L - 1, B, V, V] per row): the children of a node at
    parent_depth holding token t get table[parent_depth - 1, t] (row b: table[parent_depth - 1, b, t]). The
    conditional drafter of the tests and of `verify.markov.simulate(conditional=...)`."""
    level = table[parent_depth - 1]
    if level.ndim == 2:
        return level[parent_tokens]
    return jnp.take_along_axis(level, parent_tokens[..., None], axis=1)
