"""ddtree_kernels stands alone: imported with only the kernels/ folder on the path (no repository root,
so no ddtree_jax), it loads no ddtree_jax module, and each kernel matches its reference twin there."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import ddtree_kernels
    from ddtree_kernels import decode_matmul, quant, tree_attention, tree_sampling
    assert not any(name == "ddtree_jax" or name.startswith("ddtree_jax.") for name in sys.modules), "ddtree_jax imported"
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    w = quant.quantize_int4(rng.standard_normal((96, 256)).astype(np.float32) * 0.1)
    got, ref = decode_matmul.matmul(x, w), decode_matmul.matmul_reference(x, w)
    assert float(jnp.abs(got - ref).max() / jnp.abs(ref).max()) < 1e-5
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 3, 40)) < 0.7)
    got = tree_attention.tree_attention((q,), (k,), v, mask)
    ref = tree_attention.tree_attention_reference((q,), (k,), v, mask)
    assert float(jnp.abs(got - ref).max()) < 1e-4
    cand = jnp.asarray([[0, 3, 5, 7]], jnp.int32)
    nxt = jnp.asarray([[1, 3, -1, -1]], jnp.int32)
    sib = jnp.asarray([[-1, 2, -1, -1]], jnp.int32)
    logits = jnp.asarray(rng.standard_normal((1, 4, 300)) * 2, jnp.float32)
    rows = jnp.asarray([[1.0, 0.0, 0.9, 0.0]], jnp.float32)
    coins = jnp.asarray(rng.random((1, 4)), jnp.float32)
    final = jnp.asarray(rng.random(1), jnp.float32)
    got = tree_sampling.tree_sampling_from_logits(cand, nxt, sib, logits, rows, coins, final, max_accept=2)
    ref = tree_sampling.tree_sampling_from_logits_reference(cand, nxt, sib, logits, rows, coins, final, max_accept=2)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("standalone ok")
""")


def test_the_kernel_package_imports_and_runs_without_the_library():
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "kernels"), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=os.path.join(REPO, "kernels"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "standalone ok" in done.stdout
