"""engine.profile.stage_times: every stage of one decode step timed alone, next to the fused step."""

import pytest

from ddtree_jax.engine.profile import NON_FORWARD, STAGES, format_stage_table, stage_times
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
    assert set(times) == set(STAGES) | {"step", "stages_sum", "non_forward_share"}
    assert all(times[s] > 0 for s in STAGES) and times["step"] > 0
    assert times["stages_sum"] == pytest.approx(sum(times[s] for s in STAGES))
    assert times["non_forward_share"] == pytest.approx(sum(times[s] for s in NON_FORWARD) / times["step"])
    table = format_stage_table([("ddtree 6", times)])
    assert table.splitlines()[2].startswith("ddtree 6") and table.splitlines()[2].endswith("%")


def test_ar_has_no_draft_stage_and_requests_are_checked(pair):
    times = stage_times(pair, [[3, 1, 4], [2, 7, 1]], method="ar", max_new_tokens=4, repeats=1)  # a batch of two
    assert times["draft"] == 0.0 and all(times[s] > 0 for s in STAGES if s != "draft") and times["step"] > 0
    with pytest.raises(ValueError, match="budget must be in"):
        stage_times(pair, [1, 2], method="ddtree", budget=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        stage_times(pair, [[]], method="chain")
