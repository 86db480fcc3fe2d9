"""engine/host_loop.py: the host-driven step loop emits exactly `generate`'s tokens and counts (same keys,
same steps; steps queued after every row is done change nothing), for DDTree and AR, several sync
intervals, ragged prompts, a stop token and per-row max_new; bad sync_every is an error naming it."""

import numpy as np
import pytest

from ddtree_jax.engine.generate import generate
from ddtree_jax.engine.host_loop import generate_host_loop
from ddtree_jax.engine.run import random_tiny_pair, request_args


@pytest.fixture(scope="module")
def args():
    pair = random_tiny_pair(3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, n).tolist() for n in (9, 4, 13)]
    return request_args(pair, prompts, temperature=1.0, top_p=0.9, seed=7, stop_tokens=(17,), max_new_tokens=24)


@pytest.mark.parametrize("method,sync_every", [("ddtree", 1), ("ddtree", 5), ("ar", 3)])
def test_host_loop_equals_the_while_loop(args, method, sync_every):
    options = dict(max_new_tokens=24, method=method, budget=12, block_size=8)
    want = generate(*args, **options)
    got = generate_host_loop(*args, **options, sync_every=sync_every)
    for field in ("tokens", "num_generated", "steps", "accepted"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)
    assert int(np.asarray(want.num_generated).min()) >= 1


def test_bad_sync_every_names_the_value(args):
    with pytest.raises(ValueError, match="sync_every.*0"):
        generate_host_loop(*args, max_new_tokens=24, sync_every=0)
