"""tune.md and tune.html: what `optiserve tune` measured, the winner, every variant's accuracy from
the manifest, and a plot of throughput against p99 with each variant's Pareto front."""

from __future__ import annotations

from pathlib import Path

from optiserve.bench.plots import _pyplot, _save
from optiserve.bench.report import render_html, render_markdown
from optiserve.bench.tune import accuracy_text, missed, point_missed
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


def plot_fronts(doc: dict, path: Path, series=lambda p: p["variant"], unit: str = "requests") -> bool:
    """Every load step as a dot (throughput, p99) per series of points (by default each variant's),
    its Pareto front as a line, the objective as a dashed line and the winner circled."""
    steps = {}
    for p in doc["points"]:
        steps.setdefault(series(p), []).extend(s for s in p["steps"] if s["requests"] and not s.get("probe"))
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
    ax.set_xlabel(f"throughput (answered {unit}/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{doc.get('model') or 'model'}: throughput against p99, every load step measured")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)
    return True


def _objective(doc: dict) -> tuple:
    obj, env = doc["objective"], doc.get("environment") or {}
    mode = "open loop: the highest request rate whose p99 meets the objective with every request answered " \
           "and no backlog" if obj["mode"] == "open" else "closed loop: the highest throughput of 1, 2, 4, ... " \
                                                          "concurrent callers whose p99 meets the objective"
    return ("p", f"Objective: p99 ≤ {obj['slo_p99_ms']:g} ms, {mode}; {obj['duration_s']:g} s measured per "
                 f"load step. {env.get('cpu', '?')}; optiserve {env.get('optiserve', '?')}, onnxruntime "
                 f"{env.get('onnxruntime', '?')}, openvino {env.get('openvino', '?')}, torch "
                 f"{env.get('torch', '?')}; {doc.get('created', '')}.")


def settings_text(s: dict) -> str:
    """One model's tuned serving settings in words."""
    tokens = f", at most {s['max_batch_tokens']} padded tokens a batch" if s.get("max_batch_tokens") else ""
    return (f"{s['variants'][0]}, max batch {s['max_batch_size']}{tokens}, delay {s['max_delay_ms']:g} ms, "
            f"{s['instances']} instance{'s' if s['instances'] > 1 else ''}")


def _confirmation(doc: dict, unit: str) -> tuple:
    winner, mode, slo = doc["winner"], doc["objective"]["mode"], doc["objective"]["slo_p99_ms"]
    tries = winner["confirmation"]["tries"]
    held = "; ".join(f"{t['level']:g}{' req/s' if mode == 'open' else ' callers'}: p99 {t['p99_ms']:.1f} ms"
                     f"{'' if t['meets'] else ' (missed: ' + ', '.join(missed(t, slo)) + ')'}" for t in tries)
    spare = "the claim keeps a tenth of it spare" if mode == "open" else "its callers are the claim"
    return ("p", f"The search measured {winner['searched']['rate']:.1f} {unit}/s at p99 "
                 f"{winner['searched']['p99_ms']:.1f} ms; a fresh server then had to hold the load for "
                 f"{winner['confirmation']['seconds']:g} s ({held}): {spare}.")


def tune_blocks(doc: dict, manifest: dict, plotted: bool) -> list[tuple]:
    blocks: list[tuple] = [("h1", f"Tuning report: {doc.get('model') or 'model'}"), _objective(doc)]
    winner = doc.get("winner")
    if winner:
        blocks.append(("p", f"Winner: {settings_text(winner['settings'])}: {winner['rate']:.1f} requests/s at p99 "
                            f"{winner['p99_ms']:.1f} ms (written to serving.json)."))
        blocks.append(_confirmation(doc, "requests"))
    slo = doc["objective"]["slo_p99_ms"]
    budgets = any(p.get("max_batch_tokens") for p in doc["points"])  # a column only where a text model's was tuned
    rows = [[p["variant"], str(p["max_batch_size"]), *([str(p.get("max_batch_tokens") or "—")] if budgets else []),
             f"{p['max_delay_ms']:g}", str(p["instances"]),
             f"{p['rate']:.1f}" if p["meets"] else "—", f"{p['p99_ms']:.1f}" if p["meets"] else "—",
             f"failed: {p['failed']}" if p.get("failed") else str(len(p["steps"])), point_missed(p, slo)]
            for p in sorted(doc["points"], key=lambda p: -p["rate"])]
    blocks += [("h2", "Points measured"),
               ("table", ["variant", "max batch", *(["max batch tokens"] if budgets else []), "delay ms", "instances",
                          "requests/s meeting the objective",
                          "its p99 ms", "load steps", "missed at its lowest load"], rows)]
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


def pipeline_tune_blocks(doc: dict, manifests: dict[str, dict], plotted: bool) -> list[tuple]:
    """A pipeline's tuning report: each model's winning settings, every point measured (a column per
    model) and the accuracy of each model's variants from its manifest."""
    blocks: list[tuple] = [("h1", f"Tuning report: pipeline {doc.get('model')}"), _objective(doc),
                           ("p", "The load: the pictures given, each uploaded to the pipeline's /predict. The models "
                                 "were tuned one at a time in the pipeline's order, the others held at the best "
                                 "found so far.")]
    winner = doc.get("winner")
    if winner:
        chosen = "; ".join(f"{name}: {settings_text(s)}" for name, s in winner["settings"].items())
        blocks.append(("p", f"Winner: {chosen} — {winner['rate']:.1f} pictures/s at p99 {winner['p99_ms']:.1f} ms "
                            f"(written to each model's serving.json)."))
        blocks.append(_confirmation(doc, "pictures"))
    models = list(manifests)
    rows = [[*(f"{p['models'][m]['variant']} b{p['models'][m]['max_batch_size']} d{p['models'][m]['max_delay_ms']:g} "
               f"i{p['models'][m]['instances']}" for m in models), p.get("varied") or "— (start)",
             f"{p['rate']:.1f}" if p["meets"] else "—", f"{p['p99_ms']:.1f}" if p["meets"] else "—",
             f"failed: {p['failed']}" if p.get("failed") else str(len(p["steps"])),
             point_missed(p, doc["objective"]["slo_p99_ms"])]
            for p in sorted(doc["points"], key=lambda p: -p["rate"])]
    blocks += [("h2", "Points measured"),
               ("table", [*models, "varied", "pictures/s meeting the objective", "its p99 ms", "load steps",
                          "missed at its lowest load"], rows)]
    why_not = {**(doc.get("left_out") or {}), **(doc.get("pruned") or {})}
    variant_rows = [[f"{m}:{e['name']}", accuracy_text(manifest, e),
                     "measured" if any(p["models"][m]["variant"] == e["name"] for p in doc["points"])
                     else why_not.get(f"{m}:{e['name']}") or "not measured"]
                    for m, manifest in manifests.items() for e in manifest.get("variants", [])]
    blocks += [("h2", "Variants"), ("table", ["model:variant", "accuracy (manifest)", "tuned"], variant_rows)]
    if plotted:
        blocks += [("h2", "Throughput against p99"),
                   ("img", PLOT, "each load step, by the model whose settings it varied; lines: Pareto fronts")]
    return blocks


def write_pipeline_tune_report(doc: dict, manifests: dict[str, dict], folder: Path) -> dict[str, Path]:
    """tune.md, tune.html and tune.png of a pipeline's tuning, in its folder."""
    plotted = plot_fronts(doc, folder / PLOT, series=lambda p: f"{p['varied']} varied" if p.get("varied") else "start",
                          unit="pictures")
    return _write(pipeline_tune_blocks(doc, manifests, plotted), folder, plotted)


def write_tune_report(doc: dict, manifest: dict, folder: Path) -> dict[str, Path]:
    """tune.md, tune.html (plot embedded) and tune.png in `folder`."""
    plotted = plot_fronts(doc, folder / PLOT)
    return _write(tune_blocks(doc, manifest, plotted), folder, plotted)


def _write(blocks: list[tuple], folder: Path, plotted: bool) -> dict[str, Path]:
    files = {"md": folder / "tune.md", "html": folder / "tune.html"}
    with atomic_write(files["md"], "w") as f:
        f.write(render_markdown(blocks))
    with atomic_write(files["html"], "w") as f:
        f.write(render_html(blocks, folder))
    if plotted:
        files["plot"] = folder / PLOT
    return files
