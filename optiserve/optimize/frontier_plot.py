"""The search's frontier as a picture: images (or texts) per second at the throughput batch against
the task's measure, each variant a point with its 95% interval against the baseline (named on hover), the frontier
joined by a line and named.
Written as SVG by hand, so the optimizer needs no plotting library."""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from optiserve.artifacts import chosen_accuracy
from optiserve.tasks import task_of

WIDTH, HEIGHT, MARGIN = 720, 440, 64
FILE = "frontier.svg"


def _points(manifest: dict) -> list[dict]:
    """Name, images/s, measure (x100) and its interval, and where it stands, for every variant and
    every candidate the search dropped."""
    task, n = task_of(manifest), str(manifest["latency_batch"])
    rows = [(v, "frontier" if v["frontier"]["on"] else "kept") for v in manifest["variants"]]
    rows += [(d, "dropped") for d in manifest["search"]["dropped"]]
    points = []
    for entry, place in rows:
        accuracy = chosen_accuracy(entry)  # what the frontier was drawn on
        value = next(iter(task.headline(accuracy).values()))
        if value is None:
            continue
        y = 100 * value
        d = accuracy.get("vs_baseline")
        low, high = (y + d["ci95"][0] - d["points"], y + d["ci95"][1] - d["points"]) if d else (y, y)
        points.append({"name": entry["name"], "x": int(n) * 1000 / entry["latency_ms"][n], "y": y, "low": low,
                       "high": high, "place": place})
    return points


def render_frontier(manifest: dict) -> str:
    """The SVG text of the frontier plot of a manifest whose run searched."""
    points = _points(manifest)
    task = task_of(manifest)
    measure = next(iter(task.headline(chosen_accuracy(manifest["variants"][0]))))
    noun = "texts" if (manifest.get("input") or {}).get("kind") == "text" else "images"
    xs = [math.log10(p["x"]) for p in points]
    ys = [v for p in points for v in (p["low"], p["high"])]
    x0, x1 = min(xs) - 0.05, max(xs) + 0.3  # room for the fastest one's name
    y0, y1 = min(ys) - 0.5, max(ys) + 0.5

    def sx(x: float) -> float:
        return MARGIN + (math.log10(x) - x0) / (x1 - x0) * (WIDTH - 2 * MARGIN)

    def sy(y: float) -> float:
        return HEIGHT - MARGIN - (y - y0) / (y1 - y0) * (HEIGHT - 2 * MARGIN)

    color = {"frontier": "#1f6feb", "kept": "#6e7781", "dropped": "#cf222e"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="11">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(manifest["model"])}: speed '
           f'against {escape(measure)} (batch {manifest["latency_batch"]}, 95% intervals against the baseline)</text>',
           f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
           f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
           f'<text x="{WIDTH / 2}" y="{HEIGHT - 20}" text-anchor="middle">{noun}/s (log scale)</text>',
           f'<text x="16" y="{HEIGHT / 2}" transform="rotate(-90 16 {HEIGHT / 2})" text-anchor="middle">'
           f'validation {escape(measure)} (%)</text>']
    for tick in range(math.floor(x0), math.ceil(x1) + 1):
        for step in (1, 2, 5):
            value = step * 10 ** tick
            if x0 <= math.log10(value) <= x1:
                out.append(f'<text x="{sx(value):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{value:g}</text>')
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{MARGIN - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
    frontier = sorted((p for p in points if p["place"] == "frontier"), key=lambda p: p["x"])
    if len(frontier) > 1:
        path = " ".join(f'{sx(p["x"]):.1f},{sy(p["y"]):.1f}' for p in frontier)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color["frontier"]}" stroke-width="1.5"/>')
    for p in points:
        x, c = sx(p["x"]), color[p["place"]]
        out.append(f'<line x1="{x:.1f}" y1="{sy(p["low"]):.1f}" x2="{x:.1f}" y2="{sy(p["high"]):.1f}" stroke="{c}"/>')
        out.append(f'<circle cx="{x:.1f}" cy="{sy(p["y"]):.1f}" r="4" fill="{c}"><title>{escape(p["name"])} '
                   f'({p["place"]})</title></circle>')
        if p["place"] == "frontier":  # the others are named in their tooltip: too many to label side by side
            out.append(f'<text x="{x + 6:.1f}" y="{sy(p["y"]) - 6:.1f}" fill="{c}">{escape(p["name"])}</text>')
    for i, (place, label) in enumerate((("frontier", "on the frontier"), ("kept", "kept, off it"),
                                        ("dropped", "dropped by the search"))):
        y = MARGIN + 14 * i
        out.append(f'<circle cx="{WIDTH - MARGIN - 120}" cy="{y - 4}" r="4" fill="{color[place]}"/>')
        out.append(f'<text x="{WIDTH - MARGIN - 110}" y="{y}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
