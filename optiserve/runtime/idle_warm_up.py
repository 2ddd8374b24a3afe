"""Warm-up runs a server makes while it idles, for an engine that compiles for each new input shape.

Such an engine (OpenVINO) takes several times a warm run's time on its first run at a shape, and a
text server meets new (texts, length) shapes for a long time after it is ready. Running them all at
load would delay readiness by seconds; run one at a time while no request waits, they cost a request
at most one warm-up run of waiting. Each shape an engine has compiled also holds memory (a few MB
for a small encoder, more for a larger one), so only shapes no longer than the longest run the
session has made are warmed: what the traffic has shown it reaches, a step ahead of it. A session
names its shapes (`warm_up_shapes`, shortest first), the longest length it has run (`longest_fed`)
and runs one shape (`warm_up`); one that names none gets none."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("optiserve.runtime")


class IdleWarmUp:
    """The shapes of one session still to warm. `due` (read on the event loop) says which to run
    next, if any is due yet; `run` (on the session's own inference thread) runs it."""

    def __init__(self, session, shapes: list[tuple[int, int]], name: str = ""):
        self.session, self.name = session, name or "variant"
        self._pending = sorted(shapes, key=lambda shape: (shape[1], shape[0]))
        self._ran, self._spent = 0, 0.0

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def due(self) -> tuple[int, int] | None:
        """The shortest shape not yet run, where it is no longer than the longest run made so far."""
        if self._pending and self._pending[0][1] <= self.session.longest_fed:
            return self._pending[0]
        return None

    def run(self, shape: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        self._pending.remove(shape)
        self.session.warm_up(shape)
        self._ran += 1
        self._spent += time.perf_counter() - t0
        if self._ran % 16 == 0 or not self._pending:
            log.info("%s: %d input shapes warmed up while idle (%.1f s), up to %d tokens%s", self.name, self._ran,
                     self._spent, shape[1], "" if self._pending else "; that is all of them")


def idle_warm_up(session, name: str = "") -> IdleWarmUp | None:
    """`session`'s idle warm-up, or None where it names no shapes to warm."""
    named = getattr(session, "warm_up_shapes", None)
    shapes = list(named()) if named is not None else []
    return IdleWarmUp(session, shapes, name) if shapes else None
