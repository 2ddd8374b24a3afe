"""`optiserve repair PATH`: put back what an interrupted publish moved aside, in an artifact folder
or in every model of a repository. Servers only read, so a crash between a publish's two renames
waits for a writer: the next `optimize --out` to the same folder, or this command."""

from __future__ import annotations

import argparse
from pathlib import Path

from optiserve.artifacts import interrupted_publishes, repair_interrupted_publish
from optiserve.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("path", metavar="PATH", help="an artifact folder, or a repository (a folder of them)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_dir() and not path.parent.is_dir():
        raise UserError(f"{path} is not a folder, and neither is {path.parent}")
    try:
        folders = [path, *(path / name for name in interrupted_publishes(path))] if path.is_dir() else [path]
        repaired = [(folder, old) for folder in folders if (old := repair_interrupted_publish(folder))]
    except PermissionError as e:
        raise UserError(f"cannot repair {path}: {e.strerror} ({e.filename}); run as the folder's owner") from None
    except OSError as e:
        raise UserError(f"cannot repair {path}: {e.strerror or e} ({e.filename})") from None
    for folder, old in repaired:
        print(f"repaired {folder}: put back the previous version from {old.name}")
    if not repaired:
        print(f"nothing to repair in {path}")
    return 0
