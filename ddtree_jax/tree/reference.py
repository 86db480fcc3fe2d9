"""The DDTree best-first heap, literally (docs/design.md, "Tree construction"): numpy + heapq, the test oracle.

It is deliberately literal (one node per heap pop) and slow; `build_tree` is the jit form.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class ReferenceTree:
    """One row's tree, unpadded: arrays of length num_nodes (slot 0 = root).

    Attributes:
      tokens, parents, depths, ranks: int64 [num_nodes]
      logw: float32 [num_nodes]
      paths: the ranks tuple of each node (root = ())
      frontier_logw: float32, the best log-weight left in the heap when the budget ran out
        (-inf if the heap emptied): the first node that did not make it, used by tests to tell
        whether the cut lies within float32 rounding of a near-tie.
      top_log_probs: float32 [L, K] the per-depth top-K log-probabilities (rank order).
      top_ids: int64 [L, K] the matching token ids.
      top_logits: float32 [L, K] their input logits: equal logits must follow the tie-break (lower id
        first) in any builder, while different logits whose float32 log-probabilities (nearly) tie may
        be ranked either way by a builder whose log-softmax rounds differently.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    logw: np.ndarray
    paths: tuple
    frontier_logw: np.float32
    top_log_probs: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


def log_softmax_f32(draft_logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, computed in float64 and rounded once to float32."""
    x = np.asarray(draft_logits).astype(np.float64)
    dead = (x == -np.inf).all(axis=-1, keepdims=True)  # no finite entry: every log-prob is -inf
    x = np.where(dead, 0.0, x)
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return np.where(dead, -np.inf, x - lse).astype(np.float32)


def top_k_ranked(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row top-k of float32 log-probabilities [L, V]; equal values: lower token id first."""
    num_rows, vocab = log_probs.shape
    ids = np.empty((num_rows, k), dtype=np.int64)
    for d in range(num_rows):
        order = np.lexsort((np.arange(vocab), -log_probs[d]))  # primary: -lp, secondary: id
        ids[d] = order[:k]
    return np.take_along_axis(log_probs, ids, axis=1), ids


def build_tree_reference(draft_logits, budget: int, root_token: int | None = None) -> ReferenceTree:
    """Best-first heap over the per-depth top-K of the drafter's marginals.

    Args:
      draft_logits: [L, V] float (any float dtype incl. bfloat16): the drafter's logits for depths 1..L.
      budget: number of draft nodes (the root is not counted), >= 1.
      root_token: token of node 0 (0 if None).
    """
    x = np.asarray(draft_logits)
    if x.ndim != 2:
        raise ValueError(f"draft_logits must have shape [L, V], got shape {x.shape}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    if 0 in x.shape:
        raise ValueError(f"draft_logits must be non-empty (L >= 1 depths, V >= 1 tokens), got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"):
        raise ValueError(f"draft_logits must be a float array, got {x.dtype}")
    x32 = x.astype(np.float32)
    if (np.isnan(x32) | (x32 == np.inf)).any():  # -inf is a valid logit: that token is never pushed
        bad = np.argwhere(np.isnan(x32) | (x32 == np.inf))[0]
        raise ValueError(f"draft_logits contain NaN/+inf (first at depth index {bad[0]}, token {bad[1]})")
    depth_limit, vocab = x.shape
    k = min(budget, vocab)
    lp, ids = top_k_ranked(log_softmax_f32(x), k)

    # Heap entries: (-logw, ranks tuple, parent node index, depth, rank). Python compares tuples
    # lexicographically, and a ranks tuple that is a prefix of another compares smaller.
    # Tokens of log-prob -inf (logit -inf) are never pushed; lp is descending, so none follow them.
    heap = [(-lp[0, 0], (0,), 0, 1, 0)] if np.isfinite(lp[0, 0]) else []
    logw_of = [np.float32(0.0)]
    tokens, parents, depths, ranks, paths = [root_token or 0], [-1], [0], [-1], [()]
    while heap and len(tokens) - 1 < budget:
        neg_logw, path, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        paths.append(path)
        logw_of.append(np.float32(-neg_logw))
        parent_logw = logw_of[parent]
        if rank + 1 < k and np.isfinite(
            lp[depth - 1, rank + 1]
        ):  # next sibling: the same parent's logw plus the next rank (a direct sum)
            sib = np.float32(parent_logw + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < depth_limit and np.isfinite(lp[depth, 0]):  # first child
            child = np.float32(logw_of[node] + lp[depth, 0])
            heapq.heappush(heap, (-child, path + (0,), node, depth + 1, 0))
    frontier = np.float32(-heap[0][0]) if heap else np.float32(-np.inf)
    return ReferenceTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        ranks=np.array(ranks, dtype=np.int64),
        logw=np.array(logw_of, dtype=np.float32),
        paths=tuple(paths),
        frontier_logw=frontier,
        top_log_probs=lp,
        top_ids=ids,
        top_logits=np.take_along_axis(x.astype(np.float32), ids, axis=1),
    )
