"""The drafter's per-depth top-K over a vocabulary split across "model" (tree/vocab_parallel.py) equals the
unsharded selection: same ids (ties included), values within float32 rounding, on 8 fake CPU devices
(skipped where fewer devices exist, e.g. one GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sharding.mesh import make_mesh
from ddtree_jax.tree.select import top_k_log_probs
from ddtree_jax.tree.vocab_parallel import sharded_top_k_log_probs

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (CPU: the 8 fake devices of tests/conftest.py)"
)


def _logits(seed, shape, dtype=jnp.float32, ties=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    if ties:  # coarse values: many exact ties, across shard boundaries too
        x = np.round(x)
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("impl", ["vocab_parallel", "gathered"])
@pytest.mark.parametrize("model,data", [(4, 2), (8, 1), (2, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_equals_the_unsharded_selection(impl, model, data, ties):
    mesh = make_mesh(model=model, data=data)
    logits = _logits(model * 10 + ties, (4, 15, 1024), ties=ties)  # [B, L, V]
    want_values, want_ids = top_k_log_probs(logits, 16, impl="xla")
    with jax.set_mesh(mesh):
        values, ids = jax.jit(lambda x: sharded_top_k_log_probs(x, 16, impl=impl))(logits)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(values), np.asarray(want_values), rtol=0, atol=2e-6)


def test_bf16_logits_and_no_mesh():
    logits = _logits(3, (2, 7, 512), jnp.bfloat16)
    want = top_k_log_probs(logits, 8, impl="xla")
    got = sharded_top_k_log_probs(logits, 8)  # no mesh set: the unsharded selection itself
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    with jax.set_mesh(make_mesh(model=8, data=1)):
        values, ids = sharded_top_k_log_probs(logits, 8)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(values), np.asarray(want[0]), atol=2e-6)


def test_bad_requests_are_named():
    with jax.set_mesh(make_mesh(model=8, data=1)):
        with pytest.raises(ValueError, match="does not divide"):
            sharded_top_k_log_probs(jnp.zeros((1, 2, 100)), 4)
        with pytest.raises(ValueError, match=r"k must be in \[1, V / P = 8\]"):
            sharded_top_k_log_probs(jnp.zeros((1, 2, 64)), 9)
        with pytest.raises(ValueError, match="vocab top-k impl"):
            sharded_top_k_log_probs(jnp.zeros((1, 2, 64)), 4, impl="allreduce")


def test_build_tree_with_the_vocab_parallel_top_k():
    """build_tree(topk_impl="vocab_parallel") under a 4 x 2 mesh builds the unsharded tree (same tokens,
    parents, depths; log-weights within float32 rounding); a bad topk_impl names itself."""
    from ddtree_jax.tree import build_tree

    logits = _logits(21, (4, 7, 1024))
    roots = jnp.arange(4, dtype=jnp.int32)
    want = build_tree(logits, 24, roots)
    with jax.set_mesh(make_mesh(model=4, data=2)):
        got = build_tree(logits, 24, roots, topk_impl="vocab_parallel")
    for field in ("tokens", "parents", "depths", "ranks", "num_nodes"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)
    np.testing.assert_allclose(np.asarray(got.logw), np.asarray(want.logw), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="'sharded'"):
        build_tree(logits, 24, roots, topk_impl="sharded")
