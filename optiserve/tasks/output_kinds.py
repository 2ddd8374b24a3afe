"""What a model's class scores hold, along axis 1 of a classifier's [N, K] or a segmenter's
[N, K, H, W] output: logits, probabilities (a model that ends in softmax, or in a sigmoid for one
channel), log-probabilities, or a classifier's K independent probabilities (multi-label: a model
that ends in a sigmoid over K > 1 classes). `optimize` reads it from the operation the model ends in, confirms it
on the model's own outputs for held-out images (or takes `--output-kind`) and records it in the
manifest as `output_kind`, with `output_kind_from` saying how it was known; the server's
answers, the protocol's `probabilities` output and a one-channel map's threshold turn it into
probabilities the way it says, so a model that already gives probabilities is never put through a
second softmax or sigmoid.

Adding a kind is one `register_output_kind` call; a kind whose scores are no distribution over the
classes (multi-label) names the tasks that read it, each with its own reading of the scores
(tasks/registry.py's `register_reading`: its gate, its answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from optiserve.registry import Registry

SUM_TOLERANCE = 1e-3   # how far a row's sum (of probabilities, or of exp(log-probabilities)) may be from 1
SIGN_TOLERANCE = 1e-6  # probabilities below -this, or log-probabilities above it, are not what they say


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities along axis 1: softmax over the classes, or for one channel (a foreground
    score) the sigmoid, its two-class form."""
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def _are_probabilities(out: np.ndarray) -> bool:
    if out.shape[1] == 1:
        return bool((out >= -SIGN_TOLERANCE).all() and (out <= 1 + SIGN_TOLERANCE).all())
    return bool((out >= -SIGN_TOLERANCE).all() and np.allclose(out.sum(1), 1.0, atol=SUM_TOLERANCE))


def _are_independent_probabilities(out: np.ndarray) -> bool:
    return bool((out >= -SIGN_TOLERANCE).all() and (out <= 1 + SIGN_TOLERANCE).all())


def _are_log_probabilities(out: np.ndarray) -> bool:
    if out.shape[1] == 1:
        return bool((out <= SIGN_TOLERANCE).all())
    return bool((out <= SIGN_TOLERANCE).all() and np.allclose(np.exp(out).sum(1), 1.0, atol=SUM_TOLERANCE))


@dataclass(frozen=True)
class OutputKind:
    name: str
    description: str
    probabilities: Callable[[np.ndarray], np.ndarray]   # a batch's raw [N, K, ...] output -> probabilities
    matches: Callable[[np.ndarray], bool]               # whether outputs on real images look like this kind
    # The tasks whose scores may hold it (None: every task that reads output kinds).
    tasks: tuple[str, ...] | None = None
    # Whether values that match may suggest it where the graph says nothing: K independent
    # probabilities lie in [0, 1] as logits or a softmax's may, so multi-label is only ever read from
    # the graph or stated.
    suggested_by_values: bool = True

    def read_by(self, task: str) -> bool:
        return self.tasks is None or task in self.tasks


_KINDS: Registry[OutputKind] = Registry("output kind")


def register_output_kind(kind: OutputKind) -> OutputKind:
    return _KINDS.register(kind.name, kind)


def get_output_kind(name: str | None) -> OutputKind:
    """The kind `name`; manifests written before output kinds existed hold logits."""
    return _KINDS.get(name or "logits")


def list_output_kinds() -> list[str]:
    return _KINDS.names()


register_output_kind(OutputKind("logits", "unnormalised class scores (softmax gives the probabilities; sigmoid for "
                                "one channel)",
                                softmax, lambda out: True))
register_output_kind(OutputKind("probabilities", "non-negative and summing to 1 over the classes (a model ending "
                                "in softmax; one channel: in 0..1, a sigmoid)",
                                lambda out: out, _are_probabilities))
register_output_kind(OutputKind("log_probabilities", "exp sums to 1 over the classes (a model ending in "
                                "log-softmax; one channel: log-sigmoid)",
                                np.exp, _are_log_probabilities))
register_output_kind(OutputKind("multi_label", "K independent probabilities, each in 0..1 and each class on its "
                                "own (a classifier ending in a sigmoid over K > 1 classes: multi-label)",
                                lambda out: out, _are_independent_probabilities,
                                tasks=("classification", "text-classification"),
                                suggested_by_values=False))


def kinds_matching(outputs: np.ndarray) -> list[str]:
    """Every kind a model's raw class scores on real images could be. Values alone can only rule
    kinds out: logits match anything, so one-channel logits within [0, 1] or all-negative logits
    look like probabilities or log-probabilities too. What the scores hold is read from the model
    (models/output_ending.py); these confirm it. Kinds values never suggest (multi-label) are not
    among them: `holds` confirms those."""
    outputs = np.asarray(outputs, dtype=np.float64)
    return [name for name in list_output_kinds()
            if get_output_kind(name).suggested_by_values and get_output_kind(name).matches(outputs)]


def holds(name: str, outputs: np.ndarray) -> bool:
    """Whether a model's raw class scores on real images can be of kind `name`."""
    return get_output_kind(name).matches(np.asarray(outputs, dtype=np.float64))
