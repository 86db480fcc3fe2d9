"""benchmarks/bench_tree.py's arguments: a bad list entry is refused at parse time, before any case is compiled or
timed (a bad --select-warps or --impls entry used to fail as a traceback after the timings)."""

import pytest

from benchmarks import bench_tree
from tests.experiments.refusal import assert_refused, refuse_to_run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--select-warps", "1,two"], "--select-warps '1,two': expected comma-separated integers"),
        (["--select-warps", "0"], "warps must be >= 1"),
        (["--impls", "xla,bogus"], "--impls 'xla,bogus': expected distinct entries of pallas, prefilter, xla"),
        (["--impls", "xla,xla"], "expected distinct entries"),
        (["--cases", "1x16,2"], "--cases '1x16,2'"),
        (["--cases", "1xq"], "--cases '1xq'"),
        (["--cases", "0x16"], "integers >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_any_case_runs(argv, message, monkeypatch, capsys):
    refuse_to_run(monkeypatch, bench_tree, "build_tree_unchecked")
    assert_refused(bench_tree.main, ["--quick", "--no-sweep", *argv], message, capsys)
