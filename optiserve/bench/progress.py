"""A live one-line status for long measurements: rewritten in place on a terminal, printed every
few seconds when the output is a log file."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, enabled: bool = True, stream=None, log_every_s: float = 10.0):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)
        elif force or now - self._last >= self.log_every_s:
            print(text, file=self.stream, flush=True)
            self._last = now

    def done(self, text: str) -> None:
        """Replace the live line with a final one."""
        if not self.enabled:
            return
        if self.tty:
            self.update(text)
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
        else:
            print(text, file=self.stream, flush=True)
