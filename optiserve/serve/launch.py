"""Run `optiserve serve` as a child process on loopback and wait until it is ready: what the
benchmarks and the tests do before they measure or call it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(base: str, within_s: float, proc: subprocess.Popen | None = None,
                     output: Callable[[], str] = lambda: "", path: str = "/v2/health/ready",
                     verify: ssl.SSLContext | bool = True) -> None:
    """Return once `base``path` (by default the readiness endpoint) answers 200; RuntimeError (with
    the end of `output()`) if `proc` exits first or `within_s` runs out. `verify`: an HTTPS server's
    trust (and client certificate), as httpx takes it."""
    import httpx

    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}{path}", timeout=1, verify=verify).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{output()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} was not ready within {within_s:g} s:\n{output()[-3000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen, within_s: float) -> None:
    """SIGTERM `proc` (the server drains and exits), and SIGKILL it if it has not exited within `within_s`."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_group(proc: subprocess.Popen, within_s: float, settle_s: float = 0.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), SIGKILL it if `proc`
    has not exited within `within_s`, and after `settle_s` SIGKILL whatever of the group outlived it
    (a server's workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(settle_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def served(folder: str | Path, *args: str, port: int | None = None, ready_within_s: float = 300,
           preexec_fn: Callable[[], None] | None = None, drain_seconds: float = 0,
           env: dict | None = None, cwd: str | Path | None = None, https_ca: str | None = None,
           https_client: tuple[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `optiserve serve FOLDER ARGS` on loopback `port` (default: a free one); yield (base URL, process) once
    /v2/health/ready answers 200; terminate it afterwards. There is no load balancer to drain from
    here, so the SIGTERM drain window is 0 s unless `drain_seconds` (or ARGS) say otherwise. `env` and
    `cwd` go to the process (another checkout's package comes first from its own folder). The server's
    output goes to a file (a pipe nobody reads could fill and block it) and is left on `process.output`
    at the end. With --tls-cert-file in ARGS the base URL is https, trusted through `https_ca` (with
    the client certificate and key `https_client` for mutual TLS)."""
    port = port or free_port()
    verify: ssl.SSLContext | bool = True
    if https_ca is not None:
        verify = ssl.create_default_context(cafile=https_ca)
        if https_client is not None:
            verify.load_cert_chain(*https_client)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "optiserve", "serve", str(folder), "--port", str(port),
                                 "--drain-seconds", f"{drain_seconds:g}", *args],
                                stdout=log, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn,
                                env=env, cwd=cwd)
        base = f"{'https' if '--tls-cert-file' in args else 'http'}://127.0.0.1:{port}"

        def output() -> str:
            log.seek(0)
            return log.read()

        try:
            wait_until_ready(base, ready_within_s, proc, output, verify=verify)
            yield base, proc
        finally:
            stop(proc, 60)
            proc.output = output()
