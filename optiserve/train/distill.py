"""Recovery after pruning without labels: the pruned model (the student) learns to answer as the
model it was pruned from (the teacher) on the training images — knowledge distillation — plus the
labels where the data has them. What is matched is the task's declaration (`Task.distills`):
class scores along axis 1 (a classifier's, or a segmenter's per pixel), matched as the distribution
their output kind (tasks/output_kinds.py) stands for, or vectors (an embedding).
`recover` repeats it in rounds, each twice as long, while the student is not yet good enough.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import RandomSampler
from tqdm import tqdm

from optiserve.data import DatasetSplits, default_workers, make_loader
from optiserve.data.length_grouped import LengthGroupedSampler, token_lengths
from optiserve.registry import Registry
from optiserve.tasks.output_kinds import get_output_kind, kinds_matching
from optiserve.train.distributed import resolve_device
from optiserve.train.schedule import scaled_lr, warmup_cosine

TEMPERATURE = 2.0  # softens logits so the teacher's near-misses carry over, as Hinton et al. do
EPS = 1e-6

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (student output, teacher output) -> scalar
_MATCHES: Registry[Callable[[str], Loss]] = Registry("distillation target")


def _two_classes(log_p: torch.Tensor, log_not_p: torch.Tensor) -> torch.Tensor:
    """A one-channel score's two-class distribution along axis 1: [not it, it], so class 1 is the
    foreground a label of 1 names."""
    return torch.cat([log_not_p, log_p], dim=1)


def _from_logits(out: torch.Tensor, temperature: float) -> torch.Tensor:
    if out.shape[1] == 1:
        return _two_classes(F.logsigmoid(out / temperature), F.logsigmoid(-out / temperature))
    return F.log_softmax(out / temperature, dim=1)


def _from_probabilities(out: torch.Tensor, temperature: float) -> torch.Tensor:
    if out.shape[1] == 1:
        p = out.clamp(EPS, 1 - EPS)
        return _two_classes(p.log(), (1 - p).log())
    return out.clamp_min(EPS).log()


def _from_log_probabilities(out: torch.Tensor, temperature: float) -> torch.Tensor:
    if out.shape[1] == 1:
        log_p = out.clamp(max=-EPS)  # log(1 - p) from log p without losing p near 0 or 1
        return _two_classes(log_p, torch.where(log_p > -0.693, torch.log(-torch.expm1(log_p)),
                                               torch.log1p(-torch.exp(log_p))))
    return out


def _from_independent_probabilities(out: torch.Tensor, temperature: float) -> torch.Tensor:
    """K independent probabilities (multi-label): each class its own two-class distribution, [N, 2, K]
    (not it, it) along axis 1, so the KL is summed per class and averaged over images and classes."""
    p = out.clamp(EPS, 1 - EPS)
    return torch.stack([(1 - p).log(), p.log()], dim=1)


# Log-probabilities along axis 1 of the distribution class scores of each output kind stand for
# (output_kinds.py's names), what distillation matches; a kind missing here is refused by name.
_DISTRIBUTIONS: Registry[Callable[[torch.Tensor, float], torch.Tensor]] = Registry(
    "output kind for distillation (train/distill.py's _DISTRIBUTIONS)")
_DISTRIBUTIONS.register("logits", _from_logits)
_DISTRIBUTIONS.register("probabilities", _from_probabilities)
_DISTRIBUTIONS.register("log_probabilities", _from_log_probabilities)
_DISTRIBUTIONS.register("multi_label", _from_independent_probabilities)
TEMPERATURES = {"logits": TEMPERATURE}  # only logits are softened; other kinds are matched as they are


def _log_probabilities(out: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Log-probabilities along axis 1 of class scores that hold `kind` (a name in output_kinds.py's
    registry; one channel becomes its two-class form)."""
    return _DISTRIBUTIONS.get(get_output_kind(kind).name)(out, temperature)


def _class_scores(kind: str) -> Loss:
    """KL divergence of the student's class distribution from the teacher's, per image (or pixel);
    a one-channel map (a foreground score) is matched as the two-class distribution it is."""
    _DISTRIBUTIONS.get(get_output_kind(kind).name)  # an unknown kind is refused before training starts
    temperature = TEMPERATURES.get(kind, 1.0)

    def loss(student, teacher):
        s, t = _log_probabilities(student, kind, temperature), _log_probabilities(teacher, kind, temperature)
        per_position = F.kl_div(s, t, log_target=True, reduction="none").sum(1)
        return per_position.mean() * temperature ** 2

    return loss


def _vectors(kind: str) -> Loss:
    """One minus the cosine similarity of the student's vector to the teacher's (what the
    embedding gate measures)."""
    return lambda student, teacher: (1 - F.cosine_similarity(student.flatten(1), teacher.flatten(1), dim=1)).mean()


_MATCHES.register("class-scores", _class_scores)
_MATCHES.register("vectors", _vectors)


def distillation_loss(match: str, kind: str = "") -> Loss:
    """The loss that brings a student's outputs to its teacher's: `match` is the task's
    declaration ("class-scores" or "vectors"), `kind` the output kind class scores hold."""
    return _MATCHES.get(match)(kind)


def _label_loss(kind: str) -> Loss:
    """Cross-entropy with the true class, for class scores holding `kind`."""
    return lambda student, labels: F.nll_loss(_log_probabilities(student, kind, 1.0), labels)


def _most_specific(out: torch.Tensor) -> str:
    """The first kind `out` matches of probabilities, log-probabilities and logits (which match anything)."""
    matching = kinds_matching(out.float().cpu().numpy())
    return next(k for k in ("probabilities", "log_probabilities", "logits") if k in matching)


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def _val_loss(student: nn.Module, teacher: nn.Module, dataset, loss: Loss, device, batch_size: int) -> float:
    student.eval()
    total, n = 0.0, 0
    for images, _ in make_loader(dataset, batch_size, device, workers=0):
        images = images.to(device)
        total += float(loss(_first(student(images)), _first(teacher(images)))) * len(images)
        n += len(images)
    return total / max(n, 1)


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, dataset, device, batch_size: int) -> None:
    """Each BatchNorm's statistics made anew from the training images as the trained weights see
    them (a cumulative average over one pass): training moves them only by the layer's momentum per
    step (0.01 in torchvision's MobileNetV3), so a short recovery can leave them describing the
    weights it started from, and the eval-mode model answers far from what it learned. `distill`
    keeps the recalibrated statistics where they bring the student closer to the teacher."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average
    model.train()
    for images, _ in make_loader(dataset, batch_size, device, workers=0):
        model(images.to(device))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()


def recovery_optimizer(model: nn.Module, batch_size: int = 64, lr: float | None = None) -> torch.optim.Optimizer:
    """As such networks are trained: AdamW for a network normalised by LayerNorm alone (a
    transformer, ConvNeXt), SGD with momentum for the others (BatchNorm's ResNets and MobileNets).
    SGD at the rate that suits a ResNet undoes a pruned ViT's recovery; AdamW's steps, as large
    whatever the gradient, unsettle a small convolutional network that pruning left nearly right.
    `lr`: AdamW's rate where the caller knows its network's (a pretrained text encoder's is lower)."""
    layer_norm = any(isinstance(m, nn.LayerNorm) for m in model.modules())
    batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if layer_norm and not batch_norm:
        return torch.optim.AdamW(model.parameters(), lr=lr or 1e-3, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=scaled_lr(0.1, batch_size), momentum=0.9, weight_decay=5e-4)


def distill(student: nn.Module, teacher: nn.Module, data: DatasetSplits, match: str, epochs: int,
            label_mapping: np.ndarray | None = None, batch_size: int = 64, device: str = "auto", seed: int = 0,
            progress: bool = True, deadline: float | None = None, output_kind: str | None = None,
            lr: float | None = None) -> dict:
    """Train `student` in place for `epochs` on `data.train` to match `teacher`'s outputs (`match`:
    "class-scores" or "vectors"); where `label_mapping` is given (the model's class of each of the
    data's labels), its cross-entropy with the true class is added. Class scores are read as
    `output_kind`, what the optimizer read from the model; without it, as the most specific kind the
    teacher's outputs on a validation batch match. Stops early, after a step, once
    time.monotonic() passes `deadline`. `lr`: a LayerNorm network's AdamW rate, where not the default.
    Returns the validation distillation loss before and after, and `epoch_s`: the seconds an epoch
    of training takes at the pace of the steps after the first (None where there were none)."""
    torch.manual_seed(seed)
    # a training split smaller than a batch is one batch of all of it (whole batches only, below)
    if hasattr(data.train, "__len__"):
        batch_size = max(1, min(batch_size, len(data.train)))
    dev = resolve_device(device, 0)
    student.to(dev)
    teacher = teacher.to(dev).eval()
    probe = next(iter(make_loader(data.val, batch_size, dev, workers=0)))[0].to(dev)
    with torch.no_grad():
        kind = "" if match != "class-scores" else output_kind or _most_specific(_first(teacher(probe)))
    loss_of = distillation_loss(match, kind)
    label_loss = _label_loss(kind) if label_mapping is not None else None
    to_model_class = torch.as_tensor(label_mapping, device=dev) if label_mapping is not None else None
    before = _val_loss(student, teacher, data.val, loss_of, dev, 2 * batch_size)
    g = torch.Generator().manual_seed(seed)
    lengths = token_lengths(data.train)  # texts: batches of about one length, each padded to its longest
    sampler = RandomSampler(data.train, generator=g) if lengths is None else \
        LengthGroupedSampler(lengths, batch_size, generator=g)
    loader = make_loader(data.train, batch_size, dev, workers=default_workers(data.in_memory), sampler=sampler,
                         drop_last=True)
    optimizer = recovery_optimizer(student, batch_size, lr)
    scheduler = warmup_cosine(optimizer, max(1, epochs * len(loader)), warmup_steps=0)
    bar = tqdm(total=epochs * len(loader), desc="distill", unit="step", leave=False,
               disable=None if progress else True)
    steps, stopped = 0, False
    paced_from = None  # when the first step ended: the pace leaves out the loader's start and the first step
    for _ in range(epochs):
        student.train()
        for images, labels in loader:
            images = images.to(dev)
            with torch.no_grad():
                target = _first(teacher(images))
            out = _first(student(images))
            loss = loss_of(out, target)
            if label_loss is not None:
                loss = loss + label_loss(out, to_model_class[labels.to(dev)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
            paced_from = paced_from or time.monotonic()
            bar.update()
            if deadline is not None and time.monotonic() > deadline:
                stopped = True
                break
        if stopped:
            break
    bar.close()
    epoch_s = (time.monotonic() - paced_from) / (steps - 1) * len(loader) if steps > 1 else None
    after = _val_loss(student, teacher, data.val, loss_of, dev, 2 * batch_size)
    saved = student.state_dict()  # a buffer outside it (a transformer's position ids) is not the statistics'
    kept = {name: buffer.clone() for name, buffer in student.named_buffers() if name in saved}
    recalibrate_batchnorm(student, data.calibration_set(), dev, batch_size)
    recalibrated = _val_loss(student, teacher, data.val, loss_of, dev, 2 * batch_size)
    if recalibrated < after:  # kept where it brings the student closer to the teacher
        after = recalibrated
    else:
        student.load_state_dict({**student.state_dict(), **kept})
        recalibrated = None
    student.eval().cpu()
    teacher.cpu()
    return {"method": "distillation from the unpruned model" + (" and the labels" if label_loss else ""),
            "matched": match, "output_kind": kind or None, "epochs": epochs, "steps": steps,
            "stopped_at_deadline": stopped, "batchnorm_recalibrated": recalibrated is not None, "epoch_s": epoch_s,
            "val_distillation_loss_before": before, "val_distillation_loss_after": after}


def recover(student: nn.Module, teacher: nn.Module, data: DatasetSplits, match: str, epochs: int,
            good_enough: Callable[[nn.Module], bool] | None = None, max_rounds: int = 3,
            deadline: float | None = None, **options) -> dict:
    """`distill` for `epochs`, then, while `good_enough(student)` (a check on images recovery does
    not learn from) says no, another round twice as long from where it stopped — a small network
    trained on a few hundred images needs many more epochs than a large one on thousands, and
    only the check tells which this is. Rounds stop after `max_rounds`, where the next one would
    not fit before `deadline` (at the pace of the last), or where a round brought the student no
    closer to the teacher (that round is undone: the first one too, so recovery never leaves a
    student further from its teacher than it started). Returns the first round's report with the
    rounds' epochs, steps and whether the check passed."""
    rounds: list[dict] = []
    passed = None
    while True:
        kept = copy.deepcopy(student.state_dict())
        started = time.monotonic()
        report = distill(student, teacher, data, match, epochs, deadline=deadline, seed=len(rounds), **options)
        closest = rounds[-1]["val_distillation_loss_after"] if rounds else report["val_distillation_loss_before"]
        if report["val_distillation_loss_after"] >= closest:
            student.load_state_dict(kept)
            rounds.append({**report, "undone": True})
            if len(rounds) == 1:
                passed = good_enough(student) if good_enough is not None else None
            break
        rounds.append(report)
        passed = good_enough(student) if good_enough is not None else None
        pace = time.monotonic() - started
        if passed is not False or report["stopped_at_deadline"] or len(rounds) == max_rounds:
            break
        if deadline is not None and time.monotonic() + 2 * pace > deadline:
            break
        epochs *= 2
    kept_rounds = [r for r in rounds if not r.get("undone")]
    return {**rounds[0], "epochs": sum(r["epochs"] for r in kept_rounds),
            "steps": sum(r["steps"] for r in kept_rounds), "rounds": [r["epochs"] for r in rounds],
            "undone_round": bool(rounds[-1].get("undone")), "good_enough": passed,
            "stopped_at_deadline": any(r["stopped_at_deadline"] for r in rounds),
            "epoch_s": max(rounds, key=lambda r: r["steps"])["epoch_s"],  # the round that ran longest
            "batchnorm_recalibrated": bool(kept_rounds) and kept_rounds[-1]["batchnorm_recalibrated"],
            "val_distillation_loss_after": (kept_rounds[-1]["val_distillation_loss_after"] if kept_rounds
                                            else rounds[0]["val_distillation_loss_before"])}
