"""Datasets: the bundled digits, image folders and synthetic tensors."""

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from optiserve.data import load_dataset
from optiserve.data.digits_file import read_digits
from optiserve.data.partition import SPLIT_FRACTIONS, split_in_halves, stratified_split
from optiserve.errors import UserError
from optiserve.models import get_model_entry
from optiserve.input_spec import InputSpec

IMAGENET_INPUT = get_model_entry("resnet18").input


def test_digits_splits_are_disjoint_stratified_and_deterministic():
    labels = load_digits().target
    train, val, test = stratified_split(labels, seed=0)
    assert len(train) + len(val) + len(test) == len(labels) == 1797
    assert not (set(train) & set(test)) and not (set(train) & set(val)) and not (set(val) & set(test))
    for split in (train, val, test):  # every class keeps its share (within one image)
        share = np.bincount(labels[split], minlength=10) / len(split)
        assert np.abs(share - np.bincount(labels) / len(labels)).max() < 0.01
    again = stratified_split(labels, seed=0)
    assert all((a == b).all() for a, b in zip((train, val, test), again))


def test_the_digits_read_from_scikit_learn_s_file_are_load_digits_own():
    images, labels = read_digits()
    bunch = load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)


def _sklearn_splits(labels, seed):
    """The three splits (None where a class of one cannot be stratified) and the two halves, as
    scikit-learn's train_test_split draws them."""
    idx = np.arange(len(labels))
    stratifiable = np.bincount(labels).min() >= 2
    splits = None
    if stratifiable:
        train_f, val_f, test_f = SPLIT_FRACTIONS
        rest, test = train_test_split(idx, test_size=test_f, stratify=labels, random_state=seed)
        train, val = train_test_split(rest, test_size=val_f / (train_f + val_f), stratify=labels[rest],
                                      random_state=seed)
        splits = [np.sort(s) for s in (train, val, test)]
    halves = train_test_split(idx, test_size=0.5, stratify=labels if stratifiable else None, random_state=seed)
    return splits, [np.sort(h) for h in halves]


@pytest.mark.parametrize("labels", [
    load_digits().target,
    np.repeat(np.arange(7), [5, 6, 7, 8, 9, 11, 30]),   # uneven classes: remainders tie and are drawn
    np.random.default_rng(3).integers(0, 4, 101),        # an odd count, shuffled labels
    np.array([0] * 40 + [1] * 3 + [2] * 1 + [3] * 9),   # a class of one: the halves are not stratified
], ids=["digits", "uneven", "odd", "a-class-of-one"])
def test_splits_are_drawn_as_scikit_learn_s_train_test_split_draws_them(labels):
    for seed in range(4):
        want_splits, want_halves = _sklearn_splits(labels, seed)
        if want_splits is not None:
            for got, want in zip(stratified_split(labels, seed), want_splits, strict=True):
                np.testing.assert_array_equal(got, want)
        else:  # as scikit-learn refuses it
            with pytest.raises(ValueError, match="has one sample; stratifying needs two of each"):
                stratified_split(labels, seed)
        for got, want in zip(split_in_halves(labels, seed), want_halves, strict=True):
            np.testing.assert_array_equal(got, want)


def test_labels_that_are_not_one_a_sample_are_refused():
    with pytest.raises(ValueError, match=r"one a sample, got an array of shape \(4, 2\)"):
        stratified_split(np.array([[0, 1], [1, 0], [0, 1], [1, 0]]))


def test_digits_are_16x16_grayscale_normalized_with_train_statistics():
    data = load_dataset("digits", IMAGENET_INPUT, 1000)
    assert data.input.shape == (1, 16, 16) and data.classes == [str(i) for i in range(10)]
    assert (len(data.train), len(data.val), len(data.test)) == (1257, 180, 360)
    images = torch.stack([data.val[i][0] for i in range(len(data.val))])
    assert images.shape == (180, 1, 16, 16)
    assert abs(images.mean().item()) < 0.15 and 0.85 < images.std().item() < 1.15
    again = load_dataset("digits", IMAGENET_INPUT, 1000)
    assert torch.equal(data.test[3][0], again.test[3][0])  # evaluation images are fixed
    draws = {tuple(data.train[3][0].flatten().tolist()) for _ in range(30)}
    assert len(draws) > 1  # training images are randomly shifted (augmentation)


def _write_folder(root, per_class=6):
    digits = load_digits()
    for label in (0, 1):
        (root / f"class{label}").mkdir(parents=True)
        for k, img in enumerate(digits.images[digits.target == label][:per_class]):
            Image.fromarray((img * 16).astype(np.uint8)).save(root / f"class{label}" / f"{k}.png")


def test_imagefolder_prepares_images_for_the_model_input(tmp_path):
    _write_folder(tmp_path)
    spec = InputSpec((3, 32, 32), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    data = load_dataset(f"imagefolder:{tmp_path}", spec, 1000)
    assert data.classes == ["class0", "class1"] and not data.in_memory
    image, label = data.test[0]
    assert image.shape == (3, 32, 32) and label in (0, 1)
    assert len(data.train) + len(data.val) + len(data.test) == 12


@pytest.mark.parametrize("spec", [InputSpec((1, 16, 16), (0.5,), (0.25,)),                 # small input: resized
                                  InputSpec((3, 72, 72), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])  # resize + crop
def test_an_image_folder_is_scored_on_exactly_the_pixels_the_server_makes_of_the_same_file(tmp_path, spec):
    from optiserve.serve.preprocess import decode_image

    for label in (0, 1):  # non-square images: resizing straight and cropping the center would differ
        (tmp_path / f"c{label}").mkdir()
        for k in range(5):
            pixels = np.random.default_rng(10 * label + k).integers(0, 256, (24, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / f"c{label}" / f"{k}.png")
    data = load_dataset(f"imagefolder:{tmp_path}", spec, 1000)
    folder = data.test.dataset  # a Subset of the evaluation ImageFolder
    for i in data.test.indices:
        path, _ = folder.samples[i]
        served = decode_image(open(path, "rb").read(), spec)
        np.testing.assert_array_equal(folder[i][0].numpy(), served)


def test_a_folder_too_small_to_give_every_class_a_place_in_each_split_is_one_error(tmp_path):
    digits = load_digits()
    for label in (0, 1, 2):  # five images each: the validation split cannot hold all three classes
        (tmp_path / f"class{label}").mkdir()
        for k, img in enumerate(digits.images[digits.target == label][:5]):
            Image.fromarray((img * 16).astype(np.uint8)).save(tmp_path / f"class{label}" / f"{k}.png")
    with pytest.raises(UserError, match="15 images in 3 classes cannot give every class a place in train, "
                                        "validation and test: give each class at least 10 images"):
        load_dataset(f"imagefolder:{tmp_path}", IMAGENET_INPUT, 1000)


def test_imagefolder_errors_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_dataset(f"imagefolder:{tmp_path / 'nope'}", IMAGENET_INPUT, 1000)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no images"):
        load_dataset(f"imagefolder:{tmp_path / 'empty'}", IMAGENET_INPUT, 1000)
    with pytest.raises(UserError, match="unknown dataset 'cifar'"):
        load_dataset("cifar", IMAGENET_INPUT, 1000)


def test_synthetic_data_follows_the_model_spec_and_is_marked_unlabelled():
    data = load_dataset("synthetic", IMAGENET_INPUT, 1000)
    assert data.train[0][0].shape == (3, 224, 224)
    assert not data.labelled and not data.real_images and len(data.classes) == 1000


def test_images_straight_in_a_folder_are_an_unlabelled_set_split_without_overlap(tmp_path):
    for i, image in enumerate(load_digits().images[:40]):
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(tmp_path / f"photo-{i:03d}.png")
    (tmp_path / "notes.txt").write_text("not an image: ignored")
    data = load_dataset(f"imagefolder:{tmp_path}", IMAGENET_INPUT, 1000)
    assert not data.labelled and data.real_images and data.classes == []
    splits = [data.train, data.val, data.test]
    assert [len(s) for s in splits] == [28, 4, 8]
    assert sorted(i for s in splits for i in s.indices) == list(range(40))  # disjoint, all of them
    image, label = data.test[0]
    assert tuple(image.shape) == (3, 224, 224) and label == -1
    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(few / f"{i}.png")
    with pytest.raises(UserError, match="3 images; an unlabelled folder needs at least 10"):
        load_dataset(f"imagefolder:{few}", IMAGENET_INPUT, 1000)


def test_crop_resizes_the_shorter_side_by_the_specs_crop_fraction():
    from optiserve.data.image_input import image_to_input

    pixels = np.zeros((200, 200), np.uint8)
    pixels[50:150, 50:150] = 255  # a white square over the middle half of each side
    spec = lambda fraction: InputSpec((1, 100, 100), (0.0,), (1.0,), "crop", fraction)  # noqa: E731
    whole = image_to_input(Image.fromarray(pixels), spec(1.0))   # 200 -> 100: all of it, the square in the middle
    middle = image_to_input(Image.fromarray(pixels), spec(0.5))  # 200 -> 200, the middle 100: only the square
    assert middle.min() > 0.99
    assert whole[0, 50, 50] > 0.99 and whole[0, 5, 5] < 0.01 and abs(whole.mean() - 0.25) < 0.02
    stretched = image_to_input(Image.fromarray(pixels[:, :100]), InputSpec((1, 100, 100), (0.0,), (1.0,), "stretch"))
    assert abs(stretched.mean() - pixels[:, :100].mean() / 255) < 0.02  # the whole image, nothing cropped
