"""What `optimize`'s recommendation gains over the best single engine a user would pick by hand,
measured side by side in one run on this machine.

The engine by hand: OpenVINO INT8 through NNCF's default post-training quantization of the
unpruned model's ONNX file, calibrated on the same training images, compiled with OpenVINO's own
defaults (no hints: it picks its inference precision — bf16 on a CPU with bf16 —, streams and
threads; what it picked is printed). The recommendation: what
`optimize MODEL --int8` recommends for throughput, with its search on (the default). Both are
loaded through the runtime layer and timed at batch 16 in interleaved rounds; accuracy is top-1 on
the held-out digits with its paired 95% interval against fp32 (agreement with fp32's top-1 where
the images are unlabelled).

    python benchmarks/search_vs_engines.py                   # resnet18 on digits, labelled and not
    python benchmarks/search_vs_engines.py --cases labelled  # one case
    python benchmarks/search_vs_engines.py --cases mobilenet,vit --size 64

The mobilenet and vit cases are torchvision's MobileNetV3-Small and a timm ViT-Tiny (6 blocks, 8x8
patches) trained here on the digits as RGB PNGs at --size (benchmarks/own_models.py's images and
training), then optimized from those weights like any user's model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optiserve.data import load_dataset  # noqa: E402
from optiserve.intervals import paired_accuracy_difference  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.models import InputOverrides  # noqa: E402
from optiserve.optimize.calibrate import calibration_batches  # noqa: E402
from optiserve.optimize.export_openvino import quantize_openvino_nncf  # noqa: E402
from optiserve.optimize.pipeline import OptimizeConfig, default_checkpoint, run_optimize  # noqa: E402
from optiserve.optimize.validate import materialize, predict  # noqa: E402
from optiserve.runtime import RuntimeOptions, load_session  # noqa: E402
from optiserve.runtime.timing import interleaved_times  # noqa: E402

BATCH = 16


def unlabelled_digits(folder: Path) -> str:
    """scikit-learn's digits as 8x8 grayscale PNGs in one folder: images with no labels."""
    from sklearn.datasets import load_digits

    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(load_digits().images):
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(folder / f"{i:04d}.png")
    return f"imagefolder:{folder}"


def recalibrate_batchnorm(model, work: Path, size: int) -> None:
    """BatchNorm statistics averaged over the whole training split: torchvision's MobileNetV3 keeps
    them with momentum 0.01, which a few hundred steps from scratch leave far from the data (its
    answers in eval mode stay at chance while training-mode ones are right)."""
    import torch

    from optiserve.data import load_dataset
    from optiserve.input_spec import IMAGENET_MEAN, IMAGENET_STD, InputSpec

    data = load_dataset(f"imagefolder:{work / 'digits'}", InputSpec((3, size, size), IMAGENET_MEAN, IMAGENET_STD), 10)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average
    model.train()
    with torch.no_grad():
        for images, _ in torch.utils.data.DataLoader(data.calibration_set(), batch_size=64):
            model(images)
    model.eval()


def trained_elsewhere(case: str, work: Path, size: int, epochs: int) -> tuple[str, str, dict]:
    """MODEL, --dataset and the rest of the options of a model trained here on the digits at `size`."""
    import torch
    import torchvision

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from own_models import NAMES, VIT, fine_tune, write_digits

    write_digits(work / "digits", size)
    labels = work / "labels.txt"
    labels.write_text("\n".join(NAMES) + "\n")
    torch.manual_seed(0)
    options = dict(labels=str(labels), input=InputOverrides((3, size, size)), num_classes=10)
    if case == "mobilenet":
        model = fine_tune(torchvision.models.mobilenet_v3_small(num_classes=10), work, size, epochs)
        recalibrate_batchnorm(model, work, size)
        name = "torchvision:mobilenet_v3_small"
    else:
        (work / "vit.py").write_text(VIT.replace("{size}", str(size)))
        sys.path.insert(0, str(work))
        from vit import build

        model = fine_tune(build(), work, size, 4 * epochs, lr=5e-4)  # from scratch: more epochs, a gentler rate
        name, options = f"{work / 'vit.py'}:build", {k: v for k, v in options.items() if k != "num_classes"}
    torch.save(model.state_dict(), work / "weights.pth")
    return name, f"imagefolder:{work / 'digits'}", {**options, "weights": str(work / "weights.pth")}


class EngineDefaults:
    """An OpenVINO IR as a user runs it by hand: `compile_model(xml, "CPU")` with no hints."""

    def __init__(self, xml: Path):
        import openvino as ov

        self.compiled = ov.Core().compile_model(str(xml), "CPU")
        self.request = self.compiled.create_infer_request()
        chose = {key: self.compiled.get_property(key) for key in
                 ("INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS")}
        self.chose = {key: v.to_string() if hasattr(v, "to_string") else str(v) for key, v in chose.items()}

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.request.infer({0: batch})[self.compiled.output(0)]


def measure(model: str, dataset: str, work: Path, rounds: int, weights: str | None, **options) -> dict:
    out = work / "art"
    started = time.perf_counter()
    manifest = run_optimize(OptimizeConfig(model, weights=weights, dataset=dataset, int8=True, search="on",
                                           latency_batch=BATCH, out=str(out), progress=True, **options))
    optimize_seconds = time.perf_counter() - started
    chosen = manifest["recommended"]["throughput"]
    entry = next(v for v in manifest["variants"] if v["name"] == chosen)
    spec = manifest["input"]
    from optiserve.input_spec import InputSpec

    data = load_dataset(dataset, InputSpec.from_dict(spec), len(manifest["classes"]))
    hand = work / "hand.openvino.xml"
    quantize_openvino_nncf(out / "model.onnx", hand, calibration_batches(data.calibration_set(), 256))
    options = RuntimeOptions(extra={"spin": False})
    pruned = [v for v in manifest["variants"] if v["name"] != chosen and v.get("status") == "accepted"
              and "search" in v.get("settings", {})]
    runner_up = min(pruned, key=lambda v: v["latency_ms"][str(BATCH)], default=None)  # where it is not the pick
    by_hand = EngineDefaults(hand)
    print(f"OpenVINO by hand chose: {by_hand.chose}")
    sessions = {
        f"by hand: OpenVINO INT8 (NNCF and OpenVINO defaults: {by_hand.chose['INFERENCE_PRECISION_HINT']}), "
        f"unpruned": by_hand,
        f"optimize's recommendation: {chosen}": load_session(out / entry["file"], entry, manifest, options),
        **({f"its fastest pruned candidate: {runner_up['name']}": load_session(out / runner_up["file"], runner_up,
                                                                               manifest, options)}
           if runner_up is not None and "search" not in entry.get("settings", {}) else {}),
        "fp32": load_session(out / "model.onnx", {"name": "onnx-fp32", "backend": "onnxruntime"}, manifest, options),
    }
    test = materialize(data.test, data.labelled)
    batch = np.resize(test.images, (BATCH, *test.images.shape[1:])).astype(np.float32)
    times = interleaved_times(sessions, batch, rounds, warmup=3)
    outputs = {name: predict(s, test.images).argmax(1) for name, s in sessions.items()}
    model_class = [manifest["classes"].index(c) if c in manifest["classes"] else -1 for c in data.classes]
    labelled = data.labelled and -1 not in model_class  # folders named after the model's classes
    truth = np.asarray(model_class)[test.labels] if labelled else outputs["fp32"]
    correct = {name: (o == truth).astype(np.float64) for name, o in outputs.items()}
    rows = {}
    for name in sessions:
        d = paired_accuracy_difference(correct["fp32"], correct[name])
        rows[name] = {"images_per_s": BATCH * 1000 / statistics.median(times[name]), "accuracy": correct[name].mean(),
                      "vs_fp32": d}
    return {"rows": rows, "optimize_seconds": optimize_seconds, "measure": "top-1" if labelled else
            "agreement with fp32's top-1", "chosen": chosen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="labelled,unlabelled")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--size", type=int, default=64, help="input side of the mobilenet and vit cases (default 64)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs of the mobilenet case (the vit: 4x)")
    args = p.parse_args()
    checkpoint = default_checkpoint("resnet18", "digits")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            work = Path(tmp) / case
            if case == "labelled":
                results[case] = measure("resnet18", "digits", work, args.rounds, None)
            elif case in ("mobilenet", "vit"):
                model, dataset, options = trained_elsewhere(case, work, args.size, args.epochs)
                weights = options.pop("weights")
                results[case] = measure(model, dataset, work, args.rounds, weights, **options)
            else:
                if not checkpoint.is_file():
                    raise SystemExit(f"run the labelled case first (it trains {checkpoint})")
                dataset = unlabelled_digits(work / "images")
                results[case] = measure("resnet18", dataset, work, args.rounds, str(checkpoint))
    print(f"\nCPU: {cpu_line()}")
    print(f"digits (labelled, unlabelled: ResNet-18 small-input; mobilenet, vit: {args.size}x{args.size} RGB), "
          f"images/s at batch {BATCH}: median of {args.rounds} interleaved rounds\n")
    print("| data | variant | images/s | vs by hand | accuracy | Δ vs fp32 [95% CI] |")
    print("|---|---|---|---|---|---|")
    for case, result in results.items():
        hand = next(r for name, r in result["rows"].items() if name.startswith("by hand"))
        for name, r in result["rows"].items():
            d = r["vs_fp32"]
            print(f"| {case} ({result['measure']}) | {name} | {r['images_per_s']:.0f} | "
                  f"{r['images_per_s'] / hand['images_per_s']:.2f}× | {100 * r['accuracy']:.2f}% | "
                  f"{d['points']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] |")
        print(f"| {case} | (optimize took {result['optimize_seconds']:.0f} s with its search) | | | | |")


if __name__ == "__main__":
    main()
