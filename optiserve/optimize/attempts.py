"""Every step after the baseline runs so that one which raises costs what depends on it and nothing
else: a pass's variants become `failed` rows that say the root cause in one plain line, a shared
preparation (INT8 calibration) that raises leaves the variants that need it `not built` with that
line, the traceback goes to `optimize.log` in the artifact folder, and the passes that need what
failed are reported as not built."""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path

from optiserve.errors import failure_reason
from optiserve.optimize.progress import PassLog

LOG_FILE = "optimize.log"
INT8_PREPARATION = "INT8 calibration"  # the recipe and calibration batches every INT8 pass shares


class Attempts:
    """The passes of one `optimize` run that built nothing: `failed` (name, pass, reason) where a
    pass raised, `skipped` (name, reason) where it did not apply or needed what failed."""

    def __init__(self, log: PassLog, stage: Path, skipped: list[dict]):
        self.log, self.stage, self.skipped = log, stage, skipped
        self.failed: list[dict] = []
        self.unmet: dict[str, str] = {}  # a preparation that raised -> its reason

    @contextlib.contextmanager
    def attempt(self, title: str, *names: str):
        """Run the body as the pass `title`, which builds the variants `names`; an exception in it
        is recorded against each of them and the run goes on."""
        try:
            with self.log.step(title):
                yield
        except Exception as e:  # noqa: BLE001  one pass's failure, whatever it is, is that pass's row
            self.record(title, e, *names)

    @contextlib.contextmanager
    def preparation(self, title: str):
        """Run the body as `title`, which builds no variant but what later passes share (the INT8
        recipe and calibration batches); an exception in it is noted, and each pass that needs it
        (`missing(title)`) is not built, with the reason, while the run goes on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001  whatever it is, it costs only the variants that need it
            self.unmet[title] = self.noted(title, e)

    def record(self, title: str, e: Exception, *names: str) -> None:
        """The variants `names` failed in the pass `title` with `e`."""
        reason = self.noted(title, e, *names)
        self.failed += [{"name": name, "pass": title, "reason": reason} for name in names]

    def noted(self, title: str, e: Exception, *names: str) -> str:
        """`e`, raised in `title`, kept in the log file and said on the progress display; returns the
        one plain line a row quotes of it."""
        reason = failure_reason(e)
        self._keep_traceback(title, e)
        self.log.note(f"{', '.join(names) or title} failed: {reason} (traceback in {LOG_FILE})")
        return reason

    def missing(self, *names: str) -> str | None:
        """Why a pass that needs the variants (or preparations) `names` cannot run (one of them
        failed or was not built), or None."""
        for name in names:
            if name in self.unmet:
                return f"needs {name}, which failed: {self.unmet[name]}"
            if name in self.failed_names:
                return f"needs {name}, which failed"
            if self.reason(name) is not None:
                return f"needs {name}, which was not built"
        return None

    def cannot(self, why: str, *names: str) -> None:
        """The variants `names` are not built, for `why` (a row each, beside the built ones)."""
        self.skipped += [{"name": name, "reason": why} for name in names]

    def reason(self, name: str) -> str | None:
        """Why `name` was not built (it failed, or it cannot be), where its row says so already."""
        return next((row["reason"] for row in (*self.failed, *self.skipped) if row["name"] == name), None)

    def skip(self, title: str, why: str, *names: str) -> None:
        """A pass that does not run: its variants `names` are not built, with the reason; it is
        still counted, so the progress adds up."""
        self.log.passed_over(title, why)
        self.cannot(why, *names)

    @property
    def failed_names(self) -> set[str]:
        return {f["name"] for f in self.failed}

    def _keep_traceback(self, title: str, e: Exception) -> None:
        text = "".join(traceback.format_exception(e))
        with open(self.stage / LOG_FILE, "a") as f:  # inside the staging folder: published with the rest
            f.write(f"== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {title}\n{text}\n")
