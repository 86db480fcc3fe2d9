"""The committed embedded pair (checkpoints/embedded): it loads, matches its provenance, and the engine's
greedy DDTree and DFlash-chain text equals autoregressive greedy text with it (exactness on real weights;
a divergence is allowed only where the AR top-2 logit gap is below 1e-4, as the engine's greedy tests allow)."""

import hashlib
import json
import os

import jax
import numpy as np
import pytest

from ddtree_jax.engine.run import load_pair, run

PAIR = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "embedded")
PROMPTS = [
    'import os\n\n\ndef list_python_files(root):\n    """Return the paths of the .py files under root."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


@pytest.fixture(scope="module")
def pair():
    if not os.path.isdir(os.path.join(PAIR, "target")):
        pytest.fail("checkpoints/embedded is missing: it is committed (docs/training.md)")
    return load_pair(os.path.join(PAIR, "target"), os.path.join(PAIR, "drafter"))


def test_the_pair_matches_its_provenance(pair):
    with open(os.path.join(PAIR, "provenance.json")) as f:
        prov = json.load(f)
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    assert count(pair.target_params) == prov["target"]["params"]
    assert count(pair.drafter.params) == prov["drafter"]["params"]
    with open(os.path.join(PAIR, "target", "tokenizer.json"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == prov["tokenizer"]["tokenizer_sha256"]
    assert pair.tokenizer.decode(pair.tokenizer.encode(PROMPTS[1])) == PROMPTS[1]


def _perplexity(pair, sequences) -> float:
    from ddtree_jax.models import target_module

    nll, count = 0.0, 0
    for ids in sequences:
        logits = np.asarray(
            target_module(pair.target_config).forward_logits(pair.target_config, pair.target_params, np.asarray([ids]))[
                0
            ],
            np.float64,
        )
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll -= sum(log_probs[i, ids[i + 1]] for i in range(len(ids) - 1))
        count += len(ids) - 1
    return float(np.exp(nll / count))


def test_the_target_is_trained_on_python_source(pair):
    """The model itself, not the numbers provenance.json records: the target predicts Python source (about
    17 on these prompts, where an untrained model of this vocabulary is near 8192), and far better than
    the same tokens shuffled."""
    ids = [pair.tokenizer.encode(p) for p in PROMPTS]
    rng = np.random.default_rng(0)
    ppl, shuffled = _perplexity(pair, ids), _perplexity(pair, [list(rng.permutation(x)) for x in ids])
    assert ppl < 40, ppl
    assert shuffled > 4 * ppl, (ppl, shuffled)


@pytest.mark.slow
def test_greedy_speculative_text_equals_autoregressive_greedy(pair):
    from ddtree_jax.models import target_module

    ids = [pair.tokenizer.encode(p) for p in PROMPTS]
    # both prompts in one batch (ragged lengths): one compilation per method
    ar = run(pair, ids, method="ar", budget=1, block_size=None, max_new_tokens=48, temperature=0.0)["tokens"]
    taus = []
    for method, budget in (("ddtree", 32), ("chain", 1)):
        out = run(pair, ids, method=method, budget=budget, block_size=None, max_new_tokens=48, temperature=0.0)
        taus.append(out["tau"])
        for x, want, got in zip(ids, ar, out["tokens"]):
            if got != want:  # only at a near-tie of the AR logits
                at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                logits = target_module(pair.target_config).forward_logits(
                    pair.target_config, pair.target_params, np.asarray([x + want[:at]])
                )[0, -1]
                top2 = np.sort(np.asarray(logits, np.float64))[-2:]
                assert top2[1] - top2[0] < 1e-4, (method, at, top2)
    assert min(taus) > 1.5  # the trained drafter is accepted: several tokens per step
