"""tune.md and tune.html: what `optiserve tune` measured, the winner, every variant's accuracy from
the manifest, and a plot of throughput against p99 with each variant's Pareto front."""

from __future__ import annotations

from pathlib import Path

from optiserve.bench.plots import _pyplot, _save
from optiserve.bench.report import render_html, render_markdown
from optiserve.bench.tune import accuracy_text
from optiserve.files import atomic_write

PLOT = "tune.png"


def pareto_front(steps: list[dict]) -> list[dict]:
    """The load steps no other step beats on both throughput and p99, by rising throughput."""
    answered = sorted((s for s in steps if s["requests"] and not s.get("probe")), key=lambda s: (s["p99_ms"], -s["rps"]))
    front, best = [], -1.0
    for s in answered:
        if s["rps"] > best:
            front.append(s)
            best = s["rps"]
    return front


def plot_fronts(doc: dict, path: Path) -> bool:
    """Every load step as a dot (throughput, p99) per variant, its Pareto front as a line, the
    objective as a dashed line and the winner circled."""
    steps = {}
    for p in doc["points"]:
        steps.setdefault(p["variant"], []).extend(s for s in p["steps"] if s["requests"] and not s.get("probe"))
    if not any(steps.values()):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for variant, own in steps.items():
        dots = ax.scatter([s["rps"] for s in own], [s["p99_ms"] for s in own], s=14, alpha=0.45)
        front = pareto_front(own)
        ax.plot([s["rps"] for s in front], [s["p99_ms"] for s in front], "-o", ms=4, color=dots.get_facecolor()[0],
                alpha=1.0, label=variant)
    slo = doc["objective"]["slo_p99_ms"]
    ax.axhline(slo, ls="--", color="grey", lw=1, label=f"objective: p99 {slo:g} ms")
    winner = doc.get("winner")
    if winner:
        ax.scatter([winner["rate"]], [winner["p99_ms"]], s=160, facecolors="none", edgecolors="black", lw=1.5,
                   label="winner", zorder=5)
    ax.set_xlabel("throughput (answered requests/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{doc.get('model') or 'model'}: throughput against p99, every load step measured")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)
    return True


def tune_blocks(doc: dict, manifest: dict, plotted: bool) -> list[tuple]:
    obj, env = doc["objective"], doc.get("environment") or {}
    blocks: list[tuple] = [("h1", f"Tuning report: {doc.get('model') or 'model'}")]
    mode = "open loop: the highest request rate whose p99 meets the objective with every request answered " \
           "and no backlog" if obj["mode"] == "open" else "closed loop: the highest throughput of 1, 2, 4, ... " \
                                                          "concurrent callers whose p99 meets the objective"
    blocks.append(("p", f"Objective: p99 ≤ {obj['slo_p99_ms']:g} ms, {mode}; {obj['duration_s']:g} s measured per "
                        f"load step. {env.get('cpu', '?')}; optiserve {env.get('optiserve', '?')}, onnxruntime "
                        f"{env.get('onnxruntime', '?')}, openvino {env.get('openvino', '?')}, torch "
                        f"{env.get('torch', '?')}; {doc.get('created', '')}."))
    winner = doc.get("winner")
    if winner:
        s = winner["settings"]
        blocks.append(("p", f"Winner: {s['variants'][0]}, max batch {s['max_batch_size']}, delay "
                            f"{s['max_delay_ms']:g} ms, {s['instances']} instance{'s' if s['instances'] > 1 else ''}: "
                            f"{winner['rate']:.1f} requests/s at p99 {winner['p99_ms']:.1f} ms (written to "
                            f"serving.json)."))
        tries = winner["confirmation"]["tries"]
        held = "; ".join(f"{t['level']:g}{' req/s' if obj['mode'] == 'open' else ' callers'}: p99 {t['p99_ms']:.1f} ms"
                         f"{'' if t['meets'] else ' (missed)'}" for t in tries)
        spare = "the claim keeps a tenth of it spare" if obj["mode"] == "open" else "its callers are the claim"
        blocks.append(("p", f"The search measured {winner['searched']['rate']:.1f} requests/s at p99 "
                            f"{winner['searched']['p99_ms']:.1f} ms; a fresh server then had to hold the load for "
                            f"{winner['confirmation']['seconds']:g} s ({held}): {spare}."))
    rows = [[p["variant"], str(p["max_batch_size"]), f"{p['max_delay_ms']:g}", str(p["instances"]),
             f"{p['rate']:.1f}" if p["meets"] else "—", f"{p['p99_ms']:.1f}" if p["meets"] else "—",
             f"failed: {p['failed']}" if p.get("failed") else str(len(p["steps"]))]
            for p in sorted(doc["points"], key=lambda p: -p["rate"])]
    blocks += [("h2", "Points measured"),
               ("table", ["variant", "max batch", "delay ms", "instances", "requests/s meeting the objective",
                          "its p99 ms", "load steps"], rows)]
    entries = {e["name"]: e for e in manifest.get("variants", [])}
    measured = {p["variant"] for p in doc["points"]}
    variant_rows = []
    for name, e in entries.items():
        best = max((p["rate"] for p in doc["points"] if p["variant"] == name and p["meets"]), default=None)
        why = "measured" if name in measured else (doc.get("pruned") or {}).get(name) or \
            (doc.get("left_out") or {}).get(name) or "not measured"
        variant_rows.append([name, accuracy_text(manifest, e), "—" if best is None else f"{best:.1f}", why])
    blocks += [("h2", "Variants"), ("table", ["variant", "accuracy (manifest)", "best requests/s", "tuned"],
                                    variant_rows)]
    if plotted:
        blocks += [("h2", "Throughput against p99"),
                   ("img", PLOT, "each load step of each variant; lines: each variant's Pareto front")]
    return blocks


def write_tune_report(doc: dict, manifest: dict, folder: Path) -> dict[str, Path]:
    """tune.md, tune.html (plot embedded) and tune.png in `folder`."""
    plotted = plot_fronts(doc, folder / PLOT)
    blocks = tune_blocks(doc, manifest, plotted)
    files = {"md": folder / "tune.md", "html": folder / "tune.html"}
    with atomic_write(files["md"], "w") as f:
        f.write(render_markdown(blocks))
    with atomic_write(files["html"], "w") as f:
        f.write(render_html(blocks, folder))
    if plotted:
        files["plot"] = folder / PLOT
    return files
