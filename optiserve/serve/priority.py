"""CPU priority for inference threads, so the event loop that admits and rejects requests stays
responsive when inference has every core busy.

On Linux nice values are per thread and inherited by the threads a thread creates, so lowering
the priority of the thread that creates a session (and of the thread that runs its batches)
also lowers the runtime's own intra-op worker threads. Elsewhere this is a no-op.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("optiserve.serve")


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread (and the threads it starts later) nice value `nice` (0: unchanged)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as e:  # e.g. a sandbox that forbids it: serve anyway, at normal priority
        log.warning("could not lower the inference threads' priority: %s", e)
