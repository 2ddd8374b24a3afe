"""The search's frontier: the judged variants no other beats on both speed (at the throughput
batch) and accuracy (the task's headline measure on the validation images, which choose). The search's own candidates off the frontier,
or rejected by the gate, leave the folder (but a recommended one); their rows stay in the manifest with why."""

from __future__ import annotations

from optiserve.artifacts import chosen_accuracy
from optiserve.tasks import get_task

SERVABLE = ("accepted", "unvalidated")
KEPT_RECOMMENDED = "kept: a recommendation names it (the frontier weighs the throughput batch only)"


def _value(task, entry: dict) -> float:
    value = next(iter(task.headline(chosen_accuracy(entry)).values()))
    return float("-inf") if value is None else float(value)


def mark_frontier(entries: list[dict], batch: int, task_name: str, output_kind: str | None = None) -> None:
    """Sets each entry's `frontier`: {"on": bool, "why": None, or what keeps it off}. A variant is
    off when another servable one is at least as fast at `batch` and at least as accurate, and
    better on one of the two; a rejected one is off for its gate. `output_kind`: what the scores
    hold, where the task reads it."""
    task, n = get_task(task_name, output_kind), str(batch)
    pool = [e for e in entries if e["status"] in SERVABLE]
    for e in entries:
        if e["status"] not in SERVABLE:
            e["frontier"] = {"on": False, "why": f"{e['status']}: {e.get('reason')}"}
            continue
        speed, value = e["latency_ms"][n], _value(task, e)
        better = [o for o in pool if o is not e and o["latency_ms"][n] <= speed and _value(task, o) >= value
                  and (o["latency_ms"][n] < speed or _value(task, o) > value)]
        if better:
            by = min(better, key=lambda o: o["latency_ms"][n])
            e["frontier"] = {"on": False, "why": f"dominated by {by['name']} ({by['latency_ms'][n]:.2f} ms at batch "
                                                 f"{n}, {_measure(task, by)})"}
        else:
            e["frontier"] = {"on": True, "why": None}


def _measure(task, entry: dict) -> str:
    name, value = next(iter(task.headline(chosen_accuracy(entry)).items()))
    return f"{name} {100 * value:.2f}%" if value is not None else f"{name} not measured"


def drop_off_frontier(entries: list[dict], keep: set[str] = frozenset()) -> tuple[list[dict], list[dict]]:
    """The entries kept (all but the search's candidates off the frontier) and the rows of those
    dropped: name, status, accuracy, latency and why. `keep`: the recommended variants, kept off the
    frontier too (it is drawn at the throughput batch, and the latency choice at batch 1 may be a
    candidate that loses there); their `frontier.why` says so."""
    kept, dropped = [], []
    for e in entries:
        searched, off = "search" in e["settings"], not e["frontier"]["on"]
        if searched and off and e["name"] in keep:
            e["frontier"]["why"] += f"; {KEPT_RECOMMENDED}"
        if searched and off and e["name"] not in keep:
            dropped.append({k: e.get(k) for k in ("name", "backend", "precision", "status", "reason", "validation",
                                                  "latency_ms", "size_bytes", "settings")}
                           | {"dropped": e["frontier"]["why"]})
        else:
            kept.append(e)
    return kept, dropped
