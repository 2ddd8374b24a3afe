"""The table `optimize` prints and report.md: one row per variant, built or not, the
recommendation and why, read from the manifest alone."""

from __future__ import annotations

from pathlib import Path

from optiserve.artifacts import chosen_accuracy
from optiserve.machine import cpu_line
from optiserve.optimize.attempts import LOG_FILE
from optiserve.optimize.lengths import describe_lengths
from optiserve.runtime.fastest import describe as describe_choice
from optiserve.tasks import task_of


def _marks(manifest: dict, name: str) -> str:
    rec = manifest.get("recommended") or {}
    marks = [f"fastest b{b}" for b, key in (("1", "latency"), (str(rec.get("batch")), "throughput"))
             if rec.get(key) == name]
    return f" ({', '.join(marks)})" if marks else ""


def summary_rows(manifest: dict) -> list[list[str]]:
    """The table `optimize` prints and report.md shows, one row per variant."""
    n = str(manifest["latency_batch"])
    base = next(v for v in manifest["variants"] if v["name"] == manifest["baseline"])
    rows = []
    task = task_of(manifest)
    for v in manifest["variants"]:
        lat1, latn = v["latency_ms"]["1"], v["latency_ms"][n]
        rows.append([v["name"], v["backend"], v["precision"], computes_in_cell(v), *_test_cells(task, v, base),
                     _size(v["size_bytes"]), _size(v["size_compressed_bytes"]), f"{lat1:.2f}", f"{latn:.2f}",
                     f"{base['latency_ms']['1'] / lat1:.2f}× / {base['latency_ms'][n] / latn:.2f}×",
                     _status(v) + _marks(manifest, v["name"])])
    blank = ["—"] * (len(summary_header(manifest)) - 2)
    for failure in manifest.get("failed") or []:  # said in the table, not only in a note
        rows.append([failure["name"], *blank, f"failed: {failure['reason']}"])
    for skip in manifest.get("skipped") or []:
        rows.append([skip["name"], *blank, f"not built: {skip['reason']}"])
    return rows


def computes_in_cell(entry: dict) -> str:
    """What the engine computed the variant in, read back from it, and for bf16 whether the CPU has
    bf16 instructions ("emulated" where it has not): e.g. `bf16 (emulated)`, `fp32`, `int8`."""
    ran = entry.get("computes_in")
    if not ran:
        return "—"  # a manifest from before it was recorded
    if ran["precision"] in ("bf16", "fp16"):
        return f"{ran['precision']} ({'native' if ran['native'] else 'emulated'})"
    return ran["precision"]


def _test_cells(task, entry: dict, base: dict) -> list[str]:
    """The task's cells for the variant's test figures; dashes where it could not be read on test."""
    if entry.get("accuracy") is None:
        return ["—"] * len(task.columns())
    return task.cells(entry["accuracy"], base["accuracy"])


def _status(entry: dict) -> str:
    """The gate's word on the validation images, and where the test images, which only report,
    put an accepted variant outside the budget (never hidden, never acted on)."""
    on_test = entry.get("on_test") or {}
    if entry["status"] == "accepted" and on_test.get("status") == "rejected":
        return f"accepted on validation; outside the budget on test: {on_test['reason']}"
    if on_test.get("status") == "not measured":
        return f"{entry['status']}; not measured on test: {on_test['reason']}"
    return entry["status"]


def summary_header(manifest: dict) -> list[str]:
    n = manifest["latency_batch"]
    return ["variant", "backend", "precision", "computes in", *task_of(manifest).columns(), "size", "zlib size", "p50 ms b1",
            f"p50 ms b{n}", f"speedup b1 / b{n}", "status"]


def recommendation_line(manifest: dict) -> str:
    rec = manifest.get("recommended")
    facts = manifest.get("machine")
    machine = (cpu_line(facts) + (f" with {facts['gpu']}" if facts.get("gpu") else "")) if facts else "this machine"
    if not rec:
        return f"No recommendation: no variant was accepted (measured on {machine})."
    gated = "" if rec["accuracy_gated"] else " (not accuracy-gated: the accuracy could not be measured)"
    evidence = rec.get("evidence") or {}
    why = "; ".join(f"batch {b}: {describe_choice(evidence[key])}" for key, b in
                    (("latency", 1), ("throughput", rec["batch"])) if evidence.get(key))
    lengths = f" By sequence length: {describe_lengths(rec['by_length'])}." if rec.get("by_length") else ""
    return (f"Recommended on {machine}: for latency (batch 1) **{rec['latency']}**, for throughput "
            f"(batch {rec['batch']}) **{rec['throughput']}**{gated}." + (f" Why: {why}." if why else "") + lengths +
            " Timed here, in this run: on another CPU the order can differ.")


def _timed_texts(manifest: dict) -> str:
    drawn = manifest.get("timing_texts")
    return f"{drawn['drawn']} texts drawn from `{Path(drawn['file']).name}`" if drawn else "the validation texts"


def timing_sentence(manifest: dict) -> str:
    """Where a text model's latency columns were timed on --timing-texts: on what, at what lengths."""
    drawn = manifest.get("timing_texts")
    if not drawn:
        return ""
    return (f" The latency columns time {_timed_texts(manifest)} (--timing-texts, {drawn['texts']} texts; mean "
            f"{drawn['tokens_mean']:g} tokens, longest {drawn['tokens_max']}): {_at_tokens(drawn['headline_tokens'])}, "
            f"a batch padded to its longest text; they judge nothing.")


def _at_tokens(headline_tokens: dict) -> str:
    return ", ".join(f"batch {b} at {t} tokens" for b, t in headline_tokens.items())


def length_lines(manifest: dict) -> list[str]:
    """A text model's timings at set sequence lengths: per variant and length, the median and how
    many times as fast as the baseline (95% interval), and what the headline columns timed."""
    timed = manifest.get("seq_lengths")
    if not timed:
        return []
    n, base, lengths = timed["batch"], manifest["baseline"], [str(t) for t in timed["timed"]]
    header = ["variant", *(cell for t in lengths for cell in (f"p50 ms {t} tok", f"× {base} {t} tok (95% CI)"))]
    lines = ["", f"## Latency by sequence length (batch {n})", "",
             f"Every row is exactly the length's tokens of real text ({timed['rows']}); the median of the "
             f"interleaved rounds, and how many times as fast as {base} by the ratio of medians with its paired 95% "
             f"interval. The table above times {_timed_texts(manifest)} at their own lengths"
             + ("" if manifest.get("timing_texts") else  # else the report's opening gave them
                ": " + _at_tokens(timed["headline_tokens"]) + " (a batch padded to its longest text)") + "."
             + "".join(f" Not timed at {s['tokens']} tokens: {s['reason']}." for s in timed["skipped"]), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in manifest["variants"]:
        cells = []
        for t in lengths:
            at = v["latency_by_length"][t]
            low, high = at["speedup_ci95"]
            cells += [f"{at['p50_ms']:.2f}", f"{at['speedup']:.2f}× ({low:.2f}–{high:.2f})"]
        lines.append("| " + " | ".join([v["name"], *cells]) + " |")
    return lines


def search_lines(manifest: dict) -> list[str]:
    """The search's frontier: every variant and every dropped candidate, fastest first at the
    throughput batch, with its measure against the baseline and why it is on the frontier or not."""
    search = manifest.get("search")
    if not search:
        return []
    n = str(manifest["latency_batch"])
    task = task_of(manifest)
    base = chosen_accuracy(next(v for v in manifest["variants"] if v["name"] == manifest["baseline"]))
    rows = [(v, "**on the frontier**" if v["frontier"]["on"] else f"kept, off the frontier: {v['frontier']['why']}")
            for v in manifest["variants"]]
    rows += [(d, f"dropped: {d['dropped']}") for d in search["dropped"]]
    rows.sort(key=lambda row: row[0]["latency_ms"][n])
    noun = _noun(manifest)
    header = ["variant", f"p50 ms b{n}", f"{noun}/s b{n}", *task.columns(), "frontier"]
    ratios = ", ".join(f"{r:.0%}" for r in search["ratios"])
    transforms = ", and ".join(SEARCH_TRANSFORMS.get(t, t) for t in search.get("transforms") or ["channels"])
    lines = ["", f"## Search: speed against accuracy ({transforms}, at {ratios}, each recovered by distillation)", "",
             f"Fastest first at batch {n}. A variant is on the frontier when no other servable one is both at "
             f"least as fast and at least as accurate on the validation {noun} (the accuracy shown here: the "
             f"frontier is a choice, so the test {noun} do not draw it); the search's own candidates off it are "
             f"not published, but one a recommendation names (the latency choice is made at batch 1). "
             f"Dropped candidates keep their row in `manifest.json` (`search.dropped`).", "",
             "![speed against accuracy](frontier.svg)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v, why in rows:
        latency = v["latency_ms"][n]
        lines.append("| " + " | ".join([v["name"], f"{latency:.2f}", f"{1000 * int(n) / latency:.0f}",
                                        *task.cells(chosen_accuracy(v), base), why]) + " |")
    return lines


def _data_roles(dataset: dict, noun: str = "images") -> str:
    """What each split did: validation chose, test only reported (`noun`: what the model takes)."""
    test = f"Accuracy on {dataset['eval_images']} held-out test {noun}, read once after every choice"
    if "choose_images" not in dataset:  # a manifest from before the roles were recorded
        return f"{test}."
    split = f" ({dataset['split_note']})" if dataset.get("split_note") else ""
    return (f"{test}; every variant was accepted or rejected, and the search and the recommendation made, on "
            f"{dataset['choose_images']} validation {noun}{split}.")


SEARCH_TRANSFORMS = {"channels": "channels pruned", "layers": "layers dropped",
                     "width": "attention heads and feed-forward channels pruned"}  # by what the search made networks smaller


def _noun(manifest: dict) -> str:
    """What the model takes, as the report counts it."""
    return "texts" if (manifest.get("input") or {}).get("kind") == "text" else "images"


def _size(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def render_report(manifest: dict) -> str:
    header, rows = summary_header(manifest), summary_rows(manifest)
    lines = [f"# optimize report: {manifest['model']} on {manifest['dataset']['name']}", "",
             f"Weights: `{manifest['source']['weights']}`. {_data_roles(manifest['dataset'], _noun(manifest))} Latency is the "
             f"median of repeated runs after warm-up, through the same runtime layer the server uses."
             + timing_sentence(manifest), ""]
    if not manifest["accuracy_meaningful"]:
        lines += [f"**Accuracy is not validated here: {manifest['accuracy_note']}.** Agreement and max |Δ| "
                  f"against fp32 are still measured.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    rejected = [v for v in manifest["variants"] if v["status"] == "rejected"]
    if rejected:
        lines += [""] + [f"- **{v['name']} rejected**: {v['reason']}; not served by default." for v in rejected]
    if manifest.get("failed"):
        lines += ["", f"Passes that failed ({', '.join(f['name'] for f in manifest['failed'])}): each one's "
                      f"traceback is in `{LOG_FILE}` beside this report; the other variants were built as usual."]
    lines += search_lines(manifest)
    lines += length_lines(manifest)
    lines += ["", task_of(manifest).legend(manifest)]
    lines += ["", recommendation_line(manifest)]
    lines += ["", "Notes:"] + [f"- {n}" for n in manifest["notes"]]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()), ""]
    return "\n".join(lines)
