"""engine.profile.stage_times: every stage of one decode step timed alone, next to the fused step."""

import pytest

from ddtree_jax.engine.profile import NON_FORWARD, STAGES, add_shares, format_stage_table, stage_times
from ddtree_jax.engine.run import random_tiny_pair


@pytest.fixture(scope="module")
def pair():
    return random_tiny_pair(1)


def test_ddtree_stage_times_are_positive_and_add_up(pair):
    times = stage_times(
        pair,
        [3, 1, 4, 1, 5],
        method="ddtree",
        budget=6,
        block_size=4,
        max_new_tokens=8,
        temperature=0.8,
        top_k=20,
        repeats=2,
    )
    shares = {f"{s}_share" for s in STAGES}
    assert set(times) == set(STAGES) | shares | {"step", "stages_sum", "non_forward_share"}
    assert all(times[s] > 0 for s in STAGES) and times["step"] > 0
    assert times["stages_sum"] == pytest.approx(sum(times[s] for s in STAGES))
    _check_shares(times)
    table = format_stage_table([("ddtree 6", times)])
    assert table.splitlines()[2].startswith("ddtree 6") and table.splitlines()[2].endswith("%")


def _check_shares(times):
    """The stages' shares add up to 1, each in [0, 1]; the non-forward and forward shares split that 1."""
    shares = [times[f"{s}_share"] for s in STAGES]
    assert all(0.0 <= v <= 1.0 for v in shares) and sum(shares) == pytest.approx(1.0)
    assert 0.0 <= times["non_forward_share"] <= 1.0
    forward = times["draft_share"] + times["tree_forward_share"]
    assert times["non_forward_share"] + forward == pytest.approx(1.0)
    assert times["non_forward_share"] == pytest.approx(sum(times[f"{s}_share"] for s in NON_FORWARD))


def test_shares_stay_within_100_percent_when_the_stages_outlast_the_fused_step():
    """Stages timed alone lose the fusion across their boundaries: their sum can exceed the step (here 13 ms of
    stages, an 8 ms step, tree + walk + commit 9 ms, which as a share of the step would read 113%)."""
    times = add_shares({"draft": 1e-3, "tree": 3e-3, "tree_forward": 3e-3, "walk": 4e-3, "commit": 2e-3, "step": 8e-3})
    assert times["stages_sum"] == pytest.approx(13e-3) and times["step"] == 8e-3
    _check_shares(times)
    assert times["non_forward_share"] == pytest.approx(9 / 13)
    table = format_stage_table([("ddtree 6", times)])
    assert table.splitlines()[2].endswith("69.2%")
    footer = " ".join(table.splitlines()[3:])
    assert "share of the stages' sum" in footer and "step: the fused decode step" in footer
    zero = add_shares({s: 0.0 for s in STAGES} | {"step": 1e-3})
    assert zero["non_forward_share"] == 0.0 and all(zero[f"{s}_share"] == 0.0 for s in STAGES)


def test_ar_has_no_draft_stage_and_requests_are_checked(pair):
    times = stage_times(pair, [[3, 1, 4], [2, 7, 1]], method="ar", max_new_tokens=4, repeats=1)  # a batch of two
    assert times["draft"] == 0.0 and all(times[s] > 0 for s in STAGES if s != "draft") and times["step"] > 0
    with pytest.raises(ValueError, match="budget must be in"):
        stage_times(pair, [1, 2], method="ddtree", budget=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        stage_times(pair, [[]], method="chain")


def test_a_child_head_pair_profiles_the_path_conditioned_tree(pair, monkeypatch):
    """With a child head the step drafts through `draft_children` and builds the path-conditioned tree; the profile
    timed the marginal draft and tree instead (another tree than the step verifies)."""
    import dataclasses

    import jax

    from ddtree_jax.config import ChildHeadConfig
    from ddtree_jax.engine import profile
    from ddtree_jax.models import child_head

    config = ChildHeadConfig(hidden_size=pair.target_config.hidden_size, inner_size=16)
    params = child_head.init_params(config, jax.random.key(4))
    params = {**params, "out_proj": jax.random.normal(jax.random.key(5), params["out_proj"].shape) * 3.0}
    headed = dataclasses.replace(pair, drafter=pair.drafter.with_head(config, params))
    built = []
    conditional_tree_stage = profile.conditional_tree_stage

    def recording(*args, **kwargs):
        built.append("conditional")
        return conditional_tree_stage(*args, **kwargs)

    def marginal(*args, **kwargs):
        pytest.fail("the marginal tree was profiled for a child-head pair")

    monkeypatch.setattr(profile, "conditional_tree_stage", recording)
    monkeypatch.setattr(profile, "tree_stage", marginal)
    times = stage_times(headed, [3, 1, 4, 1, 5], method="ddtree", budget=6, block_size=4, max_new_tokens=8, repeats=1)
    assert built and times["tree"] > 0 and times["draft"] > 0
