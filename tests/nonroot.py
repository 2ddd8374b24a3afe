"""Run a command as an unprivileged uid, the way a Kubernetes pod with `runAsUser: 1000` runs the
server. As root, the command runs in a private mount namespace where every folder on the way to
this Python and this checkout that the uid could not pass (e.g. /root, mode 700) is covered by a
traversable tmpfs with only the needed child bound back in: the host is not changed. As a
non-root user, the command runs as it is (it already is unprivileged)."""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

UID = 1000
ROOT = Path(__file__).resolve().parents[1]


def _needed_paths() -> list[Path]:
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent, ROOT}
    paths |= {Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    return sorted(paths)


def _blocked(paths: list[Path]) -> list[tuple[Path, str]]:
    """(folder, child) pairs where `folder` denies the uid passage (no o+x) on the way to a path."""
    blocked = set()
    for path in paths:
        for parent in reversed(path.parents):
            child = path.relative_to(parent).parts[0]
            if not os.stat(parent).st_mode & 0o001:
                blocked.add((parent, child))
    return sorted(blocked)


def why_not() -> str | None:
    """Why the tests cannot run a command as another uid here, or None."""
    if os.geteuid() != 0:
        return None
    for tool in ("unshare", "setpriv"):
        if not shutil.which(tool):
            return f"{tool} (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"private mount namespaces are refused here: {probe.stderr.strip()}"
    return None


def scratch_folder(prefix: str) -> Path:
    """A new folder under the system's temporary folder, which another uid can reach (pytest's
    tmp_path sits under a folder only its owner may enter), removed when the test process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def as_unprivileged(argv: list[str], extra_mounts: str = "") -> list[str]:
    """`argv` wrapped to run as uid 1000 (or unchanged when this process is not root). `extra_mounts`
    is shell run as root inside the namespace first (e.g. a read-only bind mount)."""
    if os.geteuid() != 0:
        return argv
    hold = str(scratch_folder("optiserve-nonroot-"))
    script = [f"mount -t tmpfs tmpfs {shlex.quote(hold)}"]
    for i, (folder, child) in enumerate(_blocked(_needed_paths())):
        keep, target = f"{hold}/{i}", shlex.quote(str(folder / child))
        script += [f"mkdir {keep}", f"mount --bind {target} {keep}",
                   f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(folder))}",
                   f"mkdir -p {target}", f"mount --bind {keep} {target}"]
    if extra_mounts:
        script.append(extra_mounts)
    script.append(f'exec setpriv --reuid={UID} --regid={UID} --clear-groups --inh-caps=-all "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", " && ".join(script), "sh", *argv]


def unprivileged_env(home: Path) -> dict:
    """The environment for it: a HOME the uid may write (caches), the rest as here."""
    return {**os.environ, "HOME": str(home), "MPLCONFIGDIR": str(home / ".mpl"), "PYTHONDONTWRITEBYTECODE": "1"}


def world_readable(path: Path) -> Path:
    """Let any uid read `path` (and pass through it): how a volume's files look to the pod's user."""
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | (0o555 if p.is_dir() else 0o444))
    return path
