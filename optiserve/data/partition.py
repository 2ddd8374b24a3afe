"""Deterministic train/val/test indices; the stratified splits and the halves drawn exactly as
scikit-learn's `train_test_split` draws them.

Numpy only: the trainer's workers and the optimizer split their data without importing scikit-learn
(seconds of start-up in every process). The draws follow scikit-learn's StratifiedShuffleSplit and
ShuffleSplit step for step, so a seed names the same split either way; tests hold the two equal."""

from __future__ import annotations

import math

import numpy as np

SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # train / val / test


def random_split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic random train/val/test indices of n unlabelled samples in SPLIT_FRACTIONS proportions."""
    order = np.random.default_rng(seed).permutation(n)
    n_train, n_val = int(n * SPLIT_FRACTIONS[0]), int(n * SPLIT_FRACTIONS[1])
    return np.sort(order[:n_train]), np.sort(order[n_train:n_train + n_val]), np.sort(order[n_train + n_val:])


def stratified_split(labels: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic stratified train/val/test indices in SPLIT_FRACTIONS proportions."""
    labels = np.asarray(labels)
    idx = np.arange(len(labels))
    train_f, val_f, test_f = SPLIT_FRACTIONS
    rest, test = split_two(labels, test_f, seed, stratify=True)
    train, val = split_two(labels[rest], val_f / (train_f + val_f), seed, stratify=True)
    return np.sort(idx[rest][train]), np.sort(idx[rest][val]), np.sort(idx[test])


def split_in_halves(labels: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (validation, test) halves of one held-out folder, stratified by class where every
    class has two images: the first chooses, the second only reports."""
    labels = np.asarray(labels)
    stratify = bool(len(labels)) and np.unique(labels, return_counts=True)[1].min() >= 2
    choose, report = split_two(labels, 0.5, seed, stratify=stratify)
    return np.sort(choose), np.sort(report)


def split_two(labels: np.ndarray, test_fraction: float, seed: int, stratify: bool) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions into `labels`, `test_fraction` of them held out (rounded up), as
    `train_test_split(range(n), test_size=test_fraction, stratify=labels or None, random_state=seed)`."""
    if np.ndim(labels) != 1:
        raise ValueError(f"labels must be one a sample, got an array of shape {np.shape(labels)}")
    n = len(labels)
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    if n_train <= 0 or n_test <= 0:
        raise ValueError(f"{n} samples cannot be split {1 - test_fraction:g} / {test_fraction:g}")
    rng = np.random.RandomState(seed)
    if not stratify:
        order = rng.permutation(n)
        return order[n_test:n_test + n_train], order[:n_test]
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise ValueError(f"class {classes[counts.argmin()]!r} has one sample; stratifying needs two of each")
    if min(n_train, n_test) < len(classes):
        raise ValueError(f"{n_train} / {n_test} samples cannot hold each of {len(classes)} classes")
    members = np.split(np.argsort(inverse.reshape(-1), kind="stable"), np.cumsum(counts)[:-1])
    kept_per_class = _approximate_mode(counts, n_train, rng)
    held_per_class = _approximate_mode(counts - kept_per_class, n_test, rng)
    kept, held = [], []
    for i in range(len(classes)):
        shuffled = members[i].take(rng.permutation(counts[i]), mode="clip")
        kept.extend(shuffled[:kept_per_class[i]])
        held.extend(shuffled[kept_per_class[i]:kept_per_class[i] + held_per_class[i]])
    return rng.permutation(kept), rng.permutation(held)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` each class gets: its share rounded down, the rest given by largest
    remainder with ties broken at random (scikit-learn's approximate mode of the hypergeometric)."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            now = min(len(tied), need)
            floored[rng.choice(tied, size=now, replace=False)] += 1
            need -= now
            if need == 0:
                break
    return floored.astype(int)
