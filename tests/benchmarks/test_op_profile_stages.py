"""benchmarks.op_profile's stage attribution: each op of a compiled decode step to the `engine.step` named scope
(`ddtree_<stage>`) its HLO metadata names, or that most of its fused computation's instructions name."""

import pytest

from benchmarks.op_profile import format_stages, op_stages, stage_shares, stage_table

HLO = """
%fused_walk (p0: f32[8]) -> f32[8] {
  %a = f32[8] exp(%p0), metadata={op_name="jit(step)/while/body/ddtree_walk/exp"}
  %b = f32[8] negate(%a), metadata={op_name="jit(step)/while/body/ddtree_walk/neg"}
  ROOT %c = f32[8] add(%a, %b), metadata={op_name="jit(step)/while/body/ddtree_tree_forward/add"}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  %dot.1 = f32[8] multiply(%x, %x), metadata={op_name="jit(step)/ddtree_tree_forward/dot_general"}
  %fusion.3 = f32[8] fusion(%dot.1), kind=kLoop, calls=%fused_walk
  %sort.2 = f32[8] sort(%fusion.3), metadata={op_name="jit(step)/ddtree_tree/sort"}
  ROOT %copy.4 = f32[8] copy(%sort.2)
}
"""


def test_each_op_takes_its_scope_or_its_fused_computations_majority():
    stages = op_stages(HLO)
    assert stages["dot.1"] == "tree_forward"  # "tree_forward", not its prefix "tree"
    assert stages["sort.2"] == "tree"
    assert stages["fusion.3"] == "walk"  # no metadata of its own: 2 of its 3 instructions are the walk's
    assert "copy.4" not in stages  # outside every scope


def test_stage_table_and_the_non_forward_share():
    ops = [
        {"op": "dot.1", "us_per_run": 60.0, "events_per_run": 2.0},
        {"op": "fusion.3", "us_per_run": 25.0, "events_per_run": 1.0},
        {"op": "sort.2", "us_per_run": 5.0, "events_per_run": 1.0},
        {"op": "copy.4", "us_per_run": 10.0, "events_per_run": 1.0},
    ]
    table = stage_table(ops, op_stages(HLO))
    assert table == {
        "tree_forward": {"us": 60.0, "launches": 2.0},
        "walk": {"us": 25.0, "launches": 1.0},
        "tree": {"us": 5.0, "launches": 1.0},
        "other": {"us": 10.0, "launches": 1.0},
    }
    shares = stage_shares(table)
    assert (
        shares["device_forward_us"] == 60.0
        and shares["device_non_forward_us"] == 30.0
        and shares["device_other_us"] == 10.0
    )
    assert shares["device_non_forward_share"] == pytest.approx(0.30)  # of the whole device time, "other" included
    assert stage_shares({})["device_non_forward_share"] == 0.0
    text = format_stages(table)
    assert "tree_forward" in text and "30.0%" in text
