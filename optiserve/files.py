"""File helpers: atomic writes (an interrupted run never leaves half a file), hashes, and JSON reads with a clear error."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from optiserve.errors import UserError


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Open a temporary file beside `path`, yield it, then fsync and rename it over `path`.

    On any exception the temporary file is removed and `path` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; the result should read like any new file
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def current_umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_of(parts: Iterable[bytes]) -> str:
    """The SHA-256 of a sequence of byte strings, each after its length (so no two sequences that
    differ share one)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def read_json(path: str | os.PathLike):
    """Parse a JSON file; anything that is not JSON text is one clear UserError, not a traceback."""
    return read_json_bytes(Path(path).read_bytes(), path)


def read_small_json(path: str | os.PathLike, max_bytes: int, what: str):
    """Parse a settings file of at most `max_bytes`; a UserError naming the file and what is wrong
    with it (too long, unreadable, not JSON, nested too deeply to be `what`)."""
    path = Path(path)
    name = path.name
    try:
        if path.stat().st_size > max_bytes:
            raise UserError(f"{name} is over {max_bytes:,} bytes")
        return json.loads(path.read_bytes())
    except OSError as e:
        raise UserError(f"{name} cannot be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise UserError(f"{name} is nested too deeply to be {what}") from None


def read_json_bytes(data: bytes, path: str | os.PathLike):
    """Parse JSON read from `path` (named in the error)."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
