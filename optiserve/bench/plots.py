"""The report's plots (PNG, matplotlib without a display): latency CDFs, throughput and p99
against load, and the batch sizes the server formed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optiserve.files import atomic_write

MAX_CDF_PANELS = 9


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed, on a server or in CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Write the figure as a PNG, atomically, and free it (pyplot keeps every open figure alive)."""
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)


def latency_cdf(report: dict, path: Path) -> bool:
    plt = _pyplot()
    from matplotlib import ticker

    settings = [s for s in report["settings"] if any(g["latency_ms"] for g in report["groups"] if g["label"] == s)]
    settings = settings[:MAX_CDF_PANELS]
    if not settings:
        return False
    cols = min(3, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, label in zip(axes.flat, settings):
        for g in (g for g in report["groups"] if g["label"] == label and g["latency_ms"]):
            x = np.sort(np.asarray(g["latency_ms"]))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=g["name"])
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(settings):]:
        ax.set_visible(False)
    fig.suptitle("Latency CDF per variant")
    fig.tight_layout()
    _save(fig, path)
    return True


def load_curve(report: dict, path: Path) -> bool:
    """Throughput and p99 (with its CI) against concurrency, rate or batch size, one line per variant."""
    plt = _pyplot()
    from matplotlib import ticker

    modes = [m for m in ("closed", "open", "engine") if any(g["mode"] == m and g["stats"]["count"]
                                                           for g in report["groups"])]
    if not modes:
        return False
    xlabel = {"closed": "concurrent clients", "open": "arrival rate (req/s)", "engine": "batch size"}
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 7), squeeze=False)
    for col, mode in enumerate(modes):
        groups = [g for g in report["groups"] if g["mode"] == mode and g["stats"]["count"]]
        for name in dict.fromkeys(g["name"] for g in groups):
            mine = sorted((g for g in groups if g["name"] == name), key=lambda g: g["level"])
            x = [g["level"] for g in mine]
            axes[0, col].plot(x, [g["images_per_s"] for g in mine], marker="o", label=name)
            p99 = [g["stats"]["p99"] for g in mine]
            yerr = np.array([[e.value - e.low for e in p99], [e.high - e.value for e in p99]])
            axes[1, col].errorbar(x, [e.value for e in p99], yerr=yerr, marker="o", capsize=3, label=name)
        axes[0, col].set_title(f"{mode}: throughput")
        axes[0, col].set_ylabel(f"{report['unit']}/s")
        axes[1, col].set_title(f"{mode}: p99 latency (95% CI)")
        axes[1, col].set_ylabel("ms")
        levels = sorted({g["level"] for g in groups})
        for ax in axes[:, col]:
            if min(levels) > 0 and max(levels) / min(levels) >= 8:  # 1, 8, 32 spread evenly
                ax.set_xscale("log", base=2)
                ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.set_xticks(levels, [f"{v:g}" for v in levels])
            ax.set_ylim(bottom=0)
            ax.set_ylim(top=ax.get_ylim()[1] * 1.08)  # a point at the top edge stays visible
            ax.set_xlabel(xlabel[mode])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    return True


def batch_sizes(report: dict, path: Path) -> bool:
    """Images (or texts) by the size of the batch they ran in, per variant (HTTP and server results only)."""
    plt = _pyplot()
    totals: dict[str, dict[int, int]] = {}
    for g in report["groups"]:
        for k, n in (g.get("batch_size_counts") or {}).items():
            totals.setdefault(g["name"], {})
            totals[g["name"]][int(k)] = totals[g["name"]].get(int(k), 0) + n
    if not totals:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sizes = sorted({k for t in totals.values() for k in t})
    width = 0.8 / len(totals)
    for i, (name, counts) in enumerate(totals.items()):
        total = sum(counts.values())
        ax.bar(np.arange(len(sizes)) + i * width, [counts.get(s, 0) / total for s in sizes], width, label=name)
    ax.set_xticks(np.arange(len(sizes)) + width * (len(totals) - 1) / 2, [str(s) for s in sizes])
    ax.set_xlabel("server batch size")
    ax.set_ylabel(f"fraction of {report['unit']}")
    ax.set_title("Batch sizes the server formed")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


PLOTS = {"latency_cdf.png": (latency_cdf, "Latency CDF per variant"),
         "load_curve.png": (load_curve, "Throughput and p99 against load"),
         "batch_sizes.png": (batch_sizes, "Batch-size distribution")}


def make_plots(report: dict, folder: Path) -> dict[str, str]:
    """Draw every plot the results can support; returns file name -> caption for those drawn."""
    made = {}
    for name, (draw, caption) in PLOTS.items():
        if draw(report, folder / name):
            made[name] = caption
    return made
