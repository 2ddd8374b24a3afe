"""How a model's traffic is split between its variants, and which variant shadows it."""

from __future__ import annotations

import collections
import math
import random
import threading
from dataclasses import dataclass

import numpy as np

from optiserve.errors import UserError
from optiserve.intervals import wilson_interval


def parse_ab(spec: str | None, served: list[str], origin: str = "--ab") -> dict[str, float]:
    """`int8=0.9,fp32=0.1` -> traffic shares summing to 1. Default: everything to the first served
    variant. `origin` names where the weights were set, for the error."""
    if not spec:
        return {served[0]: 1.0}
    weights = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or weight < 0:
            raise UserError(f"{origin} takes VARIANT=WEIGHT pairs like int8=0.9,fp32=0.1; got {part!r}")
        if name not in served:
            raise UserError(f"{origin} names {name!r}, which is not served (served: {', '.join(served)})")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise UserError(f"{origin} weights must not all be zero")
    return {k: v / total for k, v in weights.items()}


class Router:
    """Picks the variant for a request that names none, by the A/B shares."""

    def __init__(self, shares: dict[str, float], seed: int | None = None):
        self._rng = random.Random(seed)
        self.set(shares)

    def set(self, shares: dict[str, float]) -> None:
        """Replace the shares at once (one assignment: a request sees the old split or the new one)."""
        self._split = (list(shares), list(shares.values()))

    @property
    def shares(self) -> dict[str, float]:
        return dict(zip(*self._split))

    def pick(self) -> str:
        names, weights = self._split
        return names[0] if len(names) == 1 else self._rng.choices(names, weights)[0]


@dataclass(frozen=True)
class Shadow:
    """Mirror `fraction` of a model's answered requests to `variant`, after the answer is sent."""

    variant: str
    fraction: float

    def to_dict(self) -> dict:
        return {"variant": self.variant, "fraction": self.fraction}


class TrafficError(ValueError):
    """A traffic setting that cannot apply; nothing was changed (answered 400)."""


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TrafficError(f"{what} must be a number, got {value!r}"[:300])
    return float(value)


def parse_traffic(body, served: list[str]) -> tuple[dict[str, float] | None, Shadow | None, bool]:
    """`{"weights": {...}, "shadow": {"variant": V, "fraction": F} | null}` -> (shares summing to 1 or
    None when not given, the shadow, whether the shadow was given). Raises TrafficError naming the
    problem: an unknown variant, a negative weight, weights all zero, a fraction outside [0, 1]."""
    if not isinstance(body, dict) or not body or set(body) - {"weights", "shadow"}:
        raise TrafficError('expected {"weights": {"VARIANT": weight, ...}} and/or {"shadow": {"variant": '
                           '"VARIANT", "fraction": 0.2} or null}')
    shares = None
    if "weights" in body:
        weights = body["weights"]
        if not isinstance(weights, dict) or not weights:
            raise TrafficError('"weights" must be a non-empty object {"VARIANT": weight, ...}')
        for name, w in weights.items():
            if name not in served:
                raise TrafficError(f"unknown variant {name!r}"[:300] + f"; served: {', '.join(served)}")
            if _number(w, f"the weight of {name}") < 0:
                raise TrafficError(f"the weight of {name} is negative ({w})")
        total = sum(float(w) for w in weights.values())
        if total <= 0:
            raise TrafficError("the weights must not all be zero")
        shares = {name: float(w) / total for name, w in weights.items() if w > 0}
    shadow = None
    if body.get("shadow") is not None:
        spec = body["shadow"]
        if not isinstance(spec, dict) or set(spec) - {"variant", "fraction"} or "variant" not in spec:
            raise TrafficError('"shadow" must be {"variant": "VARIANT", "fraction": 0.2} or null')
        if spec["variant"] not in served:
            raise TrafficError(f"unknown shadow variant {spec['variant']!r}"[:300] + f"; served: {', '.join(served)}")
        fraction = _number(spec.get("fraction", 1.0), "the shadow fraction")
        if not 0 <= fraction <= 1:
            raise TrafficError(f"the shadow fraction must be between 0 and 1, got {fraction:g}")
        shadow = Shadow(spec["variant"], fraction)
    return shares, shadow, "shadow" in body


class ShadowStats:
    """Per shadow variant: images compared, how many agreed on the top-1 class, shadow latency, drops."""

    def __init__(self, window: int = 20_000):
        self._lock = threading.Lock()
        self.images = self.agreed = self.dropped = self.failed = 0
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=window)

    def record(self, agreed: int, images: int, latency_ms: float) -> None:
        """Count a shadow run: `agreed` of its `images` agreed with the answer (as the task judges)."""
        with self._lock:
            self.images += images
            self.agreed += agreed
            self.latencies_ms.append(latency_ms)

    def snapshot(self) -> dict:
        with self._lock:
            lat = np.asarray(self.latencies_ms, dtype=np.float64)
            images, agreed = self.images, self.agreed
            out = {"images": images, "agreed": agreed, "dropped": self.dropped, "failed": self.failed}
        out["agreement"] = agreed / images if images else None
        interval = wilson_interval(agreed, images)
        out["agreement_ci95"] = list(interval) if interval else None
        out["latency_ms"] = ({"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))}
                             if len(lat) else None)
        return out
