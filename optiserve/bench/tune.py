"""`optiserve tune`: the variant and serving settings (max batch size, batching delay, instances,
and a text model's padded-token budget a batch where --batch-tokens asks) with the highest
throughput whose p99 latency meets an objective, measured with the project's own load generator
against real `optiserve serve` processes — so the rate it claims is one a server started with
the `serving.json` it writes has sustained here.

Open loop (the default): a point's throughput is the highest request rate whose p99 stays within
the objective with every request answered and no backlog (the answered rate keeps up with the
rate the requests were counted as sent at: keeps_up) and which leaves a fifth of the point's
capacity spare, found by bracketing from a closed-loop estimate of that capacity. Closed loop:
the highest throughput of 1, 2, 4, ... concurrent callers whose p99 meets the objective. A step,
point or confirmation that missed says which criterion it missed, with its figures (missed).

The search prunes: batch sizes double until doubling stops raising the throughput, and a variant
whose engine, timed offline by `optimize`, cannot run as fast as the incumbent point is served
is not measured at all. Every measured point is saved to tune.json as soon as it is known, so
`--resume` goes on from where an interrupted run stopped.

Short load steps miss what a long run meets (a stall every few seconds, a queue that grows
slowly near capacity), so the winner is confirmed before anything is claimed: a fresh server
started with the settings about to be written takes the winner's load for `confirm_s` (20 s by
default, as long as the replay that holds tune to its claim); where its p99 misses the objective
the load is lowered by CONFIRM_BACKOFF and tried again. An open loop claims CLAIM_SHARE of the
load that held (its p99 the one measured at that higher load; the load counted as sent where the
Poisson sample was lighter than the nominal rate); a closed loop, the callers that held.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from optiserve.artifacts import chosen_accuracy, read_manifest
from optiserve.batch_window import TEXT_MAX_DELAY_MS
from optiserve.bench.loadgen import Load, generate_load, run_load, suits_uvloop
from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import environment
from optiserve.bench.senders import RawImageSender, TextPlainSender
from optiserve.bench.texts import TextLoad
from optiserve.errors import UserError
from optiserve.files import atomic_write, sha256_of
from optiserve.tasks import task_of

TUNE_FILE = "tune.json"
SETTINGS_FILE = "serving.json"
FORMAT = 1
MAX_RATE_STEPS = 6        # open-loop rates tried per point
RATE_PRECISION = 0.08     # stop bracketing once the bracket is this narrow (relative)
FLOOR_OVERLAP = 0.5       # requests in flight on average below which a step's fastest answer is a lone request's
KEEPS_UP = 0.95           # no backlog: the answered rate is at least this share of the rate sent (keeps_up)
HEADROOM = 0.8            # open-loop rates are tried only up to this share of the most the point ever answered:
# at the edge of capacity a queue grows slowly, which a window of seconds does not show and a longer run does
DOUBLING_GAIN = 1.03      # a doubled batch size must raise the throughput by more than this to go on
CONFIRM_TRIES = 5         # loads the winner is confirmed at, each CONFIRM_BACKOFF of the one before
CONFIRM_BACKOFF = 0.85
CLAIM_SHARE = 0.9         # an open loop claims this share of the load that held: near capacity a load that held
# once can still meet a stall on the next run, and the spare tenth is what lets the queue drain after one


@dataclass
class TuneConfig:
    folder: Path
    slo_p99_ms: float
    max_accuracy_drop: float | None = None  # points of the measure the task's gate judges, below fp32
    duration_s: float = 10.0                # measured seconds per load step
    warmup_s: float = 1.0
    mode: str = "open"                       # open | closed
    variants: list[str] | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    delays_ms: list[float] | None = None     # None: 1 ms and a tenth of the objective
    instances: list[int] | None = None       # None: 1, and 2 where there are 2 cores or more
    batch_tokens: list[int] | None = None    # a text model's max_batch_tokens tried; None: not searched (the folder's kept)
    images: list[bytes] = field(default_factory=list)
    texts: TextLoad | None = None            # a text model's load (its tokens counted), sent instead of images
    confirm_s: float = 20.0                  # the winner's confirming run
    resume: bool = False
    progress: bool = True
    ready_within_s: float = 300.0
    _load: dict | None = field(default=None, init=False, repr=False, compare=False)

    def objective(self) -> dict:
        """What a resumed run must share with the tune.json it continues: the objective, and the load
        its points were measured under (the texts, or the images, by their digest)."""
        load = {k: v for k, v in self.load().items() if k != "texts"}  # the contents, wherever the file is now
        return {"slo_p99_ms": self.slo_p99_ms, "mode": self.mode, "duration_s": self.duration_s,
                "max_accuracy_drop": self.max_accuracy_drop, "load": load}

    def load(self) -> dict:
        """What the load sends, as tune.json records it (worked out once: the load does not change)."""
        if self._load is None:
            if self.texts is not None:
                self._load = self.texts.settings()
            else:
                self._load = {"images": len(self.images), "sha256": sha256_of(self.images)}
        return self._load


@dataclass(frozen=True)
class Point:
    variant: str
    max_batch_size: int
    max_delay_ms: float
    instances: int
    max_batch_tokens: int | None = None  # a text model's padded-token budget a batch; None: not tuned

    @classmethod
    def of(cls, measured: dict) -> "Point":
        """The point a measured result (a tune.json point, or the winner) was measured at."""
        return cls(measured["variant"], measured["max_batch_size"], measured["max_delay_ms"], measured["instances"],
                   measured.get("max_batch_tokens"))

    @property
    def key(self) -> str:
        tokens = "" if self.max_batch_tokens is None else f" t{self.max_batch_tokens}"
        return f"{self.variant} b{self.max_batch_size} d{self.max_delay_ms:g} i{self.instances}{tokens}"

    def settings(self) -> dict:
        """The serving.json keys that serve this point (max_batch_tokens only where it was tuned)."""
        return {"variants": [self.variant], "max_batch_size": self.max_batch_size,
                "max_delay_ms": self.max_delay_ms, "instances": self.instances,
                **({} if self.max_batch_tokens is None else {"max_batch_tokens": self.max_batch_tokens})}


def candidates(manifest: dict, cfg: TuneConfig) -> tuple[list[str], dict[str, str]]:
    """The variants worth tuning, fastest offline first, and why each other one was left out."""
    from optiserve.runtime.variants import select_variants

    entries = {e["name"]: e for e in manifest["variants"]}
    left_out = {}
    if cfg.variants:
        unknown = [n for n in cfg.variants if n not in entries]
        if unknown:
            raise UserError(f"--variants: {', '.join(unknown)} not in the manifest; it has {', '.join(entries)}")
    chosen = [e["name"] for e in select_variants(manifest, cfg.variants)]
    for name in entries:
        if name not in chosen:
            left_out[name] = "not accepted, or cannot run here" if not cfg.variants else "not asked for"
    if cfg.max_accuracy_drop is not None:
        for name in list(chosen):
            drop = accuracy_drop(manifest, entries[name])
            if drop is not None and drop > cfg.max_accuracy_drop:
                chosen.remove(name)
                left_out[name] = f"accuracy {drop:.2f} points below fp32 (--max-accuracy-drop {cfg.max_accuracy_drop:g})"
    if not chosen:
        raise UserError("no variant to tune: " + "; ".join(f"{n}: {why}" for n, why in left_out.items()))
    return sorted(chosen, key=lambda n: -offline_ceiling(entries[n])), left_out


def accuracy_drop(manifest: dict, entry: dict) -> float | None:
    """Points of the measure its task's gate judges that the variant lost against the baseline, as
    the optimizer measured them on the validation images, which choose (0 for the baseline;
    tasks.Task.accuracy_drop); None where nothing was measured."""
    if entry["name"] == manifest.get("baseline"):
        return 0.0
    baseline = next((e for e in manifest["variants"] if e["name"] == manifest.get("baseline")), None)
    accuracy, base = chosen_accuracy(entry), chosen_accuracy(baseline) if baseline else None
    if not accuracy or not base:
        return None
    return task_of(manifest).accuracy_drop(accuracy, base)


ACCURACY_MEASURES = {"top1": "top-1", "miou": "mIoU", "miou_fp32": "mIoU vs fp32", "map50": "mAP@0.5",
                     "map50_fp32": "mAP@0.5 vs fp32", "cosine_mean": "cosine to fp32",
                     "agreement": "agreement with fp32"}


def accuracy_text(manifest: dict, entry: dict) -> str:
    """The variant's accuracy as the manifest records it, for the report."""
    acc = entry.get("accuracy") or {}
    parts = [f"{label} {acc[key]:.4f}" if key in ("cosine_mean", "map50", "map50_fp32") else
             f"{label} {100 * acc[key]:.2f}%"
             for key, label in ACCURACY_MEASURES.items() if isinstance(acc.get(key), (int, float))]
    drop = accuracy_drop(manifest, entry)
    if drop and entry["name"] != manifest.get("baseline"):
        where = " on validation" if entry.get("validation") else ""  # the budget's basis; the figures above: test
        parts.append(f"{-drop:+.2f} points vs {manifest.get('baseline')}{where}")
    text = ", ".join(parts) or "not measured"
    return f"{text} ({entry['status']})" if entry.get("status") else text


def instance_counts(cfg: TuneConfig) -> list[int]:
    """The instances per variant tried: as asked, else 1, and 2 where there are 2 cores or more."""
    return cfg.instances or ([1, 2] if (os.cpu_count() or 1) >= 2 else [1])


def delays_ms(cfg: TuneConfig) -> list[float]:
    """The batching delays tried above batch size 1: as asked, else 1 ms and a tenth of the objective,
    and for a text model its own default too (a batch cut as soon as an instance is free)."""
    own = [TEXT_MAX_DELAY_MS] if cfg.texts is not None else []
    return cfg.delays_ms or sorted({*own, 1.0, round(cfg.slo_p99_ms / 10, 1)})


def server_failure(e: RuntimeError) -> str:
    """One line on why a server did not start: its own error line where it printed one."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    said = [line for line in lines if "error:" in line]
    return (said[-1] if said else lines[0] if lines else "the server did not start")[:400]


def offline_ceiling(entry: dict) -> float:
    """Images/s the variant's engine ran at offline when `optimize` timed it (its best batch size):
    what a server of it cannot beat by much. 0 when it was not timed."""
    rates = [int(b) * 1000 / ms for b, ms in (entry.get("latency_ms") or {}).items() if ms]
    return max(rates, default=0.0)


def stage_folder(folder: Path, into: Path) -> Path:
    """A copy of the model folder to serve each point from, with a serving.json of its own per
    point (`point_settings`); hard-linked where the filesystem allows, else copied."""
    stage = into / folder.name
    stage.mkdir()
    for item in folder.iterdir():
        if item.name in (SETTINGS_FILE, TUNE_FILE) or item.name.startswith("tune."):
            continue
        target = stage / item.name
        if item.is_dir():
            shutil.copytree(item, target)
            continue
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)
    return stage


def own_settings(folder: Path) -> dict:
    """The folder's serving.json ({} without one, or when it is not a JSON object)."""
    try:
        settings = json.loads((folder / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def point_settings(own: dict, point: "Point") -> dict:
    """What serves `point`: the folder's own settings (queue limits, timeouts, priorities) with the
    tuned ones replaced, and no traffic split naming variants that are no longer served. The
    server that measures a point runs with exactly what tune writes for it."""
    settings = {**own, **point.settings()}
    if isinstance(settings.get("traffic"), dict) and set(settings["traffic"]) - {point.variant}:
        del settings["traffic"]
    return settings


def _summary(run, offered: float | None, window_s: float) -> dict:
    """One load step as tune.json keeps it: `requests` counts every request sent in the measured
    window (answered or failed), `window_s` is that window and `drain_s` how long after it the last
    answer came (`rps` is answered over both); `offered` is an open loop's nominal rate."""
    s = run.window_summary()
    return {"level": run.level, "rps": round(s["rps"], 2), "min_ms": round(s["min"], 2), "p50_ms": round(s["p50"], 2),
            "p99_ms": round(s["p99"], 2),
            "requests": s["requests"], "failed": s["failed"], "window_s": window_s,
            "drain_s": round(max(0.0, run.duration_s - window_s), 3), **({"offered": offered} if offered else {}),
            **_texts_answered(run)}


def _texts_answered(run) -> dict:
    """A text load's step: the texts and tokens its answered requests carried ({} for images)."""
    tokens = run.records.get("tokens")
    if tokens is None:
        return {}
    answered = [i for i, ok in enumerate(run.records["ok"]) if ok]
    return {"texts": len(answered) * run.images_per_request, "tokens": int(sum(tokens[i] for i in answered))}


def keeps_up(sent: int, answered: int, window_s: float, drain_s: float) -> bool:
    """Whether a server kept up with an open-loop step: its answers, over the window and the
    `drain_s` after it until the last one, came at KEEPS_UP or more of the rate at which the `sent`
    requests were sent in `window_s`.

    Why the count sent and not the nominal rate times the window: arrivals are Poisson, so the count
    in a window is itself random, sd sqrt(expected) — 97 expected at 48.6/s in 2 s, give or take 10,
    twice the 5% the share allows — and every step draws its arrivals from the same seed, so a light
    sample stays light on every try. A z*sqrt(expected) allowance would have to pass a server
    answering three quarters of the nominal rate at 80 expected to fail a sound one only 1% of the
    time; the count sent is known, so there is no counting noise to allow for: the server is judged
    on the load it got (a backlog shows as answers drained late), and at high counts, where the count
    sent is the expected one, the rule is the 95% share of the nominal rate."""
    if sent <= 0 or window_s <= 0:
        return False
    return answered / (window_s + max(0.0, drain_s)) >= KEEPS_UP * sent / window_s


def _keeps_up(step: dict) -> bool:
    """keeps_up for a step as tune.json keeps it; one written before the window was kept is judged
    as it was then, against the nominal rate. Closed-loop steps have no rate to keep up with."""
    if "offered" not in step:
        return True
    if "window_s" not in step:
        return step["rps"] >= KEEPS_UP * step["offered"]
    return keeps_up(step["requests"], step["requests"] - step["failed"], step["window_s"], step["drain_s"])


def _meets(step: dict, cfg: TuneConfig) -> bool:
    return not missed(step, cfg.slo_p99_ms)


def missed(step: dict, slo_p99_ms: float) -> list[str]:
    """Each criterion a load step missed, in words with its own figures (empty where it met the
    objective): nothing answered, failed requests, p99 above the objective, an answered rate behind
    the rate sent. A confirmation or point that did not hold says which with these."""
    answered = step["requests"] - step["failed"]
    if answered <= 0:
        return [f"none of {step['requests']} requests answered" if step["requests"] else "nothing answered"]
    why = []
    if step["failed"]:
        why.append(f"{step['failed']} of {step['requests']} requests failed")
    if step["p99_ms"] > slo_p99_ms:
        why.append(f"p99 {step['p99_ms']:.1f} ms > the objective's {slo_p99_ms:g} ms")
    if not _keeps_up(step):
        if "window_s" in step:
            sent_rate = step["requests"] / step["window_s"]
            why.append(f"fell behind: {answered} answered by {step['drain_s'] * 1000:.0f} ms after the "
                       f"{step['window_s']:g} s window that sent {step['requests']} ({step['offered']:g}/s "
                       f"nominal), {step['rps']:.1f}/s < {KEEPS_UP:.0%} of the {sent_rate:.1f}/s sent "
                       f"({KEEPS_UP * sent_rate:.1f}/s)")
        else:
            why.append(f"answered {step['rps']:.1f}/s < {KEEPS_UP:.0%} of the {step['offered']:g}/s offered "
                       f"({KEEPS_UP * step['offered']:.1f}/s)")
    return why


def below_the_floor(step: dict, slo_p99_ms: float) -> bool:
    """Whether an open-loop step shows that no lower rate can meet the objective: even its fastest
    answer took longer, at a rate where requests seldom overlap (fewer than FLOOR_OVERLAP in flight on
    average), so that answer is a lone request's, which waiting less cannot make faster."""
    fastest = step.get("min_ms")
    return (fastest is not None and fastest > slo_p99_ms and "offered" in step
            and step["offered"] * fastest / 1000 < FLOOR_OVERLAP)


def point_missed(point: dict, slo_p99_ms: float) -> str:
    """Why a measured point meets the objective at no load: what its easiest load step (the lowest
    rate, or fewest callers, tried) missed; "" where it met it or has no step to say."""
    steps = [s for s in point.get("steps") or [] if not s.get("probe")]
    if point.get("meets") or not steps:
        return ""
    easiest = min(steps, key=lambda s: s["level"])
    unit = "req/s" if "offered" in easiest else "callers"
    return f"at {easiest['level']:g} {unit}: " + "; ".join(missed(easiest, slo_p99_ms))


def is_point(point, variants: set[str]) -> bool:
    """Whether `point` (from a tune.json) holds a Point's fields, for one of `variants`."""
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    return isinstance(point, dict) and {"variant", "max_batch_size", "max_delay_ms", "instances"} <= set(point) and \
        point["variant"] in variants and whole(point["max_batch_size"]) and whole(point["instances"]) and \
        isinstance(point["max_delay_ms"], (int, float)) and not isinstance(point["max_delay_ms"], bool) and \
        (point.get("max_batch_tokens") is None or whole(point["max_batch_tokens"]))


def is_result(point) -> bool:
    """Whether a resumed tune.json point holds what `Tuner._measure` writes beside the point's fields."""
    return isinstance(point, dict) and {"rate", "meets", "steps", "level", "p99_ms"} <= set(point) and \
        isinstance(point["meets"], bool) and isinstance(point["rate"], (int, float)) and \
        isinstance(point["steps"], list)


def _differences(was: dict, now: dict) -> str:
    """What differs between a tune.json's objective and this run's, field by field (a load by its parts)."""
    out = []
    for key in [*was, *(k for k in now if k not in was)]:
        before, after = was.get(key), now.get(key)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            out.append(f"{key}: {_differences(before, after)}")
        else:
            out.append(f"{key} {str(before)[:80]} (this run: {str(after)[:80]})")
    return ", ".join(out)


def _is_measured(point, variants: set[str]) -> bool:
    """Whether a resumed tune.json point has the shape `Tuner._measure` writes, for one of `variants`."""
    return is_result(point) and is_point(point, variants)


def held_load(step: dict) -> float:
    """The load a step put on its server: an open loop's nominal rate, or the rate its requests were
    counted as sent at where the Poisson sample was lighter — a step is judged on the load it got
    (keeps_up), so what is confirmed and claimed is built on no more than that; a closed loop's
    callers."""
    if "offered" in step and step.get("window_s"):
        return min(float(step["level"]), step["requests"] / step["window_s"])
    return step["level"]


def claimed_rate(held: dict, mode: str) -> float:
    """What the confirming try that held lets tune claim: closed loop, the throughput its callers got;
    open loop, CLAIM_SHARE of the load it held (held_load)."""
    if mode != "open":
        return float(held["rps"])
    return round(CLAIM_SHARE * held_load(held), 1)


def confirm_failure(key: str, last: dict, cfg: TuneConfig) -> str:
    """The one line when the winner held at no confirming load: what its last, lowest, try missed."""
    unit = "req/s" if cfg.mode == "open" else "callers"
    why = missed(last, cfg.slo_p99_ms)
    advice = "this machine is too noisy for the objective; loosen --slo-p99-ms, or run --resume to confirm again" \
        if any(w.startswith("p99") for w in why) else \
        "the server did not keep up with it on this machine as loaded now; run --resume to confirm again"
    return (f"the winner ({key}) did not hold the objective (p99 <= {cfg.slo_p99_ms:g} ms, every request answered "
            f"without falling behind) for {cfg.confirm_s:g} s even at {last['level']:g} {unit}: {'; '.join(why)}: "
            f"{advice}")


class Tuner:
    """Measures points against servers it starts and keeps every result in tune.json."""

    def __init__(self, cfg: TuneConfig):
        self.cfg = cfg
        self._read_folder()
        self.points: dict[str, dict] = {}
        self.confirmed_before: dict | None = None  # a resumed tune.json's confirmed winner
        self.line = ProgressLine(cfg.progress)
        self.started = time.monotonic()
        self.done = 0
        self.total = 0
        if cfg.resume:
            self._resume()

    def _read_folder(self) -> None:
        self.manifest = read_manifest(self.cfg.folder)
        self.model = self.manifest.get("model")
        self.own = own_settings(self.cfg.folder)  # kept in every point's settings, and in what is written

    # ---- the search --------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        with tempfile.TemporaryDirectory(prefix="optiserve-tune-") as tmp:
            stage = self._stage(Path(tmp))
            left_out, pruned = self._search(stage)
            winner = self.winner()
            if winner is None:
                self.line.done(f"tune: {len(self.points)} points measured in {time.monotonic() - self.started:.0f} s")
                failed = [p["failed"] for p in self.points.values() if p.get("failed")]
                if failed and len(failed) == len(self.points):
                    raise UserError(f"no point's server started ({len(failed)} tried): {failed[0]}")
                raise UserError(f"no setting met p99 <= {cfg.slo_p99_ms:g} ms with every request answered at any "
                                f"load here (closest: "
                                f"{self._closest()}); loosen --slo-p99-ms or allow another variant")
            try:
                confirmation = self._confirmed_before(winner) or self._confirm(stage, winner)
            except RuntimeError as e:
                raise UserError(f"the winner's server did not start again to confirm it: {server_failure(e)} "
                                f"(tune.json is kept: --resume confirms again)") from None
        self.line.done(f"tune: {len(self.points)} points measured and the winner confirmed in "
                       f"{time.monotonic() - self.started:.0f} s")
        result = self._document(winner, left_out, pruned, confirmation)
        self._save(result)
        self._write_settings(winner)
        return result

    def _stage(self, into: Path) -> Path:
        """What each point's server serves: a copy of the model folder."""
        return stage_folder(self.cfg.folder, into)

    def _search(self, stage: Path) -> tuple[dict[str, str], dict[str, str]]:
        """Measure the points worth measuring: each variant (fastest offline first, skipped where its
        engine cannot beat the incumbent), instances, a text model's token budgets, batch sizes
        doubling while doubling pays, and the delays. Returns the variants left out and those pruned, each with why."""
        cfg = self.cfg
        names, left_out = candidates(self.manifest, cfg)
        entries = {e["name"]: e for e in self.manifest["variants"]}
        instances = instance_counts(cfg)
        budgets = cfg.batch_tokens or [None]
        self.total = len(names) * len(instances) * len(budgets) * \
            sum(1 if b == 1 else len(delays_ms(cfg)) for b in cfg.batch_sizes)
        pruned: dict[str, str] = {}
        for variant in names:
            incumbent = self.winner()
            ceiling = offline_ceiling(entries[variant])
            if incumbent is not None and ceiling and ceiling < incumbent["rate"]:
                unit = "texts" if cfg.texts is not None else "images"
                pruned[variant] = (f"its engine ran at {ceiling:.0f} {unit}/s offline, below the incumbent's "
                                   f"{incumbent['rate']:.0f} served")
                continue
            for n in instances:
                for t in budgets:
                    self._batch_sizes(stage, lambda b, d: Point(variant, b, d, n, t))
        return left_out, pruned

    def _batch_sizes(self, stage: Path, point_at) -> None:
        """Measure `point_at(max_batch_size, delay_ms)` for each batch size in turn (every delay above
        batch size 1) until doubling the batch size stops raising the throughput."""
        best_before = None
        for b in self.cfg.batch_sizes:
            here = [self._measure(stage, point_at(b, 0.0 if b == 1 else d))
                    for d in ([0.0] if b == 1 else delays_ms(self.cfg))]
            best = max(r["rate"] for r in here)
            if best_before is not None and best <= best_before * DOUBLING_GAIN:
                break  # doubling the batch stopped paying
            best_before = max(best, best_before or 0.0)

    def point_of(self, measured: dict) -> Point:
        """The point a measured result (a tune.json point, or the winner) was measured at."""
        return Point.of(measured)

    def _measure(self, stage: Path, point: Point) -> dict:
        if point.key in self.points:
            return self.points[point.key]
        self.done += 1
        self._show(point, "starting")
        try:
            with self._serving(stage, point) as base:
                steps = self._closed_search(base, point) if self.cfg.mode == "closed" else self._open_search(base, point)
                observed = self._observe(base)
        except RuntimeError as e:  # its server did not start or died (serve/launch.py): this point's row, not the end
            result = {**self._fields(point), "rate": 0.0, "p99_ms": None, "level": None, "meets": False, "capacity": 0.0,
                      "steps": [], "failed": server_failure(e)}
            self.points[point.key] = result
            self._save()
            return result
        capacity = max(s["rps"] for s in steps)
        good = [s for s in steps if s["meets"]]
        best = max(good, key=lambda s: s["rps"]) if good else None
        level = None if best is None else round(held_load(best), 1) if "offered" in best else best["level"]
        result = {**self._fields(point), "rate": best["rps"] if best else 0.0, "p99_ms": best["p99_ms"] if best else None,
                  "level": level, "meets": best is not None,
                  "capacity": capacity, "steps": steps, **observed}
        self.points[point.key] = result
        self._save()
        return result

    def _observe(self, base: str) -> dict:
        """What else tune.json keeps of a point, read from its server after the load (nothing here)."""
        return {}

    def _fields(self, point: Point) -> dict:
        """What tune.json keeps of the point a result was measured at."""
        return asdict(point)

    @contextlib.contextmanager
    def _serving(self, stage: Path, point: Point):
        """`optiserve serve` of the staged folder with exactly the serving.json `point` would write;
        yields its base URL."""
        from optiserve.serve.launch import served  # starts `optiserve serve` as a child process: never imported

        with atomic_write(stage / SETTINGS_FILE, "w") as f:
            json.dump(point_settings(self.own, point), f)
        args = ["--choose-seconds", "0", "--log-level", "warning"]
        if self.model:
            args += ["--model-name", str(self.model)]
        with served(stage, *args, ready_within_s=self.cfg.ready_within_s) as (base, _):
            yield base

    def _confirmed_before(self, winner: dict) -> dict | None:
        """The confirmation a resumed tune.json holds for this same winner and confirming time, if any."""
        before = self.confirmed_before or {}
        try:
            confirmation = before["confirmation"]
            held = confirmation["tries"][-1]
            if before["settings"] != self.point_of(winner).settings() or confirmation["seconds"] != self.cfg.confirm_s \
                    or held["meets"] is not True:
                return None
            rate = claimed_rate(held, self.cfg.mode)
            return {**confirmation, "rate": rate, "p99_ms": float(held["p99_ms"]), "level": held["level"]}
        except (KeyError, IndexError, TypeError, ValueError):
            return None  # none recorded, or not in the shape tune writes: confirm again

    def _confirm(self, stage: Path, winner: dict) -> dict:
        """Serve the winner afresh and hold its load for `confirm_s`, lowering it by CONFIRM_BACKOFF
        until the objective holds: the tries, and the claim (an open loop's rate is CLAIM_SHARE of the
        offered one that held; a closed loop's is the throughput its callers got). UserError
        (tune.json kept, so --resume only confirms again) when no load held."""
        cfg = self.cfg
        point = self.point_of(winner)
        level = winner["level"]
        tries = []
        with self._serving(stage, point) as base:
            for _ in range(CONFIRM_TRIES):
                what = f"{level:g} req/s" if cfg.mode == "open" else f"{level:g} callers"
                self._show(point, f"confirming {what} for {cfg.confirm_s:g} s")
                step = self._load(base, cfg.mode, level, point, cfg.confirm_s, max(2.0, cfg.warmup_s))
                tries.append(step)
                if step["meets"]:
                    break
                level = round(level * CONFIRM_BACKOFF, 1) if cfg.mode == "open" else level - 1
                if level < (1.0 if cfg.mode == "open" else 1):
                    break
        held = tries[-1] if tries[-1]["meets"] else None
        if held is None:
            self._save()
            self.line.done(f"tune: {len(self.points)} points measured, the winner not confirmed")
            raise UserError(confirm_failure(point.key, tries[-1], cfg))
        return {"seconds": cfg.confirm_s, "tries": tries, "p99_ms": held["p99_ms"], "level": held["level"],
                "rate": claimed_rate(held, cfg.mode)}

    def _load(self, base: str, mode: str, level: float, point: Point, seconds: float | None = None,
              warmup_s: float | None = None) -> dict:
        load = Load(mode, level, seconds or self.cfg.duration_s,
                    self.cfg.warmup_s if warmup_s is None else warmup_s, point.variant, timeout_s=60,
                    model=self.model)
        if self.cfg.texts is not None:
            sender = TextPlainSender(base, self.cfg.texts, self.model, point.variant)
        else:
            sender = RawImageSender(base, self.cfg.images, self.model, point.variant)
        run = run_load(generate_load(base, self.cfg.images, load, sender=sender), suits_uvloop(load.mode))
        step = _summary(run, level if mode == "open" else None, load.duration_s)
        step["meets"] = _meets(step, self.cfg)
        return step

    def _closed_search(self, base: str, point: Point) -> list[dict]:
        """1, 2, 4, ... callers until the p99 passes the objective or the throughput stops rising."""
        steps: list[dict] = []
        concurrency = 1
        while concurrency <= 4 * point.max_batch_size * point.instances + 4:
            self._show(point, f"closed loop, {concurrency} callers")
            step = self._load(base, "closed", concurrency, point)
            steps.append(step)
            if not step["meets"] or (len(steps) > 1 and step["rps"] <= steps[-2]["rps"] * DOUBLING_GAIN):
                break
            concurrency *= 2
        return steps

    def _open_search(self, base: str, point: Point) -> list[dict]:
        """Bracket the highest rate that meets the objective below HEADROOM of the point's capacity
        (a closed-loop probe's throughput, raised by any step that answered more): the cap first,
        then halving the bracket between the best rate that held and the lowest that did not; lower
        rates are not tried once even a lone request's answer misses the objective (below_the_floor)."""
        self._show(point, "estimating capacity")
        probe = self._load(base, "closed", max(2, 2 * point.max_batch_size * point.instances), point)
        probe["probe"] = True
        probe["meets"] = False  # a closed-loop probe sets where to start, it claims nothing
        steps = [probe]
        good, bad = 0.0, None
        rate = max(1.0, HEADROOM * probe["rps"])
        for _ in range(MAX_RATE_STEPS):
            self._show(point, f"open loop, {rate:.0f} req/s")
            step = self._load(base, "open", round(rate, 1), point)
            steps.append(step)
            capacity = max(s["rps"] for s in steps)
            if step["meets"]:
                good = rate
            else:
                bad = rate
            top = bad if bad is not None else HEADROOM * capacity
            if top <= good * (1 + RATE_PRECISION) or (not good and below_the_floor(step, self.cfg.slo_p99_ms)):
                break
            rate = (good + top) / 2 if good else top / 2
        return steps

    # ---- bookkeeping -------------------------------------------------------------------------
    def winner(self) -> dict | None:
        """The measured point with the highest throughput that meets the objective (ties: fewer
        instances, then smaller batches)."""
        good = [p for p in self.points.values() if p["meets"]]
        if not good:
            return None
        return max(good, key=lambda p: (p["rate"], -p["instances"], -p["max_batch_size"]))

    def _closest(self) -> str:
        steps = [(s["p99_ms"], self.point_of(p).key, s) for p in self.points.values() for s in p["steps"]
                 if s["requests"]]
        if not steps:
            return "nothing answered"
        p99, point, step = min(steps, key=lambda x: x[0])
        unit = "req/s" if "offered" in step else "callers"
        return f"{point} at {step['level']:g} {unit}: " + "; ".join(missed(step, self.cfg.slo_p99_ms))

    def _show(self, point: Point, what: str) -> None:
        elapsed = time.monotonic() - self.started
        self.line.update(f"tune [{self.done}/{self.total} points at most, {elapsed:.0f} s] {point.key}: {what}",
                         force=True)

    def _document(self, winner: dict | None, left_out: dict | None = None, pruned: dict | None = None,
                  confirmation: dict | None = None) -> dict:
        doc = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": self.model,
               "objective": self.cfg.objective(), "environment": environment(),
               "load": self.cfg.load(),
               "points": list(self.points.values())}
        if left_out is not None:
            doc["left_out"], doc["pruned"] = left_out, pruned or {}
        if winner is not None and confirmation is not None:
            doc["winner"] = {"settings": self.point_of(winner).settings(),
                             "rate": confirmation["rate"], "p99_ms": confirmation["p99_ms"], "mode": self.cfg.mode,
                             **({"concurrency": confirmation["level"]} if self.cfg.mode == "closed" else {}),
                             "searched": {"rate": winner["rate"], "p99_ms": winner["p99_ms"]},
                             "confirmation": {"seconds": confirmation["seconds"], "tries": confirmation["tries"]}}
        return doc

    def _save(self, doc: dict | None = None) -> None:
        with atomic_write(self.cfg.folder / TUNE_FILE, "w") as f:
            json.dump(doc or self._document(None), f, indent=1)

    def _resume(self) -> None:
        path = self.cfg.folder / TUNE_FILE
        if not path.exists():
            raise UserError(f"--resume: there is no {path} to go on from; run without --resume")
        try:
            doc = json.loads(path.read_text())
            objective, points = doc["objective"], doc["points"]
            measured = {self.point_of(p).key: p for p in points if self._is_measured(p)}
            if len(measured) != len(points):
                raise ValueError("a point is not one tune measured of this folder's variants")
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"--resume: {path} is not a tune.json ({e}); run without --resume to start over") from None
        if not isinstance(objective, dict) or "load" not in objective:
            raise UserError(f"--resume: {path} does not record the load its points were measured under (written by an "
                            f"earlier optiserve); run without --resume to start over")
        if objective != self.cfg.objective():
            raise UserError(f"--resume: {path} was measured for {_differences(objective, self.cfg.objective())}; give "
                            f"the same objective and load, or run without --resume to start over")
        self.points = measured
        self.confirmed_before = doc.get("winner") if isinstance(doc.get("winner"), dict) else None

    def _is_measured(self, point) -> bool:
        """Whether a resumed tune.json point is one this tuner measures."""
        return _is_measured(point, {e["name"] for e in self.manifest["variants"]})

    def _write_settings(self, winner: dict) -> None:
        """serving.json: the settings the winner was measured with."""
        point = self.point_of(winner)
        with atomic_write(self.cfg.folder / SETTINGS_FILE, "w") as f:
            json.dump(point_settings(self.own, point), f, indent=1)
