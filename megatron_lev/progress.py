"""Progress of long work on standard error: a tqdm bar when it is a terminal, otherwise plain lines (a log
file, a pipe, a batch job's output) every so many items or seconds. Preprocessing and evaluation use it.

    with Progress("hellaswag", total=len(requests), unit="request", seconds=10) as progress:
        for batch in batches:
            ...
            progress.update(len(batch))
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


class Progress:
    """``done`` items of ``total`` (None: unknown) under ``desc``.

    ``bar``: a tqdm bar (None: when the stream is a terminal). Without a bar a line is printed once ``every``
    more items are done, or once ``seconds`` have passed since the last line (0: at every update); None
    leaves that criterion out. ``line(done, elapsed_seconds)`` writes the line (default: the description, the
    count and the rate). ``leave``: the bar stays on the screen once closed. ``enabled=False``: nothing is shown
    (a rank other than the one that reports)."""

    def __init__(self, desc: str, *, total: Optional[int] = None, unit: str = "item", bar: Optional[bool] = None,
                 every: Optional[int] = None, seconds: Optional[float] = None,
                 line: Optional[Callable[[int, float], str]] = None, leave: bool = True, enabled: bool = True,
                 stream: Optional[TextIO] = None) -> None:
        self.desc, self.total, self.unit, self.line = desc, total, unit, line
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.every, self.seconds = every, seconds
        self.done = 0
        self.t0 = self.last_line = time.perf_counter()
        self.next_count = every if every and every > 0 else None
        self.bar = None
        if enabled and (bar if bar is not None else _isatty(self.stream)):
            from tqdm import tqdm

            self.bar = tqdm(desc=desc or None, total=total, unit=unit, dynamic_ncols=True, file=self.stream,
                            mininterval=0.5, leave=leave)

    def update(self, n: int = 1, postfix: Optional[str] = None) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix_str(postfix, refresh=False)
            return
        now = time.perf_counter()
        due = self.seconds is not None and now - self.last_line >= self.seconds
        if self.next_count is not None and self.done >= self.next_count:
            while self.next_count <= self.done:
                self.next_count += self.every
            due = True
        if due:
            self.last_line = now
            print(self._line(max(now - self.t0, 1e-9)), file=self.stream, flush=True)

    def _line(self, elapsed: float) -> str:
        if self.line is not None:
            return self.line(self.done, elapsed)
        count = f"{self.done:,}/{self.total:,}" if self.total is not None else f"{self.done:,}"
        return f"{self.desc}: {count} {self.unit}s ({self.done / elapsed:,.1f} {self.unit}s/s, {elapsed:.0f} s)"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
