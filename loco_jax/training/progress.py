"""The application's one progress display: a bar updated in place on a terminal, plain lines elsewhere.

Both the training loop and ``prepare_data.py`` draw with :class:`ProgressLine`. It is hand-written
rather than tqdm because of what it does off a terminal: in a log file or CI it writes a plain line
every ``every_s`` seconds (or nothing, where the caller logs its own lines, as the loop does), never a
carriage return.
"""

from __future__ import annotations

import sys
import time


def hms(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour up."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressLine:
    """``show(fraction, text)``: ``[#####.....] text`` rewritten in place on a terminal, at most every
    ``every_s`` seconds (and always when ``final``); off a terminal, ``text`` as its own line at most every
    ``every_s`` seconds, or never with ``every_s=None``."""

    def __init__(self, stream=None, *, width: int = 24, every_s: float | None = 0.0):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width, self.every_s = width, every_s
        self._last, self._open = float("-inf"), False

    def show(self, fraction: float, text: str, *, final: bool = False):
        if not self.tty and self.every_s is None:
            return
        now = time.perf_counter()
        if not final and now - self._last < (self.every_s or 0.0):
            return
        self._last = now
        if self.tty:
            done = int(self.width * min(max(fraction, 0.0), 1.0))
            self.stream.write(f"\r[{'#' * done}{'.' * (self.width - done)}] {text}   ")
            self._open = True
            if final:
                self.end_line()
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def restart(self, wait: bool = False):
        """A new phase: end the current line; the next ``show`` draws at once, or after ``every_s`` (``wait``)."""
        self.end_line()
        self._last = time.perf_counter() if wait else float("-inf")

    def end_line(self):
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    close = end_line
