"""Choose, verify, load and warm up an artifact folder's variants: what the server, the benchmarks and
anything else that runs a variant do before the first timed or served batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optiserve.errors import UserError
from optiserve.files import sha256_file
from optiserve.machine import bf16_missing
from optiserve.runtime import RuntimeOptions, Session, get_backend, load_session

log = logging.getLogger("optiserve.runtime")


def select_variants(manifest: dict, names: list[str] | None) -> list[dict]:
    """The manifest entries to serve: the named ones (any status, with a warning), else every
    accepted variant whose backend can run on this machine."""
    by_name = {v["name"]: v for v in manifest["variants"]}
    if names:
        chosen = []
        for name in names:
            if name not in by_name:
                raise UserError(f"unknown variant {name!r}; the manifest has: {', '.join(by_name)}")
            entry = by_name[name]
            why = cannot_run_here(entry)
            if why:
                raise UserError(f"variant {name!r} cannot run here: {why}")
            if entry["status"] != "accepted":
                log.warning("serving %s although optimize marked it %s (%s)", name, entry["status"],
                            entry.get("reason") or "no reason given")
            chosen.append(entry)
        return chosen
    chosen = []
    for v in manifest["variants"]:
        if v["status"] != "accepted":
            continue
        why = cannot_run_here(v)
        if why:
            log.info("not serving %s: %s", v["name"], why)
        else:
            chosen.append(v)
    if not chosen:
        statuses = ", ".join(f"{v['name']}={v['status']}" for v in manifest["variants"])
        raise UserError(f"no accepted variant can run here ({statuses}); name the ones to serve with --variants")
    return chosen


def cannot_run_here(entry: dict) -> str | None:
    """Why a variant cannot run on this machine, or None: its backend is missing, or it computes in
    bf16 on a CPU without bf16 (as optiserve.machine says, detected or stated). A variant validated
    on a GPU is not held to the CPU's flags."""
    why = get_backend(entry["backend"]).unavailable()
    if why is None and entry.get("precision") == "bf16" and entry.get("device", "cpu") == "cpu":
        why = bf16_missing()
    return why


@dataclass
class LoadedVariant:
    name: str
    entry: dict
    session: Session


def load_verified(folder: Path, entry: dict, manifest: dict, options: RuntimeOptions) -> LoadedVariant:
    """Check the file (and its companions, e.g. an OpenVINO IR's .bin) against the manifest's sha256,
    then load it through the runtime layer. Every file must lie inside the folder: a manifest is
    data, and must not make the server read another model's files (or anything else)."""
    path = inside_folder(folder, entry["file"], entry["name"])
    files = [(path, entry["sha256"])] + [(inside_folder(folder, name, entry["name"]), facts["sha256"])
                                         for name, facts in (entry.get("companions") or {}).items()]
    for file, expected in files:
        if not file.is_file():
            raise UserError(f"variant {entry['name']!r}: {file} is missing")
        if sha256_file(file) != expected:
            raise UserError(f"variant {entry['name']!r}: {file} does not match the manifest's sha256 "
                            f"(changed since optimize wrote it); re-run optimize")
    return LoadedVariant(entry["name"], entry, load_session(path, entry, manifest, options))


def inside_folder(folder: Path, name, variant: str) -> Path:
    """`folder / name`, refused unless it is a relative path that stays in the folder once every
    symbolic link is followed (no `..`, no absolute path, no link leading out)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise UserError(f"variant {variant!r}: the manifest names the file {name!r}, which is outside the model "
                        f"folder: a variant's files must be relative paths inside {folder}")
    base = Path(folder).resolve()
    path = (base / name).resolve()
    if path != base and base not in path.parents:
        raise UserError(f"variant {variant!r}: the manifest names the file {name!r}, which is outside the model "
                        f"folder {folder} (it leads to {path}): a variant's files must lie inside its folder")
    return Path(folder) / name


def warm_up(variant: LoadedVariant, shape: list[int], batch_sizes: list[int]) -> None:
    """Run the batch sizes the server will form, before reporting ready, as many times as the backend
    needs (ONNX Runtime and OpenVINO are warm after one run at a shape, a TorchScript graph after
    two): each size, or those the backend says a session on its device needs (ONNX Runtime on the
    CPU: the smallest only, its first run; after it, a new batch size runs as fast as a warm one)."""
    backend = get_backend(variant.entry["backend"])
    batch_sizes = backend.warm_sizes(list(batch_sizes), variant.session.device)
    rng = np.random.default_rng(0)
    warm_up_on(variant, [rng.standard_normal((b, *shape), dtype=np.float32) for b in batch_sizes])


def warm_up_on(variant: LoadedVariant, batches: list[np.ndarray]) -> None:
    """Run each of `batches` as many times as the variant's backend needs before it is warm at that
    shape (a text model's token batches, whose sequence length is a shape of its own, too)."""
    for x in batches:
        for _ in range(get_backend(variant.entry["backend"]).warm_up_runs):
            variant.session.run(x)
