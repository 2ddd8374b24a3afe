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
import tempfile
from importlib import metadata
from pathlib import Path

from optiserve.errors import UserError
from optiserve.files import atomic_write, read_json_bytes, sha256_file

MANIFEST = "manifest.json"
FORMAT = "optiserve.manifest/1"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("optiserve", "torch", "torchvision", "onnx", "onnxruntime", "torch-tensorrt"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


REPORTED_FACTS = ("backend", "precision", "accuracy", "size_bytes")


def reported_facts(entry: dict) -> dict:
    """What /stats and the A/B reports quote about a variant from its manifest entry (or from a
    /stats variant, which carries the same keys)."""
    return {k: entry.get(k) for k in REPORTED_FACTS}


def file_facts(path: Path) -> dict:
    return {"sha256": sha256_file(path), "size_bytes": path.stat().st_size}


def _previous_versions(out: Path) -> list[Path]:
    """Folders a publish moved aside (`.NAME.old-PID`), newest first."""
    return sorted(out.parent.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def recover_interrupted_publish(out: str | os.PathLike) -> None:
    """A publish swaps two folders with two renames; a crash between them leaves no `out` and the
    previous version under its hidden name. Put that version back (one atomic rename), so whoever
    comes next — the next `optimize`, or a server — finds a complete folder."""
    out = Path(out).absolute()
    if not out.exists():
        for old in _previous_versions(out):
            if (old / MANIFEST).is_file():
                os.replace(old, out)
                break


@contextlib.contextmanager
def staging_folder(out: Path):
    """Yield an empty folder beside `out`; on success it replaces `out`, on failure it is removed.
    An interruption at any point leaves a complete folder at `out` (the old or the new one) or,
    between the two renames, one that `recover_interrupted_publish` puts back."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_publish(out)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".staging", dir=out.parent))
    try:
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


def read_manifest(folder: str | os.PathLike, expected_sha256: str | None = None) -> dict:
    """The folder's manifest; with `expected_sha256`, only if manifest.json has exactly that hash
    (the manifest pins every variant file's hash in turn, so this pins the whole artifact)."""
    return read_manifest_versioned(folder, expected_sha256)[0]


def read_manifest_versioned(folder: str | os.PathLike, expected_sha256: str | None = None) -> tuple[dict, str]:
    """The manifest and the sha256 of manifest.json's bytes: the artifact's version, since the
    manifest pins every variant file's hash (a server reloads a model when it changes)."""
    recover_interrupted_publish(folder)
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise UserError(f"{folder} is not an artifact folder: no {MANIFEST} (write one with `optimize MODEL`)")
    data = path.read_bytes()  # hashed and parsed from the same bytes
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256.strip().lower():
        raise UserError(f"{path} has sha256 {actual}, not the pinned {expected_sha256}: refusing to load it")
    manifest = read_json_bytes(data, path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{path} has format {found!r}, expected {FORMAT!r}")
    return manifest, actual


def manifest_version(folder: str | os.PathLike) -> str | None:
    """sha256 of the folder's manifest.json, or None when it has none (cheap: what a poll compares)."""
    with contextlib.suppress(OSError):
        return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()
    return None


def is_artifact_folder(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def find_models(path: str | os.PathLike) -> dict[str, Path]:
    """The models under `path`: an artifact folder is one model, named by its manifest; a repository
    is a folder of artifact folders, each a model named after its sub-folder. Hidden sub-folders
    (a publish's staging and previous versions) are not models."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"{root} is not a folder: give an artifact folder written by `optimize` or a "
                        f"repository of them")
    recover_interrupted_publish(root)
    if is_artifact_folder(root):
        return {str(read_manifest(root).get("model") or root.name): root}
    return {sub.name: sub for sub in sorted(root.iterdir())
            if sub.is_dir() and not sub.name.startswith(".") and is_artifact_folder(sub)}


def is_repository(path: str | os.PathLike) -> bool:
    """True for a folder of artifact folders, False for one artifact folder."""
    return Path(path).is_dir() and not is_artifact_folder(path)
