"""The artifact folder's manifest: what was built, how each variant was judged and timed, on which
machine, and the notes the report prints from it."""

from __future__ import annotations

import time

import torch

from optiserve import artifacts
from optiserve.machine import cpu_facts, usable_cores
from optiserve.models import model_slug
from optiserve.optimize.export_onnx import OUTPUT_NAME
from optiserve.runtime import engine_packages
from optiserve.tasks import gate_minimums

BASELINE = "fp32"  # the variant a torch model's others are checked against
BUILT_WITH = ("torch", "torchvision", "onnx", "nncf", "torch-pruning")  # beside the engines the variants run on


def build_manifest(loaded, data, entries, recommended, cfg, why_not, notes, n_validation, n_test) -> dict:
    """The manifest of a run: the model, its input and outputs, the data, every variant's entry."""
    return {
        "format": artifacts.FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_slug(loaded.name),  # the name it is served under; the MODEL it came from is in `source`
        "task": loaded.task,
        "input": loaded.input.to_dict(),
        "input_name": loaded.source.get("input_name", "input"),  # what the protocol serves it as
        "classes": loaded.classes,
        "output_width": loaded.output_width,
        "output_shape": list(loaded.output_shape),
        # every output the model serves, the one the task reads first (served under the task's names)
        "outputs": loaded.outputs or [{"name": OUTPUT_NAME, "dtype": "float32", "shape": list(loaded.output_shape)}],
        "source": {"model": loaded.name, **loaded.source},
        # the three roles: train fits (calibration, recovery), validation chooses, test only reports
        "dataset": {"name": data.name, "calibration_split": "train", "choose_split": "val",
                    "choose_images": n_validation, "eval_split": "test", "eval_images": n_test,
                    **({"split_note": data.split_note} if data.split_note else {})},
        "accuracy_meaningful": not why_not,
        "accuracy_note": why_not or None,
        "baseline": BASELINE,
        "max_accuracy_drop": cfg.max_accuracy_drop,
        **{minimum.name: getattr(cfg, minimum.name) for _, minimum in gate_minimums()},
        "latency_batch": cfg.latency_batch,
        "threads": usable_cores(),  # intra-op threads every variant was timed with
        "versions": artifacts.versions((*BUILT_WITH, *engine_packages({e["backend"] for e in entries}))),
        "machine": machine(entries),
        "recommended": recommended,
        "notes": notes,
        "variants": entries,
    }


def machine(entries: list[dict]) -> dict:
    """The CPU, and the GPU too when variants were timed on it."""
    facts = cpu_facts()
    if any(e.get("device") == "cuda" for e in entries):
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def device_note(entries: list[dict]) -> list[str]:
    """Say so when variants were validated and timed on different devices (a GPU run with CPU-only INT8)."""
    devices = {e["name"]: e["device"] for e in entries}
    if len(set(devices.values())) < 2:
        return []
    return ["devices: " + ", ".join(f"{name} on {device}" for name, device in devices.items())
            + " (PyTorch's INT8 kernels run on the CPU only; their latency is a CPU figure)"]


def int8_comparison(entries: list[dict], n: int) -> list[str]:
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
