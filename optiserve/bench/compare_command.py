"""`optiserve compare`: A/B report (Markdown, HTML, JSON, CSV, plots) from results files or a live server."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Compare variants: percentiles with 95% bootstrap confidence intervals, speedups against a
baseline with their intervals, a plain verdict per variant, and plots.

  optiserve compare bench-http.json --baseline fp32 --out report/
  optiserve compare bench-engine.json bench-http.json --out report/
  optiserve compare http://127.0.0.1:8000 --out report/      (the server's own A/B traffic so far)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    p.add_argument("results", metavar="RESULTS", nargs="+",
                   help="results files from `optiserve bench`, or the URL of a running server")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="with a server URL: the model to report (default: the server's only model)")
    p.add_argument("--baseline", default=None, metavar="VARIANT",
                   help="the variant the others are compared with (default fp32 when present, else the first)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for report.md, report.html, report.json, results.csv and the plots")
    p.add_argument("--resamples", type=int, default=2000, metavar="N",
                   help="bootstrap resamples per interval (default 2000)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (and matplotlib)")


def run(args: argparse.Namespace) -> int:
    from optiserve.bench.http import results_from_server, server_facts
    from optiserve.bench.report import build_report, print_summary, write_report
    from optiserve.bench.results import load_results
    from optiserve.errors import UserError

    if args.resamples < 100:
        raise UserError("--resamples must be at least 100 for a 95% interval to mean anything")
    sources = []
    for item in args.results:
        if item.startswith(("http://", "https://")):
            sources.append((item, results_from_server(server_facts(item, samples=True, model=args.model), item)))
        else:
            sources.append((Path(item).name, load_results(item)))
    report = build_report(sources, args.baseline, args.resamples)
    files = write_report(report, args.out, plots=not args.no_plots)
    print_summary(report)
    print(f"\nwrote {', '.join(str(p) for p in files.values())}")
    return 0
