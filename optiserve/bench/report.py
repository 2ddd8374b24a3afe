"""`compare`: turn results files (or a running server's traffic) into an A/B report.

The report is built once as data (`build_report`) and rendered three ways: Markdown for a pull
request, a self-contained HTML page with the plots embedded, and JSON for machines (with the
raw settings and versions of every source, so two reports can be compared later).
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

import numpy as np

from optiserve.bench.results import group_runs, to_csv
from optiserve.bench.stats import PERCENTILES, speedup, summarize, verdict
from optiserve.errors import UserError
from optiserve.files import atomic_write
from optiserve.intervals import wilson_interval

REPORT_FORMAT = "optiserve.report/1"
SPEEDUP_STATISTICS = ("p50", "p99")


def _top1(info: dict | None) -> float | None:
    acc = (info or {}).get("accuracy") or {}
    return acc.get("top1")


def build_report(sources: list[tuple[str, dict]], baseline: str | None = None, resamples: int = 2000) -> dict:
    """`sources`: (name, results dict) pairs. Returns the report as plain data."""
    groups, facts = [], {}
    for name, results in sources:
        for g in group_runs(results, name):
            g["info"] = results.get("variants", {}).get(g["variant"]) or {}
            groups.append(g)
        for variant, info in results.get("variants", {}).items():
            facts.setdefault(variant, info)
    if not groups:
        raise UserError("the results hold no runs to report on")
    # the same variant in the same setting from two sources is told apart by its source
    seen: dict[tuple, int] = {}
    for g in groups:
        seen[(g["variant"], g["label"])] = seen.get((g["variant"], g["label"]), 0) + 1
    for g in groups:
        g["name"] = g["variant"] if seen[(g["variant"], g["label"])] == 1 else f"{g['variant']} [{g['source']}]"
        g["stats"] = summarize(g["latency_ms"], resamples)
    names = list(dict.fromkeys(g["name"] for g in groups))
    variants = list(dict.fromkeys(g["variant"] for g in groups))
    if baseline is None:
        baseline = "fp32" if "fp32" in variants else names[0]
    elif baseline not in names and baseline not in variants:
        raise UserError(f"--baseline {baseline!r} is not in the results; they hold: {', '.join(names)}")

    comparisons = []
    settings = list(dict.fromkeys(g["label"] for g in groups))
    for label in settings:
        here = [g for g in groups if g["label"] == label]
        base = next((g for g in here if baseline in (g["name"], g["variant"])), None)
        if base is None or len(base["latency_ms"]) < 2:
            continue
        for g in here:
            if g is base or len(g["latency_ms"]) < 2:
                continue
            ratios = {s: speedup(base["latency_ms"], g["latency_ms"], s, resamples) for s in SPEEDUP_STATISTICS}
            b1, c1 = _top1(base["info"]), _top1(g["info"])
            delta = None if b1 is None or c1 is None else 100 * (c1 - b1)
            # the optimizer's paired comparison holds against fp32, the manifest's baseline
            paired = (g["info"].get("accuracy") or {}).get("vs_baseline") if base["variant"] == "fp32" else None
            comparisons.append({"setting": label, "candidate": g["name"], "baseline": base["name"],
                                "speedup": {s: r.to_dict() for s, r in ratios.items()},
                                "accuracy_delta_points": delta, "accuracy_difference": paired,
                                "verdict": verdict(g["name"], base["name"], ratios["p50"], "p50", delta, paired),
                                "verdict_p99": verdict(g["name"], base["name"], ratios["p99"], "p99")})
    shadows = [{**sh, "source": name, **_agreement(sh["agreed"], sh["images"])}
               for name, r in sources for sh in ((r.get("settings") or {}).get("shadow") or [])]
    texts = any((r.get("settings") or {}).get("texts") for _, r in sources)
    return {"format": REPORT_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "baseline": baseline,
            "unit": "texts" if texts else "images", "tokens": any("tokens_per_s" in g for g in groups),
            "shadow": shadows,
            "model": next((r.get("model") for _, r in sources if r.get("model")), {}),
            "sources": [{"name": n, "kind": r.get("kind"), "created": r.get("created"), "settings": r.get("settings"),
                         "environment": r.get("environment")} for n, r in sources],
            "variants": facts, "settings": settings, "groups": groups, "comparisons": comparisons}


def _agreement(agreed: int, images: int) -> dict:
    interval = wilson_interval(agreed, images)
    return {"agreement": agreed / images if images else None, "agreement_ci95": list(interval) if interval else None}


def _shadow_line(sh: dict) -> str:
    if not sh["images"]:
        return f"{sh['variant']} (shadow, {sh['source']}): no images compared yet ({sh['dropped']} runs dropped)"
    low, high = sh["agreement_ci95"]
    return (f"{sh['variant']} (shadow, {sh['source']}): agreed with the answering variant's top-1 class on "
            f"{sh['agreement']:.2%} of {sh['images']:,} images (95% CI {low:.2%}–{high:.2%}); "
            f"{sh['dropped']:,} shadow runs dropped under load")


# ---- rendering -------------------------------------------------------------------------------------

def _ms(x: float) -> str:
    """Three significant figures or so: 0.234, 2.34, 23.4, 234."""
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _with_ci(est) -> str:
    return f"{_ms(est.value)} ({_ms(est.low)}–{_ms(est.high)})"


def _size(n) -> str:
    return "" if n is None else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _group_row(g: dict, tokens: bool = False) -> list[str]:
    s = g["stats"]
    top1 = _top1(g["info"])
    row = [g["name"], str(g["requests"]), str(g["errors"]) + (f" {g['statuses']}" if g["errors"] else ""),
           f"{g['throughput_per_s']:.1f}", f"{g['images_per_s']:.1f}"]
    if tokens:
        row.append(f"{g['tokens_per_s']:.0f}" if "tokens_per_s" in g else "")
    if s["count"]:
        row += [_ms(s["mean"].value)] + [_with_ci(s[f"p{p}"]) for p in PERCENTILES] + [_ms(s["max"])]
    else:
        row += ["–"] * (2 + len(PERCENTILES))
    row += ["" if top1 is None else f"{100 * top1:.2f}%", _size(g["info"].get("size_bytes"))]
    return row


def _describe_source(source: dict) -> str:
    st = source.get("settings") or {}
    if source["kind"] == "engine":
        return (f"engine timings, batch sizes {', '.join(map(str, st.get('batch_sizes', [])))}, "
                f"{st.get('duration_s', '?'):g} s each after warm-up"
                + (f", texts: {st['texts']}" if st.get("texts") else ""))
    if source["kind"] == "http":
        sent = (f"texts: {st['texts']}, {st.get('texts_per_request', 1)} a request"
                + ("" if st.get("tokens_counted") else ", tokens not counted (no --tokenizer)")
                if st.get("texts") else f"images: {st.get('images', '?')}")
        return (f"HTTP load on {st.get('url')}, {st.get('duration_s', '?'):g} s per run after {st.get('warmup_s', 0):g} s "
                f"warm-up, {sent}")
    return f"the server's own traffic at {st.get('url')} (latency measured inside the server)"


def group_header(unit: str = "images", tokens: bool = False) -> list[str]:
    """A report table's columns: throughput in requests, in `unit` (images or texts) and, where a
    text load's tokens were counted, in tokens."""
    return (["variant", "requests", "errors", "req/s", f"{unit}/s", *(["tokens/s"] if tokens else []), "mean ms"]
            + [f"p{p} ms (95% CI)" for p in PERCENTILES] + ["max ms", "top-1", "size"])


def report_blocks(report: dict, plots: dict[str, str]) -> list[tuple]:
    """The report as a list of blocks (heading, paragraph, list, table, image) both renderers share."""
    model = report["model"].get("name") or "model"
    blocks: list[tuple] = [("h1", f"Latency A/B report: {model}")]
    src = []
    for s in report["sources"]:
        env = s.get("environment") or {}
        src.append(f"{s['name']}: {_describe_source(s)}; {s.get('created')}, optiserve {env.get('optiserve', '?')}, "
                   f"torch {env.get('torch', '?')}, onnxruntime {env.get('onnxruntime', '?')}, "
                   + (env.get("cpu") or f"{env.get('cpu_count', '?')} CPUs") + (f", {env['gpu']}" if env.get("gpu") else ""))
    blocks += [("p", f"Baseline: {report['baseline']}. Percentiles are of successful requests; the intervals are "
                     "95% bootstrap confidence intervals; a speedup is baseline ÷ variant (above 1 is faster)."),
               ("ul", src)]
    if report["comparisons"]:
        blocks += [("h2", "Verdicts"), ("ul", [f"{c['setting']}: {c['verdict']}" for c in report["comparisons"]])]
    for label in report["settings"]:
        here = [g for g in report["groups"] if g["label"] == label]
        table = [_group_row(g, report["tokens"]) for g in here]
        blocks += [("h2", label[0].upper() + label[1:]), ("table", group_header(report["unit"], report["tokens"]), table)]
        comps = [c for c in report["comparisons"] if c["setting"] == label]
        if comps:
            rows = []
            for c in comps:
                cells = [c["candidate"]]
                for s in SPEEDUP_STATISTICS:
                    sp = c["speedup"][s]
                    cells.append(f"{sp['value']:.2f}× ({sp['ci'][0]:.2f}–{sp['ci'][1]:.2f})")
                d = c["accuracy_delta_points"]
                cells.append("" if d is None else f"{d:+.2f}")
                rows.append(cells)
            blocks.append(("table", ["variant", f"p50 speedup vs {report['baseline']} (95% CI)",
                                     "p99 speedup (95% CI)", "top-1 Δ points"], rows))
        errors = [f"{g['name']}: {e}" for g in here for e in g["error_examples"]]
        if errors:
            blocks += [("p", "Failures seen:"), ("ul", errors)]
    if report.get("shadow"):
        blocks += [("h2", "Shadow traffic"),
                   ("p", "Requests mirrored to a shadow variant after their answer was sent; agreement is on the "
                         "top-1 class, with a 95% Wilson interval."),
                   ("ul", [_shadow_line(sh) for sh in report["shadow"]])]
    if plots:
        blocks.append(("h2", "Plots"))
        for name, caption in plots.items():
            blocks.append(("img", name, caption))
    return blocks


def render_markdown(blocks: list[tuple]) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h1":
            out.append(f"# {b[1]}\n")
        elif kind == "h2":
            out.append(f"## {b[1]}\n")
        elif kind == "p":
            out.append(f"{b[1]}\n")
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in b[1]) + "\n")
        elif kind == "table":
            header, rows = b[1], b[2]
            lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in
                                                                        range(len(header))) + "|"]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            out.append("\n".join(lines) + "\n")
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})\n")
    return "\n".join(out)


def render_html(blocks: list[tuple], folder: Path) -> str:
    """A single page with every plot embedded as a data URI: it can be mailed or attached as is."""
    e = html.escape
    body = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2"):
            body.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{e(b[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{e(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode((folder / b[1]).read_bytes()).decode()
            body.append(f'<figure><img alt="{e(b[2])}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{e(b[2])}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;color:#222}"
             "table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}"
             "td,th{border:1px solid #ccc;padding:.3rem .6rem;text-align:right}"
             "td:first-child,th:first-child{text-align:left}th{background:#f4f4f4}img{max-width:100%}")
    title = e(blocks[0][1]) if blocks and blocks[0][0] == "h1" else "optiserve report"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _json_ready(report: dict) -> dict:
    """The report with Estimates as {"value", "ci"} and the raw latencies left to the sources."""
    groups = []
    for g in report["groups"]:
        out = {k: v for k, v in g.items() if k not in ("latency_ms", "server_ms", "queue_ms", "compute_ms", "batch",
                                                       "stats")}
        out["latency_ms"] = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in g["stats"].items()}
        for col in ("server_ms", "queue_ms", "compute_ms"):
            if g.get(col):
                out[f"mean_{col}"] = float(np.mean(g[col]))
        groups.append(out)
    return {**report, "groups": groups}


def write_report(report: dict, out: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write report.md, report.html, report.json, results.csv and the plots into `out`."""
    from optiserve.bench.plots import make_plots

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    made = make_plots(report, out) if plots else {}
    blocks = report_blocks(report, made)
    files = {"md": out / "report.md", "html": out / "report.html", "json": out / "report.json",
             "csv": out / "results.csv"}
    with atomic_write(files["md"], "w") as f:
        f.write(render_markdown(blocks))
    with atomic_write(files["html"], "w") as f:
        f.write(render_html(blocks, out))
    with atomic_write(files["json"], "w") as f:
        json.dump(_json_ready(report), f, indent=1)
    with atomic_write(files["csv"], "w") as f:
        f.write(to_csv(report["groups"]))
    for name in made:
        files[name] = out / name
    return files


def print_summary(report: dict) -> None:
    """A compact table on stdout: one row per variant and setting, then the verdicts."""
    tokens = report["tokens"]
    header = ["setting", "variant", "requests", "errors", f"{report['unit']}/s",
              *(["tokens/s"] if tokens else []), "p50 ms (95% CI)", "p99 ms (95% CI)"]
    rows = []
    for g in report["groups"]:
        s = g["stats"]
        rows.append([g["label"], g["name"], str(g["requests"]), str(g["errors"]), f"{g['images_per_s']:.1f}",
                     *([f"{g.get('tokens_per_s', 0):.0f}"] if tokens else []),
                     _with_ci(s["p50"]) if s["count"] else "–", _with_ci(s["p99"]) if s["count"] else "–"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if report["comparisons"]:
        print()
        for c in report["comparisons"]:
            print(f"{c['setting']}: {c['verdict']}")
    for sh in report.get("shadow") or []:
        print(_shadow_line(sh))
