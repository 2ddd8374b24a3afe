"""A byte budget for what requests hold in memory at once: their buffered bodies and, for JSON
tensors, the Python objects a parse builds. Queue places bound requests in images; this bounds them
in bytes, so that many large bodies cannot exhaust a container's memory limit together."""

from __future__ import annotations

import threading

from optiserve.serve.api_error import ApiError


class ByteBudget:
    """Bytes held by admitted requests, at most `limit` at once (thread-safe: decode threads take too)."""

    def __init__(self, limit: int, setting: str = "--max-queue-bytes"):
        self.limit, self.used, self.setting = limit, 0, setting  # `setting`: what set the limit, for the errors
        self._lock = threading.Lock()

    def hold(self) -> "HeldBytes":
        """An empty holding for one request, grown as it buffers and decodes, released when it ends."""
        return HeldBytes(self)

    def _take(self, n: int, what: str, held: int) -> None:
        if held + n > self.limit:
            raise ApiError(413, f"{what} needs {held + n:,} bytes in memory, over the server's whole budget for "
                                f"requests ({self.setting} {self.limit:,}): send less in one request")
        with self._lock:
            if self.used + n > self.limit:
                raise ApiError(429, f"overloaded: requests in progress hold {self.used:,} of the "
                                    f"{self.limit:,} bytes allowed ({self.setting}); retry later",
                               {"Retry-After": "1"})
            self.used += n

    def _give_back(self, n: int) -> None:
        with self._lock:
            self.used -= n


class HeldBytes:
    """What one request holds of the budget."""

    def __init__(self, budget: ByteBudget):
        self.budget, self.bytes = budget, 0

    def grow(self, n: int, what: str = "the request") -> None:
        """Hold `n` more bytes: 413 if this request alone could never fit, 429 if others hold the room."""
        if n > 0:
            self.budget._take(n, what, self.bytes)
            self.bytes += n

    def shrink(self, n: int) -> None:
        """Give back `n` of the bytes held (a transient copy that is gone)."""
        n = min(n, self.bytes)
        if n > 0:
            self.budget._give_back(n)
            self.bytes -= n

    def release(self) -> None:
        self.shrink(self.bytes)
