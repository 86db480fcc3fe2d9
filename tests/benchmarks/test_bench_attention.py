"""benchmarks/bench_attention.py's bookkeeping: the FLOP and byte counts behind its roofline column, the
random tree masks it times, and its kernel-vs-XLA error check on a small case (interpret mode)."""

import jax
import numpy as np

from benchmarks import bench_attention as bench


def test_counts_are_the_stated_formulas():
    # absorbed MLA, 64 heads: scores over 576 dims + values over 512 per (query, head, key); one latent + rope key
    flops, nbytes = bench.counts("mla64", batch=1, steps=17, context=32768)
    keys = 32768 + 17
    assert flops == 17 * 64 * keys * 2 * (576 + 512)
    assert nbytes == keys * 2 * 576 + 17 * 64 * 2 * (576 + 512)
    # GQA (Qwen3-8B): 8 KV heads x (K + V) x 128 dims of bf16 per key
    flops, nbytes = bench.counts("gqa", batch=8, steps=9, context=1024)
    keys = 1024 + 9
    assert flops == 8 * 9 * 32 * keys * 2 * (128 + 128)
    assert nbytes == 8 * keys * 8 * 2 * 256 + 8 * 9 * 32 * 2 * 256


def test_random_tree_masks_are_trees_over_a_visible_prefix():
    mask = bench.random_tree_mask(np.random.default_rng(0), batch=3, steps=17, context=40)
    assert mask.shape == (3, 17, 57) and mask[:, :, :40].all()
    tree = mask[:, :, 40:]
    assert all(tree[b, i, i] for b in range(3) for i in range(17))  # each slot sees itself
    assert not np.triu(tree, 1).any()  # and only earlier slots (its ancestors)
    assert tree[:, :, 0].all()  # everyone descends from the root
    for b in range(3):
        for i in range(1, 17):
            parent = max(j for j in range(i) if tree[b, i, j])
            assert (tree[b, i, :i] == tree[b, parent, :i]).all()  # ancestors = the parent's ancestors + parent


def test_the_error_check_compares_the_kernel_with_xla():
    inputs = bench.case_inputs("mla8", batch=1, steps=9, context=48, copies=2, key=jax.random.key(0))
    assert 0 < bench.relative_error(*inputs) < 2e-2  # bf16; exactly 0 would mean the two paths were not both run
