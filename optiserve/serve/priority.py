"""CPU priority for inference threads, so the event loop that admits and rejects requests stays
responsive when inference has every core busy; and native thread names, so that `top -H`, /proc
and the benchmarks can tell inference (INFERENCE_THREAD) from request handling.

On Linux nice values are per thread and inherited by the threads a thread creates, so lowering
the priority of the thread that creates a session (and of the thread that runs its batches)
also lowers the runtime's own intra-op worker threads. Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

log = logging.getLogger("optiserve.serve")

INFERENCE_THREAD = "os-infer"   # the inference threads, and the runtimes' workers they start (names are inherited)
DECODE_THREAD = "os-decode"     # the threads that parse request bodies and decode images
PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Set the calling thread's name as the OS sees it (Linux; 15 characters). Threads it starts
    later inherit the name, as they inherit the nice value. Elsewhere, or if refused, a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def inference_thread(nice: int) -> None:
    """Initializer of the threads that create sessions or run batches: lower priority, and named."""
    name_native_thread(INFERENCE_THREAD)
    lower_thread_priority(nice)


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread (and the threads it starts later) nice value `nice` (0: unchanged)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as e:  # e.g. a sandbox that forbids it: serve anyway, at normal priority
        log.warning("could not lower the inference threads' priority: %s", e)
