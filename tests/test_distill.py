"""Recovery after pruning by distillation: a pruned copy learns to answer as the model it came from
on the digits' training images, with or without their labels, whatever its task's outputs hold."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

from optiserve.data import load_dataset
from optiserve.models import load_model
from optiserve.optimize.prune_channels import prune_channels
from optiserve.optimize.validate import materialize
from optiserve.errors import UserError
from optiserve.tasks.output_kinds import get_output_kind, list_output_kinds
from optiserve.train.distill import distill, distillation_loss, recover


@pytest.fixture(scope="module")
def digits(small_cnn_checkpoint):
    loaded = load_model("small_cnn", str(small_cnn_checkpoint))
    data = load_dataset("digits", loaded.input, len(loaded.classes))
    return loaded.model.eval(), data, torch.from_numpy(materialize(data.test, True).images)


def _few(data, n: int = 256):
    """The splits with only the first `n` training images (and calibrating on those): for the tests of
    how recovery runs, its rounds and deadline, which hold whatever the images it learns from."""
    return dataclasses.replace(data, train=torch.utils.data.Subset(data.train, range(n)), calib=None)


def _pruned(model: nn.Module, test: torch.Tensor) -> nn.Module:
    return prune_channels(model, 0.5, test[:2])[0]


def _agreement(student: nn.Module, teacher: nn.Module, test: torch.Tensor) -> float:
    with torch.no_grad():
        return float((student.eval()(test).argmax(1) == teacher(test).argmax(1)).float().mean())


def test_without_labels_a_pruned_classifier_learns_to_answer_as_the_original(digits):
    teacher, data, test = digits
    student = _pruned(teacher, test)
    before = _agreement(student, teacher, test)
    report = distill(student, teacher, data, "class-scores", epochs=3, progress=False)
    assert report["method"] == "distillation from the unpruned model" and report["output_kind"] == "logits"
    assert report["val_distillation_loss_after"] < 0.2 * report["val_distillation_loss_before"]
    assert before < 0.8 and _agreement(student, teacher, test) >= 0.95
    assert not any(p.requires_grad and p.grad is not None for p in teacher.parameters())  # the teacher is untouched


def test_the_labels_are_learned_too_where_the_data_has_the_models_classes(digits):
    teacher, data, test = digits
    student = _pruned(teacher, test)
    report = distill(student, teacher, data, "class-scores", epochs=3, label_mapping=np.arange(10), progress=False)
    assert report["method"] == "distillation from the unpruned model and the labels"
    labels = torch.as_tensor(materialize(data.test, True).labels)
    with torch.no_grad():
        assert float((student(test).argmax(1) == labels).float().mean()) >= 0.9


@pytest.mark.parametrize("ending, kind", [(nn.Softmax(dim=1), "probabilities"),
                                          (nn.LogSoftmax(dim=1), "log_probabilities")])
def test_a_classifier_that_ends_in_softmax_or_log_softmax_is_matched_as_what_it_gives(digits, ending, kind):
    teacher, data, test = digits
    teacher = nn.Sequential(teacher, ending).eval()
    student = _pruned(teacher, test)
    report = distill(student, teacher, data, "class-scores", epochs=3, progress=False)
    assert report["output_kind"] == kind
    assert report["val_distillation_loss_after"] < 0.2 * report["val_distillation_loss_before"]
    assert _agreement(student, teacher, test) >= 0.95


# How a model ends so that its class scores hold each output kind, for K classes or one channel.
ENDINGS = {"logits": lambda scores: scores,
           "probabilities": lambda scores: scores.softmax(1) if scores.shape[1] > 1 else scores.sigmoid(),
           "log_probabilities": lambda scores: (scores.log_softmax(1) if scores.shape[1] > 1
                                                else nn.functional.logsigmoid(scores)),
           "multi_label": lambda scores: scores.sigmoid()}


@pytest.mark.parametrize("kind", list_output_kinds())
@pytest.mark.parametrize("channels", [10, 1])
def test_every_output_kind_is_distilled_with_a_loss_and_gradient_that_vanish_only_at_the_teacher(kind, channels):
    """Each kind the output-kind registry holds (a new one too) has a distillation loss: positive,
    with a gradient that reaches the student, where the student answers otherwise than its teacher,
    and next to zero where it answers the same."""
    assert kind in ENDINGS, f"say in ENDINGS how a model ends in {kind!r}, and give it a distillation distribution"
    torch.manual_seed(0)
    images = torch.randn(8, 16)
    teacher, student = nn.Linear(16, channels), nn.Linear(16, channels)
    with torch.no_grad():
        teacher.weight *= 4  # scores clear of [0, 1], so a one-channel teacher's logits do not read as probabilities
    loss = distillation_loss("class-scores", kind)
    target = ENDINGS[kind](teacher(images)).detach()
    assert get_output_kind(kind).matches(target.numpy().astype(np.float64))

    value = loss(ENDINGS[kind](student(images)), target)
    value.backward()
    assert float(value.detach()) > 1e-3 and float(student.weight.grad.abs().sum()) > 1e-3

    copy = nn.Linear(16, channels)
    copy.load_state_dict(teacher.state_dict())
    same = loss(ENDINGS[kind](copy(images)), target)
    same.backward()
    assert abs(float(same.detach())) < 1e-5 and float(copy.weight.grad.abs().max()) < 1e-4


def test_an_output_kind_distillation_does_not_know_is_refused_by_name():
    with pytest.raises(UserError, match="'odds'"):
        distillation_loss("class-scores", "odds")


def test_a_training_split_smaller_than_a_batch_still_trains_as_one_batch(digits):
    teacher, data, test = digits
    student = _pruned(teacher, test)
    report = distill(student, teacher, _few(data, 28), "class-scores", epochs=2, batch_size=64, progress=False)
    assert report["steps"] == 2  # one batch of the 28 an epoch
    assert report["val_distillation_loss_after"] < report["val_distillation_loss_before"]


def test_an_embedding_is_matched_by_its_direction(digits):
    teacher, data, test = digits
    embedder = nn.Sequential(teacher.features, nn.Flatten(), nn.Linear(teacher.classifier.in_features, 16)).eval()
    student = _pruned(embedder, test)
    report = distill(student, embedder, data, "vectors", epochs=3, progress=False)
    with torch.no_grad():
        cosine = nn.functional.cosine_similarity(student.eval()(test), embedder(test)).mean()
    assert report["val_distillation_loss_after"] < 0.5 * report["val_distillation_loss_before"]
    assert float(cosine) > 0.95


def test_a_segmenter_is_matched_pixel_by_pixel(digits):
    _, data, test = digits
    torch.manual_seed(0)
    block = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]  # noqa: E731
    segmenter = nn.Sequential(*block(1, 32), *block(32, 32), nn.Conv2d(32, 3, 1)).eval()  # a function to match,
    with torch.no_grad():
        segmenter[-1].weight *= 10  # with scores confident enough to have a clear winner per pixel
    student = _pruned(segmenter, test)

    def pixel_agreement() -> float:
        with torch.no_grad():
            return float((student.eval()(test).argmax(1) == segmenter(test).argmax(1)).float().mean())

    before = pixel_agreement()
    report = distill(student, segmenter, data, "class-scores", epochs=3, progress=False)
    assert report["val_distillation_loss_after"] < 0.5 * report["val_distillation_loss_before"]
    after = pixel_agreement()
    assert before < 0.85 and after > 0.9 and (1 - after) < 0.5 * (1 - before)  # half the wrong pixels, or fewer


def test_recovery_stops_at_its_deadline(digits):
    teacher, data, test = digits
    report = distill(_pruned(teacher, test), teacher, _few(data), "class-scores", epochs=3, progress=False,
                     deadline=time.monotonic() - 1)
    assert report["steps"] == 1 and report["stopped_at_deadline"]
    assert report["epoch_s"] is None  # one step, the loader's start in it, tells nothing of an epoch's pace


def test_recovery_goes_on_in_rounds_twice_as_long_while_its_check_fails_and_stops_once_it_passes(digits):
    teacher, data, test = digits
    answers = iter([False, True])
    checked = []

    def good_enough(model):
        checked.append(_agreement(model, teacher, test))
        return next(answers)

    started = time.monotonic()
    report = recover(_pruned(teacher, test), teacher, _few(data), "class-scores", 1, good_enough=good_enough,
                     progress=False)
    assert report["rounds"] == [1, 2] and report["epochs"] == 3 and report["good_enough"] is True
    # what an epoch of training took (the search's measure of whether a candidate's share is worth starting)
    assert 0 < 2 * report["epoch_s"] < time.monotonic() - started
    assert len(checked) == 2 and not report["undone_round"]


def test_recovery_rounds_end_at_the_limit_or_the_deadline_whatever_the_check_says(digits):
    teacher, data, test = digits
    never = lambda model: False  # noqa: E731
    report = recover(_pruned(teacher, test), teacher, _few(data), "class-scores", 1, good_enough=never,
                     max_rounds=2, progress=False)
    assert len(report["rounds"]) == 2 and report["good_enough"] is False
    late = recover(_pruned(teacher, test), teacher, _few(data), "class-scores", 3, good_enough=never,
                   progress=False, deadline=time.monotonic() - 1)
    assert late["rounds"] == [3] and late["steps"] == 1 and late["stopped_at_deadline"]


def test_a_layernorm_network_recovers_with_adamw_and_a_batchnorm_one_with_sgd(digits):
    from optiserve.train.distill import recovery_optimizer

    teacher, _, _ = digits
    transformer = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    assert isinstance(recovery_optimizer(transformer), torch.optim.AdamW)
    assert isinstance(recovery_optimizer(teacher), torch.optim.SGD)


def test_a_first_round_that_brings_the_student_no_closer_is_undone(digits):
    """A student that already answers as its teacher (a copy): training can only move it away, so the
    round is undone and the student is the copy it was."""
    import copy

    teacher, data, test = digits
    student = copy.deepcopy(teacher)
    report = recover(student, teacher, _few(data), "class-scores", 1, good_enough=lambda model: True, progress=False)
    assert report["undone_round"] and report["rounds"] == [1] and report["epochs"] == 0 and report["steps"] == 0
    assert report["good_enough"] is True
    assert report["val_distillation_loss_after"] == report["val_distillation_loss_before"]
    for mine, theirs in zip(student.state_dict().values(), teacher.state_dict().values()):
        assert torch.equal(mine, theirs)
