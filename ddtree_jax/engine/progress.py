"""Progress of long runs (benchmarks, studies) on stderr: a tqdm bar on a terminal, one timestamped line per
finished run elsewhere (a log file, a GPU job's captured output), where a bar would show nothing."""

from __future__ import annotations

import sys
import time


class LineProgress:
    """tqdm's update / set_description / close, as one line on stderr per finished run: what finished, the count
    done and the time left at the mean pace so far."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.current = total, desc, 0, ""
        self.began = time.perf_counter()

    def set_description(self, text: str) -> None:
        self.current = text

    def update(self, n: int = 1) -> None:
        self.done += n
        elapsed = time.perf_counter() - self.began
        left = elapsed / self.done * (self.total - self.done)
        print(
            f"[{elapsed:8.1f} s] {self.desc}: {self.current} done ({self.done}/{self.total}; ~{left:.0f} s left)",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on a terminal, `LineProgress` lines when stderr is not one; nothing when not `enabled`."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, leave=False)
