"""A progress display that names each pass as it runs and how long it took."""

from __future__ import annotations

import contextlib
import sys
import time


class PassLog:
    """Prints `[3/8] name ... done in 1.2 s` per pass; notes inside a pass go on lines of their own."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled, self.i = total, enabled, 0
        self.stream = stream or sys.stderr
        self._line_open = False

    @contextlib.contextmanager
    def step(self, name: str):
        self.i += 1
        self._print(f"[{self.i}/{self.total}] {name} ...", end="")
        self._line_open = True
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self._finish("failed")
            raise
        self._finish(f"done in {time.perf_counter() - t0:.1f} s")

    def passed_over(self, name: str, why: str) -> None:
        """A pass counted but not run: `[4/8] name ... not run: why`."""
        self.i += 1
        self._print(f"[{self.i}/{self.total}] {name} ... not run: {why}")

    def note(self, text: str) -> None:
        if self._line_open:
            self._print("")
            self._line_open = False
        self._print(f"      {text}")

    def _finish(self, text: str) -> None:
        self._print(f" {text}" if self._line_open else f"      {text}")
        self._line_open = False

    def _print(self, text: str, end: str = "\n") -> None:
        if self.enabled:
            print(text, end=end, file=self.stream, flush=True)
