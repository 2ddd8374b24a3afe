"""What a classifier's [N, K] output holds: logits, probabilities (a model that ends in softmax) or
log-probabilities (log-softmax). `optimize` recognises it on the model's own outputs for held-out
images (or takes `--output-kind`) and records it in the manifest as `output_kind`; the server's
answers and the protocol's `probabilities` output turn it into probabilities the way it says, so a
model that already gives probabilities is never put through a second softmax.

Adding a kind is one `register_output_kind` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from optiserve.registry import Registry

SUM_TOLERANCE = 1e-3   # how far a row's sum (of probabilities, or of exp(log-probabilities)) may be from 1
SIGN_TOLERANCE = 1e-6  # probabilities below -this, or log-probabilities above it, are not what they say


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def _are_probabilities(out: np.ndarray) -> bool:
    return bool((out >= -SIGN_TOLERANCE).all() and np.allclose(out.sum(1), 1.0, atol=SUM_TOLERANCE))


def _are_log_probabilities(out: np.ndarray) -> bool:
    return bool((out <= SIGN_TOLERANCE).all() and np.allclose(np.exp(out).sum(1), 1.0, atol=SUM_TOLERANCE))


@dataclass(frozen=True)
class OutputKind:
    name: str
    description: str
    probabilities: Callable[[np.ndarray], np.ndarray]   # a batch's raw [N, K] output -> probabilities
    matches: Callable[[np.ndarray], bool]               # whether outputs on real images look like this kind


_KINDS: Registry[OutputKind] = Registry("output kind")


def register_output_kind(kind: OutputKind) -> OutputKind:
    return _KINDS.register(kind.name, kind)


def get_output_kind(name: str | None) -> OutputKind:
    """The kind `name`; manifests written before output kinds existed hold logits."""
    return _KINDS.get(name or "logits")


def list_output_kinds() -> list[str]:
    return _KINDS.names()


register_output_kind(OutputKind("logits", "unnormalised class scores (softmax gives the probabilities)",
                                softmax, lambda out: True))
register_output_kind(OutputKind("probabilities", "every row non-negative and summing to 1 (a model ending in softmax)",
                                lambda out: out, _are_probabilities))
register_output_kind(OutputKind("log_probabilities", "every row's exp sums to 1 (a model ending in log-softmax)",
                                np.exp, _are_log_probabilities))

DETECTION_ORDER = ("probabilities", "log_probabilities", "logits")  # the most specific first; logits match anything


def recognise_output_kind(outputs: np.ndarray) -> str:
    """The kind a classifier's raw outputs on real images are: the first of DETECTION_ORDER they match."""
    outputs = np.asarray(outputs, dtype=np.float64)
    return next(name for name in DETECTION_ORDER if get_output_kind(name).matches(outputs))
