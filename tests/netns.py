"""Two test "nodes" on one machine: network namespaces joined by a veth pair, each with its own IP —
real node boundaries for what crosses a network (torchrun's rendezvous, Gloo, Ray), and a link that
can be cut. Needs root (`ip netns add`); `unavailable()` says why not where it is refused."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Node:
    namespace: str
    ip: str
    interface: str

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (for pytest.skip)."""
    if not shutil.which("ip"):
        return "iproute2's `ip` is not installed"
    name = f"osprobe{os.getpid()}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"network namespaces are refused here (`ip netns add`: {probe.stderr.strip()})"
    _ip("netns", "del", name, check=False)
    return None


@contextlib.contextmanager
def two_nodes(subnet: int = 77, host_link: bool = False, tag: str = "") -> Iterator[tuple[Node, Node]]:
    """Namespaces a and b, 10.<subnet>.<n>.1 and .2 on a veth pair; every process left inside them is
    killed and both are deleted afterwards. With `host_link`, this (the test's) namespace gets a
    veth of its own to a, and a route to a's address, so the test can call what listens on node a
    (nothing is forwarded to b). Pairs open at once in one process need their own `tag` (a letter or
    two: it goes into interface names, 15 characters at most)."""
    tag = f"{tag}{os.getpid() % 100000}"
    n = os.getpid() % 250 + 1
    a = Node(f"osa{tag}", f"10.{subnet}.{n}.1", f"vosa{tag}")
    b = Node(f"osb{tag}", f"10.{subnet}.{n}.2", f"vosb{tag}")
    host = f"vosh{tag}"
    try:
        for node in (a, b):
            _ip("netns", "add", node.namespace)
        _ip("link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface,
            "netns", b.namespace)
        for node in (a, b):
            _ip("-n", node.namespace, "addr", "add", f"{node.ip}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        if host_link:
            _ip("link", "add", host, "type", "veth", "peer", "name", f"vosx{tag}", "netns", a.namespace)
            _ip("addr", "add", f"10.{subnet + 1}.{n}.254/24", "dev", host)
            _ip("link", "set", host, "up")
            _ip("-n", a.namespace, "addr", "add", f"10.{subnet + 1}.{n}.1/24", "dev", f"vosx{tag}")
            _ip("-n", a.namespace, "link", "set", f"vosx{tag}", "up")
            _ip("route", "add", f"{a.ip}/32", "via", f"10.{subnet + 1}.{n}.1")
        yield a, b
    finally:
        for node in (a, b):
            kill_all(node)
            _ip("netns", "del", node.namespace, check=False)
        if host_link:
            _ip("link", "del", host, check=False)


def kill_all(node: Node) -> None:
    """SIGKILL every process in `node`'s namespace: the node dies. (Tools such as `ray stop` find
    their processes by name on the whole machine, the other node's included.)"""
    for pid in _ip("netns", "pids", node.namespace, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cut_link(node: Node) -> None:
    """Take `node`'s side of the link down: its peer keeps its address but nothing crosses any more
    (no FIN, no RST — what a pulled cable or a dead switch port looks like)."""
    _ip("-n", node.namespace, "link", "set", node.interface, "down")
