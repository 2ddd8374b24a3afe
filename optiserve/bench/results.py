"""The results file every `bench` command writes and `compare` reads: raw per-request records
(never pre-aggregated, so intervals can be recomputed), the settings and the software versions.

    {"format": "optiserve.bench/1", "kind": "engine" | "http" | "server", "created": ...,
     "settings": {...}, "environment": {...}, "model": {...},
     "variants": {name: {"backend", "precision", "accuracy", "size_bytes"}},
     "runs": [{"mode": "engine" | "closed" | "open", "level": N, "variant": name | null,
               "images_per_request": N, "duration_s": S, "records": {"latency_ms": [...], "ok": [...], ...}}]}

A text load's runs count texts in `images_per_request` (the settings say `texts`), and where its
tokens were counted each request's are in the records' `tokens`.

A run is one load setting: a batch size (engine), a concurrency (closed loop) or an arrival rate
(open loop). A run whose `variant` is null was routed by the server's A/B split, and its records
say which variant served each request.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from optiserve.errors import UserError
from optiserve.files import atomic_write, read_json
from optiserve.artifacts import reported_facts, versions
from optiserve.machine import cpu_line
from optiserve.runtime import engine_packages

FORMAT = "optiserve.bench/1"
MODES = ("engine", "closed", "open", "server")
LEVEL_NAMES = {"engine": "batch", "closed": "concurrency", "open": "rate", "server": "traffic"}


@dataclass
class Run:
    mode: str                  # engine | closed | open
    level: float               # batch size | concurrency | requests per second
    variant: str | None        # the variant asked for; None when the server's A/B split chose
    duration_s: float          # the measured window (warm-up excluded)
    images_per_request: int = 1
    records: dict[str, list] = field(default_factory=dict)  # column -> one value per request
    batch_size_counts: dict[str, int] | None = None  # images by the size of the batch they ran in (server's count)

    def window_summary(self) -> dict:
        """requests, failed, and over the answered ones req/s, the fastest answer, p50 and p99 (ms): one
        load window's line."""
        ok = self.records["ok"]
        lat = [x for x, good in zip(self.records["latency_ms"], ok) if good]
        if not lat:  # nothing answered: no latency is known, none is fast enough
            return {"requests": len(ok), "failed": ok.count(False), "rps": 0.0, "min": float("inf"),
                    "p50": float("inf"), "p99": float("inf")}
        return {"requests": len(ok), "failed": ok.count(False), "rps": len(lat) / self.duration_s,
                "min": float(min(lat)), "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))}

    def label(self) -> str:
        if self.mode == "server":
            return "server A/B traffic"
        level = f"{self.level:g}/s" if self.mode == "open" else f"{self.level:g}"
        return f"{self.mode} {LEVEL_NAMES[self.mode]} {level}"


def environment() -> dict:
    env = {**versions(engine_packages()), "platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu": cpu_line()}
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the environment record must never fail a run
        pass
    return env


def make_results(kind: str, runs: list[Run], settings: dict, model: dict | None = None,
                 variants: dict | None = None) -> dict:
    return {"format": FORMAT, "kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": settings, "environment": environment(), "model": model or {},
            "variants": variants or {}, "runs": list(runs)}


def variant_facts(manifest: dict) -> dict:
    """What the report quotes from a manifest about each variant: accuracy and size."""
    return {v["name"]: {**reported_facts(v), "status": v.get("status")} for v in manifest["variants"]}


def save_results(results: dict, path: str | Path) -> Path:
    path = Path(path)
    with atomic_write(path, "w") as f:
        json.dump({**results, "runs": [asdict(r) for r in results["runs"]]}, f)
    return path


def load_results(path: str | Path) -> dict:
    """Read a results file, with a clear error for anything that is not one."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such results file (write one with `optiserve bench engine|http --out`)")
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not an optiserve results file (expected format {FORMAT!r}, "
                        f"got {data.get('format') if isinstance(data, dict) else type(data).__name__!r})")
    data["runs"] = [Run(**r) for r in data["runs"]]
    return data


# perf_analyzer's CSV columns (latencies in microseconds), so our runs sit beside Triton's; the
# components we cannot observe from the client stay empty rather than invented.
PERF_ANALYZER_COLUMNS = ["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv",
                         "Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output",
                         "Client Recv", "p50 latency", "p90 latency", "p95 latency", "p99 latency"]
EXTRA_COLUMNS = ["Avg latency", "Request Rate", "Batch Size", "Variant", "Mode", "Requests", "Errors"]


def _usec(values) -> str:
    return f"{1000 * float(values):.0f}"


def to_csv(groups: list[dict]) -> str:
    """Rows of perf_analyzer-style CSV, one per (run, variant) group from `report.group_runs`."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(PERF_ANALYZER_COLUMNS + EXTRA_COLUMNS)
    for g in groups:
        ok = np.asarray(g["latency_ms"], dtype=np.float64)
        pct = np.percentile(ok, [50, 90, 95, 99]) if ok.size else [np.nan] * 4
        mean = lambda col: _usec(np.mean(g[col])) if g.get(col) else ""  # noqa: E731
        server = g.get("server_ms")
        network = _usec(np.mean(ok) - np.mean(server)) if server and ok.size else ""
        w.writerow([
            g["level"] if g["mode"] == "closed" else (1 if g["mode"] == "engine" else ""),
            f"{g['images_per_s']:.1f}", "", network, mean("queue_ms"), "", mean("compute_ms"), "", "",
            *(_usec(p) if ok.size else "" for p in pct),
            _usec(np.mean(ok)) if ok.size else "",
            g["level"] if g["mode"] == "open" else "",
            g["level"] if g["mode"] == "engine" else g["images_per_request"],
            g["variant"], g["mode"], g["requests"], g["errors"]])
    return out.getvalue()


OPTIONAL_COLUMNS = ("server_ms", "queue_ms", "compute_ms", "batch")


def group_runs(results: dict, source: str = "") -> list[dict]:
    """Split every run into one group per serving variant: the unit a report row describes.

    A group keeps the latencies of its successful requests (percentiles describe answers that
    arrived) and counts its failures by status; nothing is dropped.
    """
    groups = []
    for run in results["runs"]:
        rec = run.records
        n = len(rec.get("latency_ms", []))
        served = rec.get("variant") or [run.variant] * n
        names = sorted({v or run.variant or "(unrouted)" for v in served})
        for name in names:
            rows = [i for i in range(n) if (served[i] or run.variant or "(unrouted)") == name]
            ok_rows = [i for i in rows if rec["ok"][i]]
            statuses: dict[str, int] = {}
            for i in rows:
                key = str(rec["status"][i]) if "status" in rec else ("ok" if rec["ok"][i] else "error")
                statuses[key] = statuses.get(key, 0) + 1
            errors = [rec["error"][i] for i in rows if not rec["ok"][i] and rec.get("error") and rec["error"][i]]
            g = {"source": source, "mode": run.mode, "level": run.level, "variant": name,
                 "requested": run.variant, "label": run.label(), "duration_s": run.duration_s,
                 "images_per_request": run.images_per_request, "requests": len(rows),
                 "errors": len(rows) - len(ok_rows), "statuses": statuses, "error_examples": sorted(set(errors))[:3],
                 "latency_ms": [rec["latency_ms"][i] for i in ok_rows if rec["latency_ms"][i] is not None],
                 "throughput_per_s": len(ok_rows) / run.duration_s if run.duration_s else 0.0}
            g["images_per_s"] = g["throughput_per_s"] * run.images_per_request
            if "tokens" in rec:  # a text load's tokens, counted by the model's tokenizer: those answered
                g["tokens"] = int(sum(rec["tokens"][i] for i in ok_rows))
                g["tokens_per_s"] = g["tokens"] / run.duration_s if run.duration_s else 0.0
            if run.batch_size_counts is not None:
                g["batch_size_counts"] = run.batch_size_counts
            elif "batch" in rec:
                counts: dict[str, int] = {}
                for i in ok_rows:
                    if rec["batch"][i] is not None:
                        counts[str(rec["batch"][i])] = counts.get(str(rec["batch"][i]), 0) + 1
                g["batch_size_counts"] = counts
            for col in OPTIONAL_COLUMNS:
                if col in rec:
                    values = [rec[col][i] for i in ok_rows if rec[col][i] is not None]
                    if values:
                        g[col] = values
            groups.append(g)
    return groups
