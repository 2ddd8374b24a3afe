"""The artifact folder: variant files, manifest.json and report.md, published all at once.

Everything is written into a staging folder beside the target and swapped in at the end, so an
interrupted run leaves the previous folder (or none) and never a half-written manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterable

from optiserve.errors import UserError
from optiserve.files import atomic_write, current_umask, read_json_bytes, sha256_file

MANIFEST = "manifest.json"
FORMAT = "optiserve.manifest/1"


def versions(packages: Iterable[str]) -> dict:
    """Python's version and those of optiserve and `packages`, where installed."""
    out = {"python": platform.python_version()}
    for pkg in dict.fromkeys(("optiserve", *packages)):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


REPORTED_FACTS = ("backend", "precision", "accuracy", "size_bytes")


def reported_facts(entry: dict) -> dict:
    """What /stats and the A/B reports quote about a variant from its manifest entry (or from a
    /stats variant, which carries the same keys)."""
    return {k: entry.get(k) for k in REPORTED_FACTS}


def chosen_accuracy(entry: dict) -> dict | None:
    """The accuracy every decision about a variant reads (its gate, the frontier, tune's budget): the
    validation split's, where the manifest records it; a manifest from before it recorded both has
    only the one figure. `accuracy` itself is the test split's, which only reports."""
    validation = entry.get("validation")
    return validation.get("accuracy") if validation else entry.get("accuracy")


def file_facts(path: Path) -> dict:
    return {"sha256": sha256_file(path), "size_bytes": path.stat().st_size}


def _previous_versions(out: Path) -> list[Path]:
    """Folders a publish moved aside (`.NAME.old-PID`), newest first."""
    return sorted(out.parent.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def interrupted_publish(out: str | os.PathLike) -> Path | None:
    """The previous version a publish moved aside when it was interrupted between its two renames
    (no `out`, a complete `.out.old-PID` beside it); None when there is nothing to repair."""
    out = Path(out).absolute()
    if os.path.lexists(out):
        return None
    with contextlib.suppress(OSError):
        for old in _previous_versions(out):
            if (old / MANIFEST).is_file():
                return old
    return None


def interrupted_publishes(root: str | os.PathLike, listing: list[str] | None = None) -> dict[str, Path]:
    """The models of the repository `root` whose publish was interrupted (a `.NAME.old-PID` beside
    no NAME), by name, each with the previous version that would be put back. `listing`: the
    folder's entry names, when the caller has just listed it."""
    root = Path(root)
    names = {hidden[1:].rsplit(".old-", 1)[0] for hidden in (os.listdir(root) if listing is None else listing)
             if hidden.startswith(".") and ".old-" in hidden}
    found = {name: interrupted_publish(root / name) for name in sorted(names) if name}
    return {name: old for name, old in found.items() if old is not None}


def repair_interrupted_publish(out: str | os.PathLike) -> Path | None:
    """Put back the previous version an interrupted publish left under its hidden name (one atomic
    rename), so the folder is complete again. The writer's job (`optimize --out`, `optiserve repair`),
    never a reader's: readers may be on a read-only mount, and a rename could race a publisher.
    Returns the folder it put back, or None."""
    old = interrupted_publish(out)
    if old is not None:
        os.replace(old, Path(out).absolute())
    return old


@contextlib.contextmanager
def staging_folder(out: Path):
    """Yield an empty folder beside `out`; on success it replaces `out`, on failure it is removed.
    An interruption at any point leaves a complete folder at `out` (the old or the new one) or,
    between the two renames, one that `repair_interrupted_publish` puts back."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    repair_interrupted_publish(out)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".staging", dir=out.parent))
    try:
        # mkdtemp makes 0700: the published folder should read like any new folder (a server may
        # run as another uid, as a Kubernetes pod's runAsUser does)
        os.chmod(stage, 0o777 & ~current_umask())
        yield stage
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(stage, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in _previous_versions(out):  # from an earlier interrupted run
            shutil.rmtree(leftover, ignore_errors=True)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def publish_copy(source: str | os.PathLike, target: str | os.PathLike, note: str) -> None:
    """Publish a copy of the artifact folder `source` at `target` as a new version (its manifest's
    notes gain `note`, so its hash changes), swapped in the way `optimize --out` publishes: what a
    server following the folder sees as a new version to reload."""
    with staging_folder(Path(target)) as stage:
        shutil.copytree(source, stage, dirs_exist_ok=True)
        manifest = read_manifest(stage)
        manifest["notes"] = [*manifest.get("notes", []), note]
        write_manifest(stage, manifest)


def write_manifest(folder: Path, manifest: dict) -> None:
    with atomic_write(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


def image_model_only(manifest: dict, folder: str | os.PathLike, what: str) -> None:
    """One line where `what` (a pipeline's step) is asked of a text model's folder, which it does not
    take yet."""
    if (manifest.get("input") or {}).get("kind") == "text":
        raise UserError(f"{folder} holds a {manifest.get('task', 'text')} model; {what} takes image models for now")


def read_manifest(folder: str | os.PathLike, expected_sha256: str | None = None) -> dict:
    """The folder's manifest; with `expected_sha256`, only if manifest.json has exactly that hash
    (the manifest pins every variant file's hash in turn, so this pins the whole artifact)."""
    return read_manifest_versioned(folder, expected_sha256)[0]


def read_manifest_versioned(folder: str | os.PathLike, expected_sha256: str | None = None) -> tuple[dict, str]:
    """The manifest and the sha256 of manifest.json's bytes: the artifact's version, since the
    manifest pins every variant file's hash (a server reloads a model when it changes). Only reads:
    a folder left half-published is an error naming the repair, never repaired here."""
    path = Path(folder) / MANIFEST
    try:
        data = path.read_bytes()  # hashed and parsed from the same bytes
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(_not_an_artifact_folder(folder)) from None
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror or e}{_as_whom()}") from None
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256.strip().lower():
        raise UserError(f"{path} has sha256 {actual}, not the pinned {expected_sha256}: refusing to load it")
    manifest = read_json_bytes(data, path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{path} has format {found!r}, expected {FORMAT!r}")
    return manifest, actual


def _not_an_artifact_folder(folder: str | os.PathLike) -> str:
    old = interrupted_publish(folder)
    if old is not None:
        return (f"{folder} is missing: a publish was interrupted and left the previous version at {old.name}; "
                f"`optiserve repair {folder}` puts it back (or publish again)")
    return f"{folder} is not an artifact folder: no {MANIFEST} (write one with `optimize MODEL`)"


def _as_whom() -> str:
    """Who this process reads as, for a permission error (a container's uid is often not the files' owner)."""
    return f" (reading as uid {os.getuid()})" if hasattr(os, "getuid") else ""


def manifest_version(folder: str | os.PathLike) -> str | None:
    """sha256 of the folder's manifest.json, or None when it has none (cheap: what a poll compares)."""
    with contextlib.suppress(OSError):
        return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()
    return None


def is_artifact_folder(folder: str | os.PathLike) -> bool:
    """True when `folder` holds a manifest.json file; False for anything that cannot be checked."""
    return _manifest_problem(Path(folder)) is None


def _manifest_problem(folder: Path) -> str | None:
    """Why `folder` is not a readable artifact folder ("" when it simply has no manifest), or None
    when its manifest.json is a file. Never raises: a repository on a volume holds entries the
    server cannot read (an ext4 root's lost+found is root's, mode 700)."""
    try:
        st = os.stat(folder / MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except PermissionError:
        return f"cannot be read: permission denied{_as_whom()}"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    return None if stat.S_ISREG(st.st_mode) else f"its {MANIFEST} is not a file"


@dataclass(frozen=True)
class SkippedEntry:
    """An entry of a repository that is not served, and why; `looks_like_model` when the index should
    list it (a folder or link that could be one), not only the log."""

    name: str
    reason: str
    looks_like_model: bool


@dataclass
class RepositoryScan:
    models: dict[str, Path] = field(default_factory=dict)
    skipped: list[SkippedEntry] = field(default_factory=list)


def scan_models(path: str | os.PathLike) -> RepositoryScan:
    """The models under `path`, and every entry that is not one with the reason. An artifact folder
    is one model, named by its manifest; a repository is a folder of artifact folders, each a model
    named after its sub-folder. Hidden entries (a publish's staging folder and previous version) are
    not models; an entry that cannot be read is skipped, never an error. Only reads."""
    root = Path(path)
    if not os.path.isdir(root):
        old = interrupted_publish(root)
        if old is not None:
            raise UserError(_not_an_artifact_folder(root))
        raise UserError(f"{root} is not a folder: give an artifact folder written by `optimize` or a "
                        f"repository of them")
    problem = _manifest_problem(root)
    if problem is None:
        return RepositoryScan({str(read_manifest(root).get("model") or root.name): root})
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise UserError(f"{root} cannot be read: {e.strerror or e}{_as_whom()}") from None
    scan = RepositoryScan()
    for entry in entries:
        if entry.name.startswith("."):  # a publish's staging folder or previous version
            continue
        skipped = _entry_problem(root, entry)
        if skipped is None:
            scan.models[entry.name] = root / entry.name
        elif skipped.reason:
            scan.skipped.append(skipped)
    # a model whose publish stopped between its renames is not a model yet: the index says how to repair it
    scan.skipped += [SkippedEntry(name, f"a publish was interrupted: the previous version is at {old.name}; "
                                        f"`optiserve repair {root / name}` puts it back", True)
                     for name, old in interrupted_publishes(root, [e.name for e in entries]).items()]
    return scan


def _entry_problem(root: Path, entry: os.DirEntry) -> SkippedEntry | None:
    """None for a model folder; else why not (a SkippedEntry with reason "" for an ordinary folder
    without a manifest, which is not worth a word)."""
    name = entry.name
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return SkippedEntry(name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
                            "its name is not UTF-8 (a model's name is part of URLs)", False)
    try:
        is_link, is_dir = entry.is_symlink(), entry.is_dir()
    except OSError as e:
        return SkippedEntry(name, f"cannot be read: {e.strerror or e}", True)
    if is_link and not os.path.exists(root / name):
        with contextlib.suppress(OSError):
            return SkippedEntry(name, f"a symbolic link to {os.readlink(root / name)}, which does not exist", True)
        return SkippedEntry(name, "a symbolic link to something that does not exist", True)
    if not is_dir:
        return SkippedEntry(name, "a file, not a folder", False)
    problem = _manifest_problem(root / name)
    if problem is None:
        return None
    # an ext4 volume's lost+found (root's, mode 700) is no model: logged, not listed in the index
    return SkippedEntry(name, problem, name != "lost+found")


def find_models(path: str | os.PathLike) -> dict[str, Path]:
    """The models under `path` (see scan_models), by name."""
    return scan_models(path).models


def is_repository(path: str | os.PathLike) -> bool:
    """True for a folder of artifact folders, False for one artifact folder."""
    return os.path.isdir(path) and not is_artifact_folder(path)
