"""experiments/sharded_run.py's arguments: bad values are refused before any model is built or compiled (the
model builder is replaced by one that fails)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.k26_model import SpreadDraftsDrafter, k26_config
from ddtree_jax.engine.drafters import DFlashDrafter
from ddtree_jax.sharding.mesh import make_mesh
from experiments import sharded_run
from tests.experiments.refusal import assert_refused, refuse_to_run


@pytest.fixture
def no_model(monkeypatch):
    refuse_to_run(monkeypatch, sharded_run, "sharded_pair")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "0"], "--model 0"),
        (["--repeats", "0"], "--repeats 0"),
        (["--data", "0"], "--data 0"),
        (["--layouts", "tp,bogus"], "--layouts"),
        (["--layouts", "ep,ep"], "--layouts"),
        (["--layers", "2,2"], "--layers"),
        (["--budgets", "8,x"], "--budgets"),
        (["--model", "1000"], "devices"),
        (["--model", "8"], "INT4 groups"),  # the tiny experts' 4 groups of 32 columns do not split 8 ways under tp
        # ep splits the tiny model's 8 heads' columns too: 3 or 6 ways they do not divide (was a JAX IndivisibleError
        # raised from inside sharded_pair's jit)
        (["--model", "3", "--layouts", "ep"], "does not divide over mesh axis 'model' of size 3 (layout 'ep')"),
        (["--model", "6", "--layouts", "ep"], "does not divide over mesh axis 'model' of size 6 (layout 'ep')"),
        (["--temperature", "inf"], "finite and >= 0"),
    ],
)
def test_bad_arguments_are_refused_up_front(argv, message, no_model, capsys):
    assert_refused(sharded_run.main, ["--tiny", *argv], message, capsys)


def test_the_pair_drafts_spread_by_default_and_refuses_unknown_drafts(capsys):
    config = k26_config(2, tiny=True)
    dconfig = sharded_run.drafter_config(config, 1, True)
    mesh = make_mesh(model=2)  # a TP2 mesh over the first 2 devices (one on a 1-device run would not split)
    pair = sharded_run.sharded_pair(config, dconfig, mesh, "tp", jnp.float32)
    assert isinstance(pair.drafter, SpreadDraftsDrafter)
    # the drafter's weights are those of the model's own drafts (same seed), so only the proposals differ
    own = sharded_run.sharded_pair(config, dconfig, mesh, "tp", jnp.float32, drafts="model")
    assert type(own.drafter) is DFlashDrafter
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), pair.drafter.params, own.drafter.params))
    with pytest.raises(ValueError, match="drafts must be one of .* got 'oracle'"):
        sharded_run.sharded_pair(config, dconfig, mesh, "tp", jnp.float32, drafts="oracle")
    assert_refused(sharded_run.main, ["--tiny", "--drafts", "oracle"], "--drafts", capsys)
