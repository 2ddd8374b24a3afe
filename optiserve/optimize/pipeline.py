"""`optimize`: model -> fused -> TorchScript / ONNX / INT8 variants -> validated artifact folder."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from optiserve.data import DatasetSplits, load_dataset
from optiserve.errors import UserError
from optiserve.models import LoadedModel, get_model_entry, load_model
from optiserve.optimize import artifacts
from optiserve.optimize.calibrate import calibration_batches
from optiserve.optimize.export_onnx import export_onnx
from optiserve.optimize.fuse import count_batchnorms, fuse_conv_bn
from optiserve.optimize.progress import PassLog
from optiserve.optimize.quantize_ort import CALIB_METHODS, quantize_onnx_static
from optiserve.optimize.quantize_torch import quantize_torch_fx
from optiserve.optimize.trace import save_torchscript, trace_torchscript
from optiserve.optimize.validate import EvalSet, gate, materialize, predict, score
from optiserve.runtime import RuntimeOptions, load_session
from optiserve.runtime.timing import median_latency_ms

BASELINE = "fp32"


@dataclass
class OptimizeConfig:
    model: str
    weights: str | None = None        # None: the trained digits checkpoint (trained on demand) or the model default
    dataset: str = "digits"
    int8: bool = False
    onnx: bool = True
    calib_size: int = 256
    calib_method: str = "minmax"
    max_accuracy_drop: float = 1.0    # percentage points of top-1
    latency_batch: int = 16
    out: str | None = None
    device: str = "auto"
    progress: bool = True

    def validate(self) -> None:
        get_model_entry(self.model)
        if self.calib_method not in CALIB_METHODS:
            raise UserError(f"unknown --calib-method {self.calib_method!r}; use {', '.join(CALIB_METHODS)}")
        if self.calib_size < 1:
            raise UserError(f"--calib-size must be at least 1, got {self.calib_size}")
        if self.max_accuracy_drop < 0:
            raise UserError(f"--max-accuracy-drop must be >= 0 points, got {self.max_accuracy_drop}")
        if self.latency_batch < 1:
            raise UserError(f"--latency-batch must be at least 1, got {self.latency_batch}")

    @property
    def out_path(self) -> Path:
        if self.out:
            return Path(self.out)
        data = Path(self.dataset.split(":", 1)[1]).name if ":" in self.dataset else self.dataset
        return Path("artifacts") / f"{self.model}-{data}"


@dataclass
class Variant:
    name: str
    file: str
    backend: str
    precision: str
    settings: dict = field(default_factory=dict)


def default_checkpoint(model: str, dataset: str) -> Path:
    return Path("checkpoints") / f"{model}-{dataset}.pt"


def resolve_weights(cfg: OptimizeConfig, log: PassLog) -> LoadedModel:
    """Load the weights; for the bundled digits data, train a checkpoint first when there is none yet."""
    weights = cfg.weights
    if weights is None and cfg.dataset == "digits":
        ckpt = default_checkpoint(cfg.model, "digits")
        if not ckpt.is_file():
            from optiserve.train import TrainConfig, train

            log.note(f"no trained checkpoint at {ckpt}: training {cfg.model} on digits first "
                     f"(optiserve train {cfg.model} --dataset digits)")
            train(TrainConfig(model=cfg.model, dataset="digits", out=str(ckpt), progress=cfg.progress))
        weights = str(ckpt)
    return load_model(cfg.model, weights)


def _check_compatible(loaded: LoadedModel, data: DatasetSplits) -> str:
    """'' when accuracy on `data` is meaningful for `loaded`, else why not. Raises on unusable pairs."""
    if tuple(loaded.input.shape) != tuple(data.input.shape):
        raise UserError(f"the model takes input {list(loaded.input.shape)} but dataset {data.name} gives "
                        f"{list(data.input.shape)}; use the dataset the checkpoint was trained on")
    if not loaded.accuracy_meaningful:
        return "random weights: accuracy is meaningless"
    if not data.labelled:
        return f"dataset {data.name} has no labels"
    if list(data.classes) != list(loaded.classes):
        return f"dataset {data.name} has other classes than the model"
    return ""


def run_optimize(cfg: OptimizeConfig) -> dict:
    """Build, validate and publish every requested variant; returns the manifest."""
    cfg.validate()
    steps = 7 + cfg.onnx + (cfg.int8 and cfg.onnx) + cfg.int8
    log = PassLog(steps, enabled=cfg.progress)
    with log.step(f"load {cfg.model} ({cfg.weights or 'default weights'})"):
        loaded = resolve_weights(cfg, log)
    with log.step(f"load dataset {cfg.dataset}"):
        data = load_dataset(cfg.dataset, loaded.input, len(loaded.classes))
        why_not = _check_compatible(loaded, data)
        evalset = materialize(data.test, data.labelled)
    log.note(f"{len(evalset.images)} held-out test images; calibration draws from the train split")

    torch.manual_seed(0)
    example = torch.from_numpy(evalset.images[:4])
    out = cfg.out_path
    with artifacts.staging_folder(out) as stage:
        variants: list[Variant] = []
        notes: list[str] = []
        with log.step("fp32 baseline (eager state dict)"):
            torch.save(loaded.model.state_dict(), stage / "fp32.pt")
            variants.append(Variant(BASELINE, "fp32.pt", "torch", "fp32"))
        with log.step("fuse conv+BN"):
            fused = fuse_conv_bn(loaded.model)
            probe = torch.randn(8, *loaded.input.shape)
            with torch.no_grad():
                diff = (fused(probe) - loaded.model(probe)).abs().max().item()
            notes.append(f"conv+BN fusion folded {count_batchnorms(loaded.model)} BatchNorms "
                         f"({count_batchnorms(fused)} left); max |Δ| on random inputs {diff:.1e}")
        with log.step("TorchScript (trace, check, freeze)"):
            check = torch.from_numpy(evalset.images[-4:])
            save_torchscript(trace_torchscript(fused, example, (check,)), stage / "torchscript.pt")
            variants.append(Variant("torchscript", "torchscript.pt", "torchscript", "fp32",
                                    {"fused_conv_bn": True, "frozen": True, "optimize_for_inference": True}))
        if cfg.onnx:
            with log.step("ONNX export (opset 18, dynamic batch)"):
                export_diff = export_onnx(fused, example, stage / "model.onnx")
                variants.append(Variant("onnx-fp32", "model.onnx", "onnxruntime", "fp32",
                                        {"opset": 18, "fused_conv_bn": True, "graph_optimization": "all"}))
                notes.append(f"ONNX export parity with eager: max |Δ| {export_diff:.1e}")
        if cfg.int8:
            batches = calibration_batches(data.calibration_set(), cfg.calib_size)
            if cfg.onnx:
                with log.step(f"INT8 ONNX Runtime (static QDQ, {cfg.calib_method} calibration, "
                              f"{cfg.calib_size} train images)"):
                    settings = quantize_onnx_static(stage / "model.onnx", stage / "model.int8.onnx", batches,
                                                    cfg.calib_method)
                    variants.append(Variant("onnx-int8", "model.int8.onnx", "onnxruntime", "int8", settings))
            with log.step(f"INT8 PyTorch x86 (FX graph mode, {cfg.calib_size} train images)"):
                scripted, settings = quantize_torch_fx(fused, batches)
                save_torchscript(scripted, stage / "torch-int8.pt")
                variants.append(Variant("torch-int8", "torch-int8.pt", "torchscript", "int8", settings))

        with log.step(f"validate {len(variants)} variants through the runtime (accuracy, latency)"):
            entries = _validate(variants, stage, loaded, evalset, cfg, why_not)
            notes += _int8_comparison(entries, cfg.latency_batch)
        with log.step(f"write {out}"):
            manifest = _manifest(loaded, data, entries, cfg, why_not, notes, len(evalset.images))
            artifacts.write_manifest(stage, manifest)
            (stage / "report.md").write_text(render_report(manifest))
    return manifest


def _validate(variants, stage, loaded, evalset: EvalSet, cfg: OptimizeConfig, why_not: str) -> list[dict]:
    base_manifest = {"model": loaded.name, "classes": loaded.classes, "input": loaded.input.to_dict()}
    options = RuntimeOptions(device=cfg.device)
    batch1 = evalset.images[:1]
    batch_n = np.resize(evalset.images, (cfg.latency_batch, *evalset.images.shape[1:])).astype(np.float32)
    entries, reference, baseline_top1 = [], None, None
    for v in variants:
        entry = {"name": v.name, "file": v.file, "backend": v.backend, "precision": v.precision,
                 **artifacts.file_facts(stage / v.file), "settings": v.settings}
        session = load_session(stage / v.file, entry, base_manifest, options)
        logits = predict(session, evalset.images)
        if reference is None:
            reference = logits
        entry["accuracy"] = score(logits, reference, evalset.labels)
        if v.name == BASELINE:
            baseline_top1 = entry["accuracy"]["top1"]
        entry["latency_ms"] = {"1": median_latency_ms(session, batch1),
                               str(cfg.latency_batch): median_latency_ms(session, batch_n)}
        entry["status"], entry["reason"] = gate(entry["accuracy"], baseline_top1, cfg.max_accuracy_drop,
                                                not why_not, why_not)
        entries.append(entry)
    return entries


def _int8_comparison(entries: list[dict], n: int) -> list[str]:
    """Which INT8 flow is faster on this machine, at batch 1 and batch n."""
    by_name = {e["name"]: e for e in entries}
    if not {"onnx-int8", "torch-int8"} <= set(by_name):
        return []
    parts = []
    for b in ("1", str(n)):
        ort_ms, torch_ms = by_name["onnx-int8"]["latency_ms"][b], by_name["torch-int8"]["latency_ms"][b]
        faster, ratio = ("onnx-int8", torch_ms / ort_ms) if ort_ms <= torch_ms else ("torch-int8", ort_ms / torch_ms)
        parts.append(f"batch {b}: {faster} {ratio:.2f}× faster ({ort_ms:.2f} vs {torch_ms:.2f} ms)")
    return ["INT8 flows on this machine (onnx-int8 vs torch-int8): " + "; ".join(parts)]


def _manifest(loaded, data, entries, cfg, why_not, notes, n_eval) -> dict:
    return {
        "format": artifacts.FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": loaded.name,
        "input": loaded.input.to_dict(),
        "classes": loaded.classes,
        "source": loaded.source,
        "dataset": {"name": data.name, "eval_split": "test", "eval_images": n_eval, "calibration_split": "train"},
        "accuracy_meaningful": not why_not,
        "accuracy_note": why_not or None,
        "baseline": BASELINE,
        "max_accuracy_drop": cfg.max_accuracy_drop,
        "latency_batch": cfg.latency_batch,
        "versions": artifacts.versions(),
        "notes": notes,
        "variants": entries,
    }


def summary_rows(manifest: dict) -> list[list[str]]:
    """The table `optimize` prints and report.md shows, one row per variant."""
    n = str(manifest["latency_batch"])
    base = next(v for v in manifest["variants"] if v["name"] == manifest["baseline"])
    rows = []
    for v in manifest["variants"]:
        acc = v["accuracy"]
        top1 = "—" if acc["top1"] is None else f"{100 * acc['top1']:.2f}%"
        delta = "—" if acc["top1"] is None else f"{100 * (acc['top1'] - base['accuracy']['top1']):+.2f}"
        lat1, latn = v["latency_ms"]["1"], v["latency_ms"][n]
        rows.append([v["name"], v["backend"], v["precision"], top1, f"{100 * acc['agreement']:.1f}%", delta,
                     _size(v["size_bytes"]), f"{lat1:.2f}", f"{latn:.2f}",
                     f"{base['latency_ms']['1'] / lat1:.2f}× / {base['latency_ms'][n] / latn:.2f}×", v["status"]])
    return rows


def summary_header(manifest: dict) -> list[str]:
    n = manifest["latency_batch"]
    return ["variant", "backend", "precision", "top-1", "agree fp32", "Δ top-1", "size", "p50 ms b1",
            f"p50 ms b{n}", f"speedup b1 / b{n}", "status"]


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def render_report(manifest: dict) -> str:
    header, rows = summary_header(manifest), summary_rows(manifest)
    lines = [f"# optimize report: {manifest['model']} on {manifest['dataset']['name']}", "",
             f"Weights: `{manifest['source']['weights']}`. Accuracy on {manifest['dataset']['eval_images']} held-out "
             f"test images; latency is the median of repeated runs after warm-up, through the same runtime "
             f"layer the server uses.", ""]
    if not manifest["accuracy_meaningful"]:
        lines += [f"**Accuracy is not validated here: {manifest['accuracy_note']}.** Agreement and max |Δ| "
                  f"against fp32 are still measured.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    rejected = [v for v in manifest["variants"] if v["status"] == "rejected"]
    if rejected:
        lines += [""] + [f"- **{v['name']} rejected**: {v['reason']}; not served by default." for v in rejected]
    lines += ["", "Notes:"] + [f"- {n}" for n in manifest["notes"]]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()), ""]
    return "\n".join(lines)
