"""Draft trees: the best-first DDTree builder (jit and reference), path-conditioned trees (`conditional`), the
DFlash chain, derived structures."""

from ddtree_jax.tree.build import build_chain, build_tree
from ddtree_jax.tree.conditional import (
    ChildLogitsFn,
    ConditionalReferenceTree,
    build_conditional_tree,
    build_conditional_tree_reference,
    table_child_logits,
)
from ddtree_jax.tree.draft_tree import DraftTree
from ddtree_jax.tree.reference import ReferenceTree, build_tree_reference
from ddtree_jax.tree.select import top_k_log_probs
from ddtree_jax.tree.structure import ORDER_POLICIES, ancestor_mask, positions, verification_order
from ddtree_jax.tree.vocab_parallel import VOCAB_TOPK_IMPLS, sharded_top_k_log_probs

__all__ = [
    "DraftTree",
    "ReferenceTree",
    "build_tree",
    "build_chain",
    "build_tree_reference",
    "build_conditional_tree",
    "build_conditional_tree_reference",
    "ConditionalReferenceTree",
    "ChildLogitsFn",
    "table_child_logits",
    "top_k_log_probs",
    "positions",
    "ancestor_mask",
    "verification_order",
    "ORDER_POLICIES",
    "VOCAB_TOPK_IMPLS",
    "sharded_top_k_log_probs",
]
