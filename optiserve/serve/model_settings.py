"""A model's own serving settings: `serving.json` in its artifact folder overrides the server's flags
for that model (as a Triton model's config.pbtxt does), and each effective setting says where it
came from (`file`, `flag` or `default`) for `GET /v2/models/{model}/config`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from optiserve.errors import UserError
from optiserve.serve.config import ServeConfig

SETTINGS_FILE = "serving.json"
MAX_SETTINGS_BYTES = 1 << 20


def _count(minimum: int):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return f"a whole number of at least {minimum}"
    return check


def _number(minimum: float, inclusive: bool):
    def check(value):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
            (value >= minimum if inclusive else value > minimum)
        if not ok:
            return f"a number {'>=' if inclusive else '>'} {minimum:g}"
    return check


def _names(value):
    if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        return "a non-empty list of variant names"


def _weights(value):
    if not (isinstance(value, dict) and value and all(
            isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            and w >= 0 for k, w in value.items()) and sum(value.values()) > 0):
        return 'an object of variant weights, e.g. {"onnx-int8": 0.9, "fp32": 0.1}, not all zero'


# key -> (the server flag it overrides, that flag's ServeConfig field, the check of a value: what it
# must be, or None)
KEYS = {
    "max_batch_size": ("--max-batch-size", "max_batch_size", _count(1)),
    "max_delay_ms": ("--max-delay-ms", "max_delay_ms", _number(0, inclusive=True)),
    "max_queue": ("--max-queue", "max_queue", _count(1)),
    "timeout_ms": ("--timeout-ms", "timeout_ms", _number(0, inclusive=False)),
    "variants": ("--variants", "variants", _names),
    "traffic": ("--ab", "ab", _weights),
}
_DEFAULTS = ServeConfig(artifact_dir="")


@dataclass(frozen=True)
class ModelSettings:
    """The settings one model is served with, and where each came from."""

    max_batch_size: int
    max_delay_ms: float
    max_queue: int
    timeout_ms: float
    variants: list[str] | None
    traffic: dict[str, float] | str | None  # from the file: weights; from the flag: --ab as given
    sources: dict[str, str] = field(default_factory=dict)  # key -> file, flag or default

    def described(self) -> dict:
        """{key: {"value", "source", "flag"}}: what `GET /v2/models/{model}/config` answers."""
        return {f.name: {"value": getattr(self, f.name), "source": self.sources[f.name], "flag": KEYS[f.name][0]}
                for f in fields(self) if f.name in KEYS}

    @property
    def ab(self) -> str | None:
        """The traffic weights in --ab's form."""
        if isinstance(self.traffic, str):
            return self.traffic
        return ",".join(f"{k}={w!r}" for k, w in self.traffic.items()) if self.traffic else None

    def batching(self, server_wide):
        """The server's BatchingConfig with this model's batch size, delay and queue."""
        return replace(server_wide, max_batch_size=self.max_batch_size, max_delay_ms=self.max_delay_ms,
                       max_queue=self.max_queue)


def settings_version(folder: str | Path) -> str | None:
    """sha256 of the folder's serving.json, or None without one (what a poll compares)."""
    try:
        return hashlib.sha256((Path(folder) / SETTINGS_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def read_settings_file(folder: str | Path) -> dict:
    """The keys of `folder`'s serving.json ({} without one); a UserError saying what is wrong with it."""
    path = Path(folder) / SETTINGS_FILE
    if not path.exists():
        return {}
    try:
        if path.stat().st_size > MAX_SETTINGS_BYTES:
            raise UserError(f"{SETTINGS_FILE} is over {MAX_SETTINGS_BYTES:,} bytes")
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise UserError(f"{SETTINGS_FILE} cannot be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{SETTINGS_FILE} is not valid JSON: {e}") from None
    except RecursionError:
        raise UserError(f"{SETTINGS_FILE} is nested too deeply to be settings") from None
    if not isinstance(data, dict):
        raise UserError(f"{SETTINGS_FILE} must hold a JSON object of settings ({', '.join(KEYS)})")
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise UserError(f"{SETTINGS_FILE}: unknown setting{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))}; the settings are {', '.join(KEYS)}")
    for key, value in data.items():
        wrong = KEYS[key][2](value)
        if wrong:
            raise UserError(f"{SETTINGS_FILE}: {key} must be {wrong}; got {json.dumps(value)[:100]}")
    return data


def model_settings(folder: str | Path, cfg: ServeConfig) -> ModelSettings:
    """The settings `folder`'s model is served with: its serving.json over the server's flags."""
    from_file = read_settings_file(folder)
    values, sources = {}, {}
    for key, (_, attribute, _) in KEYS.items():
        if key in from_file:
            values[key], sources[key] = from_file[key], "file"
        else:
            values[key] = getattr(cfg, attribute)
            sources[key] = "default" if values[key] == getattr(_DEFAULTS, attribute) else "flag"
    return ModelSettings(**values, sources=sources)
