"""The engine: greedy DDTree / chain equal AR greedy, deep acceptance with an oracle drafter, stop tokens,
batch independence, and the exact output law at T = 1 against enumeration (chi-square, ALPHA = 1e-3)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine import DecodeOptions, DFlashDrafter, generate
from ddtree_jax.models import dflash, qwen3
from ddtree_jax.sampling import SamplingParams, row_keys
from tests.stats_helpers import ALPHA, chi_square_pvalue
from tests.tiny_models import DSV3_TWO_LAYER, QWEN3_TINY, tiny_drafter, yarn_drafter

V = 24
# the shared tiny Qwen3 (tests/tiny_models.py) with this file's vocabulary V and RoPE theta 10k
TARGET = dataclasses.replace(QWEN3_TINY, vocab_size=V, rope_theta=10_000.0)
DRAFTER = tiny_drafter(V - 1, (0, 1), 5, rope_theta=10_000.0)
T_PARAMS = qwen3.init_params(TARGET, jax.random.key(0), norm_jitter=0.1)
T_PARAMS = {**T_PARAMS, "lm_head": T_PARAMS["lm_head"] * 60.0}  # peaked next-token laws (logit std ~ 3)
DFLASH = DFlashDrafter(
    DRAFTER, dflash.init_params(DRAFTER, 32, jax.random.key(1)), qwen3.embedding(T_PARAMS), qwen3.head(TARGET, T_PARAMS)
)


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Drafts from a table of known continuations (position-indexed): the top-1 token at each depth is
    table[position], the second choice is `alt` (a branch the tree can also explore)."""

    table: jax.Array  # int32 [B, P]
    max_block_size: int = 5

    def init_state(self, batch, capacity, dtype=jnp.float32):
        return jnp.zeros((batch,), jnp.int32)  # the drafter's context length

    def append(self, state, features, count):
        return state + count

    def draft(self, state, bonus, block_size):
        positions = state[:, None] + 1 + jnp.arange(block_size - 1)[None, :]
        tokens = jnp.take_along_axis(self.table, jnp.minimum(positions, self.table.shape[1] - 1), axis=1)
        alt = (tokens * 7 + 3) % V
        return 6.0 * jax.nn.one_hot(tokens, V) + 3.0 * jax.nn.one_hot(alt, V)


jax.tree_util.register_dataclass(OracleDrafter, data_fields=["table"], meta_fields=["max_block_size"])


def _run(
    drafter, prompts, lengths, *, method, temperature=0.0, max_new=10, budget=8, stop=None, seed=3, recorder=None, **kw
):
    """generate on TARGET with `drafter` (block size 5); with `recorder`, generate_recorded: (result, records)."""
    from ddtree_jax.engine.generate import generate_recorded

    batch = prompts.shape[0]
    params = SamplingParams.create(batch, temperature=temperature)
    keys = row_keys(jax.random.key(seed), jnp.arange(batch))
    stop = jnp.full((batch, 1), -1, jnp.int32) if stop is None else stop
    run = generate if recorder is None else functools.partial(generate_recorded, recorder=recorder)
    return run(
        TARGET,
        T_PARAMS,
        drafter,
        jnp.asarray(prompts),
        jnp.asarray(lengths),
        params,
        keys,
        stop,
        jnp.full((batch,), max_new, jnp.int32),
        max_new_tokens=max_new,
        method=method,
        budget=budget,
        block_size=5,
        **kw,
    )


PROMPTS = np.array([[3, 8, 1, 5, 9, 2], [4, 4, 7, 0, 0, 0], [11, 2, 6, 13, 5, 0]], np.int32)
LENGTHS = np.array([6, 3, 5], np.int32)


@pytest.fixture(scope="module")
def ar_greedy():
    return np.asarray(_run(None, PROMPTS, LENGTHS, method="ar", max_new=12).tokens)


def _oracle(ar_tokens, noise=False):
    table = np.zeros((3, 40), np.int32)
    for b in range(3):
        seq = np.concatenate([PROMPTS[b, : LENGTHS[b]], ar_tokens[b]])
        if noise:  # every 4th draft token wrong: rejections and branches mid-sequence
            seq = seq.copy()
            seq[LENGTHS[b] + 3 :: 4] = (seq[LENGTHS[b] + 3 :: 4] + 1) % V
        table[b, : len(seq)] = seq
    return OracleDrafter(jnp.asarray(table))


@pytest.mark.parametrize("method", ["ddtree", "chain"])
def test_greedy_speculative_text_equals_autoregressive_greedy(ar_greedy, method):
    dflash_out = _run(DFLASH, PROMPTS, LENGTHS, method=method, max_new=12)
    np.testing.assert_array_equal(np.asarray(dflash_out.tokens), ar_greedy)
    for noise in (False, True):
        out = _run(_oracle(ar_greedy, noise), PROMPTS, LENGTHS, method=method, max_new=12)
        np.testing.assert_array_equal(np.asarray(out.tokens), ar_greedy)
        tau = np.asarray(out.tau)
        assert (tau > (2.0 if noise else 3.0)).all(), tau  # deep acceptance: caches were committed right


def test_stop_tokens_and_max_new(ar_greedy):
    stop_at = ar_greedy[0, 4]
    stop = jnp.array([[stop_at], [-1], [-1]], jnp.int32)
    out = _run(_oracle(ar_greedy), PROMPTS, LENGTHS, method="ddtree", max_new=12, stop=stop)
    n = np.asarray(out.num_generated)
    first = int(np.argmax(ar_greedy[0] == stop_at))
    assert n[0] == first + 1 and np.asarray(out.tokens)[0, n[0] - 1] == stop_at
    assert (np.asarray(out.tokens)[0, n[0] :] == -1).all() and n[1] == n[2] == 12


def test_rows_do_not_influence_each_other():
    full = _run(DFLASH, PROMPTS, LENGTHS, method="ddtree", temperature=1.0, seed=5)
    keys_all = row_keys(jax.random.key(5), jnp.arange(3))
    alone = generate(
        TARGET,
        T_PARAMS,
        DFLASH,
        jnp.asarray(PROMPTS[1:2]),
        jnp.asarray(LENGTHS[1:2]),
        SamplingParams.create(1, temperature=1.0),
        keys_all[1:2],
        jnp.full((1, 1), -1, jnp.int32),
        jnp.array([10], jnp.int32),
        max_new_tokens=10,
        method="ddtree",
        budget=8,
        block_size=5,
    )
    np.testing.assert_array_equal(np.asarray(full.tokens)[1], np.asarray(alone.tokens)[0])


def test_output_law_at_temperature_one_is_the_target_law():
    """3 generated tokens after a fixed prompt, 6000 rows, DDTree with the DFlash drafter and with an oracle
    that drafts one fixed continuation; the law of the first token (the prefill sampler) and the joint law
    of tokens 2-3 (both from tree verification) against enumeration of all V^3 continuations."""
    prompt = np.array([5, 2, 9, 14], np.int32)
    seqs = np.array(list(itertools.product(range(V), repeat=3)), np.int32)
    full = np.concatenate([np.broadcast_to(prompt, (len(seqs), 4)), seqs], axis=1)
    logits = np.asarray(jax.jit(lambda ids: qwen3.forward_logits(TARGET, T_PARAMS, ids))(jnp.asarray(full)), np.float64)
    rows = np.arange(len(seqs))

    def law_at(temperature):
        z = logits / temperature
        logp = z - z.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        return np.exp(logp[rows, 3, seqs[:, 0]] + logp[rows, 4, seqs[:, 1]] + logp[rows, 5, seqs[:, 2]]).reshape(
            V, V, V
        )

    law, wrong_law = law_at(1.0), law_at(1.3)
    samples = 6000
    prompts = np.broadcast_to(prompt, (samples, 4))
    for drafter in (
        DFLASH,
        OracleDrafter(jnp.asarray(np.tile(np.concatenate([prompt, seqs[77]]), (samples, 5))[:, :40])),
    ):
        out = generate(
            TARGET,
            T_PARAMS,
            drafter,
            jnp.asarray(prompts),
            jnp.full((samples,), 4, jnp.int32),
            SamplingParams.create(samples, temperature=1.0),
            row_keys(jax.random.key(11), jnp.arange(samples)),
            jnp.full((samples, 1), -1, jnp.int32),
            jnp.full((samples,), 3, jnp.int32),
            max_new_tokens=3,
            method="ddtree",
            budget=6,
            block_size=4,
        )
        tokens = np.asarray(out.tokens)
        counts = np.zeros((V, V, V))
        np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
        assert chi_square_pvalue(counts.sum((1, 2)), law.sum((1, 2))) > ALPHA
        assert chi_square_pvalue(counts.sum(0), law.sum(0)) > ALPHA
        assert chi_square_pvalue(counts.sum(0), wrong_law.sum(0)) < ALPHA  # the test has power
        if drafter is not DFLASH:
            assert float(np.asarray(out.tau).mean()) > 1.2  # the oracle's drafts are accepted at times


@pytest.mark.slow
@pytest.mark.parametrize("budget,block_size", [(1, 5), (64, 3), (200, 5)])
def test_any_budget_and_smaller_blocks_keep_greedy_text(ar_greedy, budget, block_size):
    out = generate(
        TARGET,
        T_PARAMS,
        _oracle(ar_greedy, noise=True),
        jnp.asarray(PROMPTS),
        jnp.asarray(LENGTHS),
        SamplingParams.create(3, temperature=0.0),
        row_keys(jax.random.key(3), jnp.arange(3)),
        jnp.full((3, 1), -1, jnp.int32),
        jnp.full((3,), 12, jnp.int32),
        max_new_tokens=12,
        method="ddtree",
        budget=budget,
        block_size=block_size,
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), ar_greedy)
    assert (np.asarray(out.tau) <= block_size).all()


def test_engine_runs_the_deepseek_family_target():
    """Same engine, the DeepSeek-V3 / Kimi K2-shaped tiny target (absorbed MLA, MoE): greedy DDTree with an
    oracle drafter equals AR greedy, with deep acceptance."""
    from ddtree_jax.models import deepseek_v3

    # the shared two-layer DeepSeek-V3 (tests/tiny_models.py) with vocabulary V, q_lora_rank 16 and YaRN RoPE
    config = dataclasses.replace(
        DSV3_TWO_LAYER,
        vocab_size=V,
        q_lora_rank=16,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position=16,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
    )
    params = deepseek_v3.init_params(config, jax.random.key(4), norm_jitter=0.1)
    params = {**params, "lm_head": params["lm_head"] * 60.0}
    common = dict(
        sampling=SamplingParams.create(3, temperature=0.0),
        keys=row_keys(jax.random.key(3), jnp.arange(3)),
        stop_tokens=jnp.full((3, 1), -1, jnp.int32),
        max_new=jnp.full((3,), 10, jnp.int32),
    )
    ar = generate(
        config, params, None, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), **common, max_new_tokens=10, method="ar"
    )
    ar_tokens = np.asarray(ar.tokens)
    table = np.zeros((3, 40), np.int32)
    for b in range(3):
        seq = np.concatenate([PROMPTS[b, : LENGTHS[b]], ar_tokens[b]])
        table[b, : len(seq)] = seq
    out = generate(
        config,
        params,
        OracleDrafter(jnp.asarray(table)),
        jnp.asarray(PROMPTS),
        jnp.asarray(LENGTHS),
        **common,
        max_new_tokens=10,
        method="ddtree",
        budget=8,
        block_size=5,
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), ar_tokens)
    assert (np.asarray(out.tau) > 3.0).all()
    # a DFlash drafter with YaRN RoPE (the Kimi drafters' kind) on this target: same greedy text
    drafter_config = yarn_drafter(V - 1, (0, 1))
    drafter = DFlashDrafter(
        drafter_config,
        dflash.init_params(drafter_config, 32, jax.random.key(5)),
        deepseek_v3.embedding(params),
        deepseek_v3.head(config, params),
    )
    # the whole-prompt prefill and a chunked one (3 tokens at a time, boundaries inside rows): same greedy text
    for options in (DecodeOptions(), DecodeOptions(prefill_chunk=3)):
        out = generate(
            config,
            params,
            drafter,
            jnp.asarray(PROMPTS),
            jnp.asarray(LENGTHS),
            **common,
            max_new_tokens=10,
            method="ddtree",
            budget=8,
            block_size=4,
            options=options,
        )
        np.testing.assert_array_equal(np.asarray(out.tokens), ar_tokens, err_msg=str(options))


@pytest.mark.slow
@pytest.mark.gpu
def test_the_fused_sampling_kernel_gives_the_same_generation():
    """generate(options=DecodeOptions(verify_impl="pallas")) (ddtree_kernels/tree_sampling.py, interpret mode
    here) equals the XLA
    verification on a sampled batch with top-p: same coins, and no rounding boundary is hit here."""
    from ddtree_jax.engine.run import random_tiny_pair, request_args

    pair = random_tiny_pair(0)
    args = request_args(pair, [[1, 2, 3, 4, 5], [7, 8]], temperature=1.0, top_p=0.9, seed=0, max_new_tokens=24)
    out = {
        impl: np.asarray(
            generate(
                *args,
                max_new_tokens=24,
                method="ddtree",
                budget=8,
                block_size=8,
                options=DecodeOptions(verify_impl=impl),
            ).tokens
        )
        for impl in ("xla", "pallas")
    }
    np.testing.assert_array_equal(out["pallas"], out["xla"])


def test_moe_impl_needs_an_moe_target():
    common = dict(
        sampling=SamplingParams.create(3, temperature=0.0),
        keys=row_keys(jax.random.key(3), jnp.arange(3)),
        stop_tokens=jnp.full((3, 1), -1, jnp.int32),
        max_new=jnp.full((3,), 4, jnp.int32),
    )
    with pytest.raises(ValueError, match="moe_impl='ep' needs an MoE target; Qwen3Config"):
        generate(
            TARGET,
            T_PARAMS,
            None,
            jnp.asarray(PROMPTS),
            jnp.asarray(LENGTHS),
            **common,
            max_new_tokens=4,
            method="ar",
            options=DecodeOptions(moe_impl="ep"),
        )


def _num_accepted(trace, sampling):
    return {"num_accepted": jnp.where(trace.active, trace.result.num_accepted, -1)}


def test_several_steps_per_loop_iteration_change_nothing():
    """DecodeOptions(steps_per_iteration=k), DDTree: the same tokens, steps, acceptance and per-step records as one
    step per iteration, rows of different lengths finishing at different steps (T = 1, so the step keys
    must line up too); k = 3 does not divide the number of steps, so steps run after every row is done."""
    from ddtree_jax.engine.generate import generate_recorded

    batch = PROMPTS.shape[0]
    args = (
        TARGET,
        T_PARAMS,
        DFLASH,
        jnp.asarray(PROMPTS),
        jnp.asarray(LENGTHS),
        SamplingParams.create(batch, temperature=1.0),
        row_keys(jax.random.key(7), jnp.arange(batch)),
        jnp.full((batch, 1), -1, jnp.int32),
        jnp.array([9, 4, 7], jnp.int32),
    )
    static = dict(recorder=_num_accepted, max_new_tokens=9, method="ddtree", budget=6, block_size=5)
    runs = {k: generate_recorded(*args, **static, options=DecodeOptions(steps_per_iteration=k)) for k in (1, 3)}
    (one, rec_one), (three, rec_three) = runs[1], runs[3]
    for field in ("tokens", "num_generated", "steps", "accepted"):
        np.testing.assert_array_equal(np.asarray(getattr(three, field)), np.asarray(getattr(one, field)), err_msg=field)
    np.testing.assert_array_equal(np.asarray(rec_three["num_accepted"]), np.asarray(rec_one["num_accepted"]))
    assert int(np.asarray(one.steps).max()) % 3 != 0  # the last iteration ran steps past the end
    with pytest.raises(ValueError, match="steps_per_iteration must be an int >= 1, got 0"):
        DecodeOptions(steps_per_iteration=0)


def _start(prompts, lengths, *, method, chunk, max_new=6, temperature=0.0):
    from ddtree_jax.engine.generate import start_state

    batch = prompts.shape[0]
    return start_state(
        TARGET,
        T_PARAMS,
        DFLASH if method != "ar" else None,
        jnp.asarray(prompts),
        jnp.asarray(lengths),
        SamplingParams.create(batch, temperature=temperature),
        row_keys(jax.random.key(4), jnp.arange(batch)),
        jnp.full((batch, 1), -1, jnp.int32),
        jnp.full((batch,), max_new, jnp.int32),
        max_new_tokens=max_new,
        method=method,
        budget=6,
        block_size=5,
        options=DecodeOptions(prefill_chunk=chunk),
    )


@pytest.mark.parametrize("chunk, method", [(1, "ar"), (4, "ddtree")])
def test_a_chunked_prefill_equals_the_whole_prompt_prefill(chunk, method):
    """DecodeOptions(prefill_chunk=c): the prompt prefilled c tokens at a time (rows of lengths 6, 3 and 5,
    so chunk boundaries fall inside rows and rows finish in different chunks) gives the same committed
    target K/V, drafter context (DDTree), cache lengths and first token as one prefill, and the same
    generation at T = 1; each row of the ragged batch equals that row's chunked prefill alone."""
    whole = _start(PROMPTS, LENGTHS, method=method, chunk=100)  # longer than the prompt: one prefill
    chunked = _start(PROMPTS, LENGTHS, method=method, chunk=chunk)
    np.testing.assert_array_equal(np.asarray(chunked.bonus), np.asarray(whole.bonus))
    caches = [(chunked.target_cache, whole.target_cache)]
    if method == "ddtree":
        caches.append((chunked.draft_state, whole.draft_state))
    for got, want in caches:
        np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
        for b, n in enumerate(LENGTHS):  # the committed rows; rows past a row's length are scratch
            for field in ("k", "v"):
                np.testing.assert_allclose(
                    np.asarray(getattr(got, field))[:, b, :n], np.asarray(getattr(want, field))[:, b, :n], atol=2e-5
                )
    want = _run(DFLASH, PROMPTS, LENGTHS, method=method, temperature=1.0, max_new=8)
    got = _run(
        DFLASH, PROMPTS, LENGTHS, method=method, temperature=1.0, max_new=8, options=DecodeOptions(prefill_chunk=chunk)
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    if method == "ddtree":  # the ragged batch's rows equal each row's chunked prefill alone
        for b, n in enumerate(LENGTHS):
            alone = _start(PROMPTS[b : b + 1], LENGTHS[b : b + 1], method=method, chunk=chunk)
            assert int(alone.bonus[0]) == int(chunked.bonus[b])
            for got_cache, alone_cache in (
                (chunked.target_cache, alone.target_cache),
                (chunked.draft_state, alone.draft_state),
            ):
                for field in ("k", "v"):
                    np.testing.assert_allclose(
                        np.asarray(getattr(got_cache, field))[:, b, :n],
                        np.asarray(getattr(alone_cache, field))[:, 0, :n],
                        atol=2e-5,
                    )


def test_a_chunked_prefill_takes_memory_linear_in_the_prompt():
    """The compiled prefill's temporary memory (`memory_analysis`) at two prompt lengths: chunked (64 tokens)
    it grows about linearly (the caches), unchunked it grows about quadratically (the [T, S] scores)."""
    from ddtree_jax.engine.generate import start_state

    def temp_bytes(length, chunk):
        prompts = jax.ShapeDtypeStruct((1, length), jnp.int32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        fn = jax.jit(
            lambda p, n: start_state(
                TARGET,
                T_PARAMS,
                None,
                p,
                n,
                SamplingParams.create(1, temperature=0.0),
                row_keys(jax.random.key(0), jnp.arange(1)),
                jnp.full((1, 1), -1, jnp.int32),
                jnp.full((1,), 2, jnp.int32),
                max_new_tokens=2,
                method="ar",
                budget=1,
                block_size=5,
                options=DecodeOptions(prefill_chunk=chunk),
            )
        )
        return fn.lower(prompts, lengths).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(2048, 64) / temp_bytes(1024, 64)
    whole = temp_bytes(2048, 4096) / temp_bytes(1024, 4096)
    assert chunked < 2.6, chunked
    assert whole > 3.0, whole  # what the check would see without chunking


def _with_head(scale: float) -> DFlashDrafter:
    """DFLASH with a path-conditioned child head (`models.child_head`): untrained (scale 0: the marginal) or with
    a random output layer (scale > 0: each parent's children differ)."""
    from ddtree_jax.config import ChildHeadConfig
    from ddtree_jax.models import child_head

    config = ChildHeadConfig(hidden_size=32, inner_size=16)
    params = child_head.init_params(config, jax.random.key(4))
    if scale:
        params = {**params, "out_proj": jax.random.normal(jax.random.key(5), params["out_proj"].shape) * scale}
    return DFLASH.with_head(config, params)


def _tree_tokens(trace, sampling):
    """Recorder: the step's tree tokens and parents [B, N]."""
    return {"tokens": trace.tree.tokens, "parents": trace.tree.parents}


def test_greedy_with_a_path_conditioned_head_equals_autoregressive_greedy(ar_greedy):
    out = _run(_with_head(3.0), PROMPTS, LENGTHS, method="ddtree", max_new=12)
    np.testing.assert_array_equal(np.asarray(out.tokens), ar_greedy)


def test_an_untrained_head_decodes_as_ddtree_and_a_trained_one_changes_the_trees():
    def recorded(drafter):
        return _run(drafter, PROMPTS, LENGTHS, method="ddtree", temperature=1.0, seed=5, recorder=_tree_tokens)

    (marginal, marginal_trees), (untrained, untrained_trees), (_, trained_trees) = (
        recorded(d) for d in (DFLASH, _with_head(0.0), _with_head(3.0))
    )
    np.testing.assert_array_equal(np.asarray(untrained.tokens), np.asarray(marginal.tokens))
    for name in ("tokens", "parents"):
        np.testing.assert_array_equal(np.asarray(untrained_trees[name]), np.asarray(marginal_trees[name]))
    first = {name: np.asarray(trees["tokens"][0]) for name, trees in (("m", marginal_trees), ("t", trained_trees))}
    assert not np.array_equal(first["m"], first["t"])  # the first step's trees: the head re-ranks the children


def test_a_head_must_match_the_drafter():
    from ddtree_jax.config import ChildHeadConfig
    from ddtree_jax.models import child_head

    config = ChildHeadConfig(hidden_size=16, inner_size=8)
    with pytest.raises(ValueError, match=r"the child head's hidden_size \(16\) must equal the drafter's \(32\)"):
        DFLASH.with_head(config, child_head.init_params(config, jax.random.key(0)))
    with pytest.raises(ValueError, match="head_config and head_params go together"):
        dataclasses.replace(DFLASH, head_config=config)
