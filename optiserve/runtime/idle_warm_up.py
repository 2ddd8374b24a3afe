"""Warm-up runs a server makes while it idles, for an engine that compiles for each new input shape.

Such an engine (OpenVINO) takes several times a warm run's time on its first run at a shape, and a
text server meets new (texts, length) shapes for a long time after it is ready. Running them all at
load would delay readiness by seconds; run one at a time while no request waits, they cost a request
at most one warm-up run of waiting, and only in the server's first seconds. A session names its
shapes (`warm_up_shapes`, most likely first) and runs one (`warm_up`); one that names none gets none."""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("optiserve.runtime")


def idle_warm_up(session, name: str = "") -> Callable[[], bool] | None:
    """A step that runs `session`'s next warm-up shape and says whether any remain (run it on the
    session's own inference thread, between batches); None where the session names no shapes."""
    named = getattr(session, "warm_up_shapes", None)
    pending = list(named()) if named is not None else []
    if not pending:
        return None
    total, pending, spent = len(pending), pending[::-1], [0.0]

    def step() -> bool:
        t0 = time.perf_counter()
        session.warm_up(pending.pop())
        spent[0] += time.perf_counter() - t0
        if not pending:
            log.info("%s: %d input shapes warmed up while idle, in %.1f s", name or "variant", total, spent[0])
        return bool(pending)

    return step
