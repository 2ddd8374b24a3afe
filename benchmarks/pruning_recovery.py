"""How a structured-pruned model recovers: no recovery, fine-tuning on the labels alone, and
distillation from the unpruned model with and without the labels, side by side in one run on the
same pruned copies of the digits ResNet-18 (trained first where there is no checkpoint yet).

    python benchmarks/pruning_recovery.py                      # ratios 0.5, 0.7, 0.85; 5 epochs
    python benchmarks/pruning_recovery.py --ratios 0.5 --epochs 3

Prints, per ratio, the multiply-adds kept and the test top-1 (with its paired 95% interval against
the unpruned model's) of each recovery, and the seconds each took on this machine.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optiserve.data import load_dataset, make_loader  # noqa: E402
from optiserve.intervals import paired_accuracy_difference  # noqa: E402
from optiserve.machine import cpu_line  # noqa: E402
from optiserve.models import load_model  # noqa: E402
from optiserve.optimize.prune_channels import count_flops, prune_channels  # noqa: E402
from optiserve.optimize.validate import materialize  # noqa: E402
from optiserve.train.distill import distill, recovery_optimizer  # noqa: E402
from optiserve.train.schedule import warmup_cosine  # noqa: E402

CHECKPOINT = Path("checkpoints/resnet18-digits.pt")


def labels_only(model: torch.nn.Module, data, epochs: int, batch_size: int = 64) -> None:
    """Cross-entropy on the labels with distill's optimizer, schedule and batches: the one change is
    what is learned."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    loader = make_loader(data.train, batch_size, torch.device("cpu"), workers=0,
                         sampler=torch.utils.data.RandomSampler(data.train, generator=g), drop_last=True)
    optimizer = recovery_optimizer(model, batch_size)
    scheduler = warmup_cosine(optimizer, epochs * len(loader), warmup_steps=0)
    model.train()
    for _ in range(epochs):
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", default="0.5,0.7,0.85")
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args()
    if not CHECKPOINT.is_file():
        from optiserve.train import TrainConfig, train

        train(TrainConfig(model="resnet18", dataset="digits", out=str(CHECKPOINT)))
    loaded = load_model("resnet18", str(CHECKPOINT))
    teacher = loaded.model.eval()
    data = load_dataset("digits", loaded.input, len(loaded.classes))
    test = materialize(data.test, True)
    images, truth = torch.from_numpy(test.images), test.labels

    def correct(model) -> np.ndarray:
        with torch.no_grad():
            return (model.eval()(images).argmax(1).numpy() == truth).astype(np.float64)

    base = correct(teacher)
    print(f"CPU: {cpu_line()}")
    print(f"digits ResNet-18, {len(truth)} test images, unpruned top-1 {100 * base.mean():.2f}%, "
          f"{args.epochs} epochs of recovery\n")
    print("| channels removed | MACs kept | recovery | test top-1 | vs unpruned [95% CI] | seconds |")
    print("|---|---|---|---|---|---|")
    recoveries = {
        "none": lambda m: None,
        "labels only (cross-entropy)": lambda m: labels_only(m, data, args.epochs),
        "distillation + labels": lambda m: distill(m, teacher, data, "class-scores", args.epochs,
                                                   label_mapping=np.arange(10), progress=False),
        "distillation, no labels": lambda m: distill(m, teacher, data, "class-scores", args.epochs, progress=False),
    }
    for ratio in (float(r) for r in args.ratios.split(",")):
        pruned, _ = prune_channels(teacher, ratio, images[:2])
        kept = count_flops(pruned, images[:1]) / count_flops(teacher, images[:1])
        for name, recover in recoveries.items():
            model = copy.deepcopy(pruned)
            start = time.perf_counter()
            recover(model)
            seconds = time.perf_counter() - start
            ok = correct(model)
            d = paired_accuracy_difference(base, ok)
            print(f"| {ratio:.0%} | {kept:.0%} | {name} | {100 * ok.mean():.2f}% | {d['points']:+.2f} "
                  f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] | {seconds:.0f} |")


if __name__ == "__main__":
    main()
