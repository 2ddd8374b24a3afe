"""A model's own serving settings: `serving.json` in its artifact folder overrides the server's flags
for that model (as a Triton model's config.pbtxt does), and each effective setting says where it
came from (`file`, `flag` or `default`) for `GET /v2/models/{model}/config`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from optiserve.batch_window import IMAGE_MAX_DELAY_MS, TEXT_MAX_DELAY_MS
from optiserve.errors import UserError
from optiserve.files import read_small_json
from optiserve.serve.config import ServeConfig

SETTINGS_FILE = "serving.json"
MAX_SETTINGS_BYTES = 1 << 20
MAX_INSTANCES = 64
MAX_PRIORITY_LEVELS = 16


def _whole(value, minimum: int, maximum: int | None) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum and \
        (maximum is None or value <= maximum)


def _count(minimum: int, maximum: int | None = None):
    def check(value):
        if not _whole(value, minimum, maximum):
            return f"a whole number of at least {minimum}" + (f" and at most {maximum}" if maximum else "")
    return check


def _queue_limit(value):
    if not (_whole(value, 1, None) or (isinstance(value, list) and value and all(_whole(v, 1, None) for v in value))):
        return "a whole number of at least 1 (each priority level's limit) or a list of them, one per level"


def _instances(value):
    if not (_whole(value, 1, MAX_INSTANCES) or (isinstance(value, dict) and value and all(
            isinstance(k, str) and k and _whole(n, 1, MAX_INSTANCES) for k, n in value.items()))):
        return (f'a whole number from 1 to {MAX_INSTANCES} for every variant, or an object of them per variant, '
                f'e.g. {{"onnx-int8": 2}}')


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
    "max_batch_tokens": ("--max-batch-tokens", "max_batch_tokens", _count(1)),
    "max_delay_ms": ("--max-delay-ms", "max_delay_ms", _number(0, inclusive=True)),
    "max_queue": ("--max-queue", "max_queue", _queue_limit),
    "max_queue_bytes": ("--max-queue-bytes", "max_queue_bytes", _count(1 << 20)),
    "timeout_ms": ("--timeout-ms", "timeout_ms", _number(0, inclusive=False)),
    "instances": ("--instances", "instances", _instances),
    "priority_levels": ("--priority-levels", "priority_levels", _count(1, MAX_PRIORITY_LEVELS)),
    "default_priority": ("--default-priority", "default_priority", _count(1, MAX_PRIORITY_LEVELS)),
    "variants": ("--variants", "variants", _names),
    "traffic": ("--ab", "ab", _weights),
}
_DEFAULTS = ServeConfig(artifact_dir="")


@dataclass(frozen=True)
class ModelSettings:
    """The settings one model is served with, and where each came from."""

    max_batch_size: int
    max_delay_ms: float
    max_queue: int | list[int]    # images each priority level may queue: one for all, or one per level
    max_queue_bytes: int          # what its requests may hold in memory at once (see memory_budget)
    timeout_ms: float
    instances: int | dict[str, int]  # inference workers per variant: one number for all, or per variant
    priority_levels: int
    default_priority: int         # a request's priority when it names none
    variants: list[str] | None
    traffic: dict[str, float] | str | None  # from the file: weights; from the flag: --ab as given
    max_batch_tokens: int | None = None  # a text model's batches: at most this many padded tokens (None: no cap)
    sources: dict[str, str] = field(default_factory=dict)  # key -> file, flag or default

    @property
    def queue_limits(self) -> list[int]:
        """Each priority level's queue limit in images, the highest priority first."""
        return list(self.max_queue) if isinstance(self.max_queue, list) else [self.max_queue] * self.priority_levels

    @property
    def max_images(self) -> int:
        """The most images one request may carry: the largest level's queue limit."""
        return max(self.queue_limits)

    @property
    def max_json_images(self) -> int:
        """The most images one JSON request may carry as numbers (or base64): a batch's worth. JSON
        numbers are the costliest form to read, and a request larger than a batch gains nothing."""
        return min(self.max_batch_size, self.max_images)

    def instances_of(self, variant: str) -> int:
        if isinstance(self.instances, dict):
            return self.instances.get(variant, 1)
        return self.instances

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
        """The server's BatchingConfig with this model's batch size, token budget, delay, queue limits
        and priority levels."""
        return replace(server_wide, max_batch_size=self.max_batch_size, max_batch_tokens=self.max_batch_tokens,
                       max_delay_ms=self.max_delay_ms, max_queue=self.queue_limits)

    def for_texts(self) -> "ModelSettings":
        """These settings for a model that takes texts: its window TEXT_MAX_DELAY_MS where nothing set it."""
        if self.sources["max_delay_ms"] != "default":
            return self
        return replace(self, max_delay_ms=TEXT_MAX_DELAY_MS)

    def check_batch_tokens(self, max_length: int | None) -> None:
        """A UserError when max_batch_tokens is set for an image model (`max_length` None) or below a
        text model's max length: one full-length text must fit a batch."""
        if self.max_batch_tokens is None:
            return
        where = f"{SETTINGS_FILE} max_batch_tokens" if self.sources["max_batch_tokens"] == "file" \
            else "--max-batch-tokens"
        if max_length is None:
            raise UserError(f"{where} applies to text models only; this model takes images (cap its batches with "
                            f"max_batch_size)")
        if self.max_batch_tokens < max_length:
            raise UserError(f"{where} is {self.max_batch_tokens}, below the model's max length {max_length}: give at "
                            f"least {max_length}, so that one full-length text fits a batch")

    def check_variants(self, served: list[str]) -> None:
        """A UserError when the instances name a variant that is not served."""
        if isinstance(self.instances, dict):
            unknown = [n for n in self.instances if n not in served]
            if unknown:
                where = f"{SETTINGS_FILE} instances" if self.sources["instances"] == "file" else "--instances"
                raise UserError(f"{where} names {', '.join(map(repr, unknown))}, which "
                                f"{'is' if len(unknown) == 1 else 'are'} not served ({', '.join(served)})")


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
    data = read_small_json(path, MAX_SETTINGS_BYTES, "settings")
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
    if values["max_delay_ms"] is None:  # an image model's; a text model's is its own (ModelSettings.for_texts)
        values["max_delay_ms"] = IMAGE_MAX_DELAY_MS
    if values["max_queue_bytes"] is None:
        values["max_queue_bytes"] = cfg.queue_bytes()
    levels = values["priority_levels"]
    if values["default_priority"] is None:  # the lowest: a caller who names a priority goes first
        values["default_priority"] = levels
    if values["default_priority"] > levels:
        where = SETTINGS_FILE if "file" in (sources["default_priority"], sources["priority_levels"]) else "the flags"
        raise UserError(f"{where}: default_priority {values['default_priority']} is not one of the priority "
                        f"levels 1..{levels} (priority_levels {levels})")
    if isinstance(values["max_queue"], list) and len(values["max_queue"]) != levels:
        raise UserError(f"{SETTINGS_FILE}: max_queue lists {len(values['max_queue'])} limits for "
                        f"{levels} priority level{'s' if levels > 1 else ''}: give one per level, or one number")
    return ModelSettings(**values, sources=sources)
