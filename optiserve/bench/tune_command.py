"""`optiserve tune`: the fastest variant and serving settings that meet a p99 latency objective."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Serve the model folder's variants with real `optiserve serve` processes under the project's load
generator, and find the variant, max batch size, batching delay and instances with the highest
throughput whose p99 latency meets --slo-p99-ms, then confirm the winner on a fresh server for
--confirm-seconds, lowering its load until the objective holds. Writes serving.json (the winner; the folder's
other settings kept), tune.json (every point measured, the winner's rate and p99, CPU and
versions), tune.md and tune.html (the table and a plot of each variant's Pareto front).

  optiserve tune artifacts/resnet18-digits --slo-p99-ms 50
  optiserve tune artifacts/resnet18-digits --slo-p99-ms 50 --max-accuracy-drop 0.5 --duration 20
  optiserve tune artifacts/resnet18-digits --slo-p99-ms 50 --resume      (after an interruption)

A text model's folder is driven with the texts --texts holds (text:FILE, one text a request as a
text/plain body, in the file's order, cycling; each step's texts and tokens are kept in tune.json).

  optiserve tune artifacts/minilm --slo-p99-ms 50 --texts text:queries.txt
  optiserve tune artifacts/minilm --slo-p99-ms 50 --texts text:queries.txt --batch-tokens 512,2048

--batch-tokens also searches a text model's max_batch_tokens (a batch closed before rows x its
longest row passes it), each at least the model's max length; without it the folder's own is kept.

A pipeline's folder in a repository (its pipeline.json) tunes each of its steps' models, one at a
time, for the most pictures per second the pipeline answers within the objective, driven with the
pictures --images holds; each model's serving.json is written, and tune.json and the report go into
the pipeline's folder. --variants then takes MODEL:VARIANT.

  optiserve tune models/reader --slo-p99-ms 100 --images scenes/"""


def _number_list(convert, least: float, example: str):
    """An argparse type for a comma-separated list of numbers of at least `least`, sorted and without repeats."""
    kind = "whole numbers" if convert is int else "numbers"

    def parse(text: str) -> list:
        try:
            values = [convert(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind} like {example}, got {text!r}") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"expected {kind} of at least {least:g}, got {text!r}")
        return sorted(set(values))

    return parse


_ints = _number_list(int, 1, "1,2,4")
_floats = _number_list(float, 0, "1,5")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    p.add_argument("artifact_dir", metavar="MODEL_DIR",
                   help="a folder written by `optimize`, or a pipeline's folder in a repository")
    p.add_argument("--slo-p99-ms", type=float, required=True, metavar="X", help="the p99 latency objective, in ms")
    p.add_argument("--max-accuracy-drop", type=float, default=None, metavar="PTS",
                   help="leave out variants more than PTS points below fp32 in the measure their task's gate "
                        "judges (from the manifest): top-1 (or top-1 agreement without labels), mIoU, mAP@0.5, "
                        "cosine similarity to fp32 x100")
    p.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="measured seconds per load step (default 10)")
    p.add_argument("--warmup", type=float, default=1.0, metavar="S",
                   help="seconds of each step's load sent before its measured window, so the queue settles "
                        "at the new load (default 1; a confirmation warms up for at least 2)")
    p.add_argument("--confirm-seconds", type=float, default=20.0, metavar="S",
                   help="how long the winner must hold its load on a fresh server before it is claimed; "
                        "where it does not, the load is lowered until it does (default 20)")
    p.add_argument("--concurrency-mode", choices=["open", "closed"], default="open",
                   help="open: the highest request rate meeting the objective without backlog (default); "
                        "closed: the highest throughput of 1, 2, 4, ... concurrent callers meeting it")
    p.add_argument("--variants", default=None, metavar="A,B",
                   help="the variants to tune (default: every accepted variant that can run here); on a "
                        "pipeline MODEL:VARIANT")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32], metavar="1,2,4",
                   help="max batch sizes tried, in order until doubling stops paying (default 1,2,...,32)")
    p.add_argument("--delays-ms", type=_floats, default=None, metavar="1,5",
                   help="batching delays tried above batch size 1 (default: 1 ms and a tenth of the objective)")
    p.add_argument("--instances", type=_ints, default=None, metavar="1,2",
                   help="instances per variant tried (default: 1, and 2 with 2 cores or more)")
    p.add_argument("--batch-tokens", type=_ints, default=None, metavar="512,2048",
                   help="a text model's max_batch_tokens tried, each at least its max length (default: not "
                        "searched; the folder's serving.json budget, or none, is kept)")
    p.add_argument("--images", default=None, metavar="DIR",
                   help="images to send (default: random PNGs at the model's input size; a pipeline needs "
                        "pictures like those it will serve)")
    p.add_argument("--texts", default=None, metavar="text:FILE",
                   help="a text model's load, needed for one: the texts of FILE (.txt one text a line, or .tsv/.csv "
                        "read as optimize --dataset text: reads them), one a request")
    p.add_argument("--resume", action="store_true", help="go on from the folder's tune.json, skipping measured points")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from optiserve.artifacts import read_manifest
    from optiserve.bench.payloads import dataset_images, images_from_folder
    from optiserve.bench.texts import text_load
    from optiserve.bench.tune import TuneConfig, Tuner
    from optiserve.bench.tune_report import settings_text, write_tune_report
    from optiserve.errors import UserError
    from optiserve.pipeline_file import is_pipeline_folder

    folder = Path(args.artifact_dir)
    if args.slo_p99_ms <= 0 or args.duration <= 0 or args.confirm_seconds <= 0:
        raise UserError("--slo-p99-ms, --duration and --confirm-seconds must be positive")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup:g}: seconds of load before each measured window, 0 or more")
    if args.max_accuracy_drop is not None and args.max_accuracy_drop < 0:
        raise UserError("--max-accuracy-drop is points of accuracy, at least 0")
    pipeline = is_pipeline_folder(folder)
    if pipeline and not args.images:
        raise UserError(f"tuning the pipeline {folder.name} needs --images DIR: pictures like those it will serve, "
                        f"so its later steps get the boxes they will get")
    given = None if pipeline else read_manifest(folder)["input"]
    texts, images = None, []
    if given is not None and given.get("kind") == "text":
        if not args.texts:
            raise UserError(f"tuning the text model {folder.name} needs --texts text:FILE: texts like those it "
                            f"will serve (a .txt file, one text a line, or a .tsv/.csv with a `text` column)")
        if args.images:
            raise UserError(f"{folder.name} is a text model: leave out --images (its load is --texts)")
        texts = text_load(args.texts, 1, folder / given["tokenizer"], given["max_length"])
        short = [t for t in args.batch_tokens or [] if t < given["max_length"]]
        if short:
            raise UserError(f"--batch-tokens {','.join(map(str, short))}: below {folder.name}'s max length "
                            f"{given['max_length']}, so its longest text would fit in no batch; give at least "
                            f"{given['max_length']}")
    elif args.batch_tokens:
        raise UserError(f"--batch-tokens budgets a text model's padded tokens; {folder.name} takes images: leave it "
                        f"out (its batches are bounded by --batch-sizes)")
    elif args.texts:
        raise UserError(f"{folder.name} takes images, not texts: leave out --texts"
                        + (" (a pipeline's load is --images DIR)" if pipeline else ""))
    elif args.images:
        images = images_from_folder(args.images)
    else:
        images = dataset_images("synthetic", max(given["shape"][1:]), count=64)
    cfg = TuneConfig(folder, args.slo_p99_ms, args.max_accuracy_drop, args.duration,
                     warmup_s=args.warmup, mode=args.concurrency_mode,
                     variants=[v for v in args.variants.split(",") if v] if args.variants else None,
                     batch_sizes=args.batch_sizes, delays_ms=args.delays_ms, instances=args.instances,
                     batch_tokens=args.batch_tokens,
                     images=images, texts=texts, confirm_s=args.confirm_seconds, resume=args.resume,
                     progress=not args.quiet)
    if pipeline:
        return _tune_pipeline(cfg)
    tuner = Tuner(cfg)
    doc = tuner.run()
    files = write_tune_report(doc, tuner.manifest, folder)
    w = doc["winner"]
    print(f"winner: {settings_text(w['settings'])}: {w['rate']:.1f} requests/s at p99 {w['p99_ms']:.1f} ms "
          f"held for {w['confirmation']['seconds']:g} s (objective {args.slo_p99_ms:g} ms)")
    print(f"wrote {folder / 'serving.json'}, {folder / 'tune.json'}, {files['md']}, {files['html']}")
    return 0


def _tune_pipeline(cfg) -> int:
    from optiserve.bench.tune_pipeline import PipelineTuner
    from optiserve.bench.tune_report import settings_text, write_pipeline_tune_report

    tuner = PipelineTuner(cfg)
    doc = tuner.run()
    files = write_pipeline_tune_report(doc, tuner.manifests, cfg.folder)
    w = doc["winner"]
    for name, settings in w["settings"].items():
        print(f"{name}: {settings_text(settings)}")
    print(f"pipeline {doc['model']}: {w['rate']:.1f} pictures/s at p99 {w['p99_ms']:.1f} ms held for "
          f"{w['confirmation']['seconds']:g} s (objective {cfg.slo_p99_ms:g} ms)")
    written = ", ".join(str(tuner.repository / name / "serving.json") for name in w["settings"])
    print(f"wrote {written}, {cfg.folder / 'tune.json'}, {files['md']}, {files['html']}")
    return 0
