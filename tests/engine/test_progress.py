"""engine.progress: off a terminal (a log file, a GPU job's captured output) a long run prints a line per finished
run; tqdm's bar would print nothing there."""

import sys

from ddtree_jax.engine import progress


def test_progress_off_a_terminal_is_one_line_per_finished_run(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    bar = progress.progress_bar(2, "budget sweep")
    assert isinstance(bar, progress.LineProgress)
    bar.set_description("ddtree 8 T=0")
    bar.update(1)
    bar.set_description("ddtree 16 T=0")
    bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "budget sweep: ddtree 8 T=0 done (1/2;" in lines[0] and "ddtree 16 T=0 done (2/2; ~0 s left)" in lines[1]
    quiet = progress.progress_bar(2, "quiet", enabled=False)
    assert not isinstance(quiet, progress.LineProgress)
    quiet.update(1)
    quiet.close()
    assert capsys.readouterr().err == ""
