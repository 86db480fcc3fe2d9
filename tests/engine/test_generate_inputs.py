"""`generate`'s eager input checks: raised before anything is compiled, skipped for abstract inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine.generate import check_generate_inputs, generate, generate_recorded
from ddtree_jax.sampling import SamplingParams, row_keys
from tests.engine.test_generate import DFLASH, T_PARAMS, TARGET, V


def _args(prompts, lengths, max_new):
    batch = prompts.shape[0]
    return (
        TARGET,
        T_PARAMS,
        DFLASH,
        jnp.asarray(prompts, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        SamplingParams.create(batch, temperature=0.0),
        row_keys(jax.random.key(0), jnp.arange(batch)),
        jnp.full((batch, 1), -1, jnp.int32),
        jnp.asarray(max_new, jnp.int32),
    )


GOOD = np.array([[1, 2, 3, 0], [4, 5, 6, 7]])
STATIC = dict(max_new_tokens=6, method="ddtree", budget=4, block_size=5)


@pytest.mark.parametrize(
    "prompts, lengths, max_new, message",
    [
        (GOOD, [3, 4], [6, 9], r"max_new\[1\] = 9 exceeds max_new_tokens = 6"),
        (GOOD, [3, 4], [0, 6], r"max_new\[0\] = 0 must be >= 1"),
        (GOOD, [3, 4], [6, -3], r"max_new\[1\] = -3 must be >= 1"),
        (GOOD, [0, 4], [6, 6], r"prompt_lengths\[0\] = 0 is outside \[1, T = 4\]"),
        (GOOD, [3, -2], [6, 6], r"prompt_lengths\[1\] = -2"),
        (GOOD, [3, 5], [6, 6], r"prompt_lengths\[1\] = 5"),
        (np.array([[1, 2, V, 0], [4, 5, 6, 7]]), [3, 4], [6, 6], rf"prompts\[0, 2\] = {V} is outside the vocabulary"),
        (np.array([[1, 2, 3, 0], [4, -1, 6, 7]]), [3, 4], [6, 6], r"prompts\[1, 1\] = -1"),
    ],
)
def test_bad_inputs_raise_eagerly(prompts, lengths, max_new, message):
    args = _args(prompts, lengths, max_new)
    with pytest.raises(ValueError, match=message):
        generate(*args, **STATIC)
    with pytest.raises(ValueError, match=message):
        generate.lower(*args, **STATIC)
    with pytest.raises(ValueError, match=message):
        generate_recorded(*args, recorder=_recorder, **STATIC)


def _recorder(trace, sampling):
    return {}


def test_padding_ids_are_not_checked_and_abstract_inputs_skip_the_checks():
    prompts = np.array([[1, 2, 3, 10**6], [4, 5, 6, 7]])  # the padding position of row 0 is not read
    check_generate_inputs(TARGET, prompts, np.array([3, 4]), np.array([6, 6]), max_new_tokens=6)
    abstract = jax.ShapeDtypeStruct((2,), jnp.int32)
    check_generate_inputs(TARGET, abstract, abstract, abstract, max_new_tokens=6)
    # a traced call (an outer jit) is not checked: it only traces
    args = _args(GOOD, [3, 4], [6, 6])
    jax.eval_shape(lambda p: generate(*args[:3], p, *args[4:], **STATIC), args[3])
    assert callable(generate.lower) and generate.__name__ == "generate"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(block_size=0), r"block_size must be in \[2, 5\]"),
        (dict(block_size=6), r"block_size must be in \[2, 5\]"),
        (dict(budget=0), r"budget must be in \[1, 1024\], got 0"),
        (dict(method="beam"), "method must be one of"),
        (dict(drafter=None), "method 'ddtree' needs a drafter"),
        (dict(drafter=None, method="chain"), "method 'chain' needs a drafter"),
    ],
)
def test_bad_statics_raise_before_tracing(change, message):
    """The method, budget, block size and drafter (`options.check_options`): block_size 0 used to fail deep in the
    while_loop with a carry-type error, a missing drafter with an AttributeError."""
    args = list(_args(GOOD, [3, 4], [6, 6]))
    if "drafter" in change:
        args[2] = change.pop("drafter")
    with pytest.raises(ValueError, match=message):
        generate(*args, **{**STATIC, **change})
    with pytest.raises(ValueError, match=message):
        generate_recorded(*args, recorder=_recorder, **{**STATIC, **change})


def test_bad_rows_under_an_outer_jit_are_invalid_rows():
    """Under an outer jit the checks cannot read the inputs: each row they would refuse (prompt length 0, a prompt
    id outside the vocabulary, max_new 0 or above max_new_tokens) generates INVALID_TOKEN only, and the good row
    is unchanged."""
    from ddtree_jax.sampling import INVALID_TOKEN

    prompts = np.array([[1, 2, 3, 0]] * 5)
    good = (prompts, [3] * 5, [4] * 5)
    bad_prompts = prompts.copy()
    bad_prompts[2, 1] = V
    bad = (bad_prompts, [3, 0, 3, 3, 3], [4, 4, 4, 9, 0])
    static = dict(max_new_tokens=4, method="ar", budget=1, block_size=2)
    run = jax.jit(lambda p, lengths, m: generate(*_args(p, lengths, m), **static).tokens)
    got, want = (np.asarray(run(*(jnp.asarray(a, jnp.int32) for a in case))) for case in (bad, good))
    assert (got[1:] == INVALID_TOKEN).all() and (want[1:] != INVALID_TOKEN).any(axis=1).all()
    np.testing.assert_array_equal(got[0], want[0])


def test_seeds_outside_32_bits_are_refused():
    from ddtree_jax.engine.run import check_seed, random_tiny_pair, request_args

    assert check_seed(2**32 - 1) == 2**32 - 1
    for bad in (-1, 2**32, 2**32 + 1, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer in"):
            check_seed(bad)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        request_args(random_tiny_pair(0), [[1, 2]], temperature=0.0, seed=2**32 + 1, max_new_tokens=4)


def test_the_host_loop_checks_its_inputs_as_generate_does():
    from ddtree_jax.engine.host_loop import generate_host_loop
    from ddtree_jax.engine.run import random_tiny_pair, request_args

    args = request_args(random_tiny_pair(0), [[1, 2, 3]], temperature=0.0, max_new_tokens=4)
    too_many = args[:-1] + (jnp.full((1,), 9, jnp.int32),)
    with pytest.raises(ValueError, match="max_new"):
        generate_host_loop(*too_many, max_new_tokens=4, method="ar", budget=1, block_size=2)


def test_a_generation_that_cannot_fit_the_device_is_refused_before_it_runs():
    """engine.run.check_fits: the compiled program's temporary + output bytes (`memory_analysis`) against the
    device's free memory; a real compiled generation of the test pair, checked against 1 kB and 1 TB."""
    from ddtree_jax.engine.run import check_fits

    batch, width = 2, 6
    compiled = generate.lower(
        TARGET,
        T_PARAMS,
        None,
        jnp.zeros((batch, width), jnp.int32),
        jnp.full((batch,), width, jnp.int32),
        SamplingParams.create(batch, temperature=0.0),
        row_keys(jax.random.key(0), jnp.arange(batch)),
        jnp.full((batch, 1), -1, jnp.int32),
        jnp.full((batch,), 4, jnp.int32),
        max_new_tokens=4,
        method="ar",
    ).compile()
    static = dict(max_new_tokens=4, method="ar")
    check_fits(compiled, prompt_tokens=width, batch=batch, static=static, free_bytes=10**12)
    with pytest.raises(ValueError, match=r"2 row\(s\) x 6 prompt tokens \+ max_new_tokens 4, ar\) needs .* GB .* free"):
        check_fits(compiled, prompt_tokens=width, batch=batch, static=static, free_bytes=1000)


def test_a_target_that_taps_other_layers_than_the_drafter_reads_is_named():
    """`load_hf` gives a target config without taps; only `load_pair` set them to the drafter's. Another count
    failed deep in the drafter's projection (an einsum label error), another set of the same count ran on the wrong
    features. Both generate and the host loop name the two tuples now."""
    import dataclasses

    from ddtree_jax.engine.host_loop import generate_host_loop

    assert TARGET.tapped_layers == DFLASH.config.target_layers
    for taps in ((), tuple(reversed(TARGET.tapped_layers)) if len(TARGET.tapped_layers) > 1 else (9,)):
        if taps and max(taps) >= TARGET.num_layers:
            continue
        other = dataclasses.replace(TARGET, tapped_layers=taps)
        args = (other,) + _args(GOOD, [3, 4], [6, 6])[1:]
        for run in (generate, generate_host_loop):
            with pytest.raises(ValueError, match=r"the target taps layers .* but the drafter reads target layers"):
                run(*args, **STATIC)
