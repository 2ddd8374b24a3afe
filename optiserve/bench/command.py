"""`optiserve bench engine|http`: measure, print a summary, and write the results file."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Measure, and write every request's latency to a results file for `optiserve compare`.

  optiserve bench engine artifacts/resnet18-digits --batch-sizes 1,8,32
  optiserve bench engine artifacts/minilm --texts text:queries.txt --batch-sizes 1,8,32
  optiserve bench http http://127.0.0.1:8000 --variants onnx-int8,fp32 --concurrency 1,8,32
  optiserve bench http http://127.0.0.1:8000 --rate 50 --duration 30      (open loop, A/B split)
  optiserve bench http http://127.0.0.1:8000 --protocol grpc --grpc-target 127.0.0.1:8001
  optiserve bench http http://127.0.0.1:8000 --texts text:queries.txt --tokenizer artifacts/minilm --protocol openai"""


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 10,50, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    sub = p.add_subparsers(dest="bench_command", metavar="engine|http", required=True)

    e = sub.add_parser("engine", help="offline timings of each variant through the runtime layer")
    e.add_argument("artifact_dir", metavar="ARTIFACT_DIR", help="a folder written by `optimize`")
    e.add_argument("--variants", type=_names, default=None, metavar="A,B",
                   help="variants to time (default: every accepted variant that can run here)")
    e.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32], metavar="1,8,32", help="default 1,8,32")
    e.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="timed seconds per variant and batch size, after warm-up (default 10)")
    e.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads per session (default: the runtime's, all cores)")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto")
    e.add_argument("--texts", default=None, metavar="text:FILE",
                   help="a text model's batches: texts drawn from FILE as optimize --timing-texts draws them "
                        "(seeded, the one of median length first), tokenized by the model's own tokenizer "
                        "(default: a sample sentence)")
    _common(e, "bench-engine.json")

    h = sub.add_parser("http", help="load generator against a running `optiserve serve` (over HTTP or gRPC)")
    h.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    h.add_argument("--model", default=None, metavar="NAME",
                   help="the model to load, or a pipeline of the repository (default: the server's only model)")
    h.add_argument("--variants", type=_names, default=None, metavar="A,B",
                   help="measure each named variant in turn (default: send requests without a variant, "
                        "so the server's A/B split routes them)")
    h.add_argument("--concurrency", type=_ints, default=None, metavar="1,8,32",
                   help="closed loop: clients that each send their next request when answered "
                        "(default 1,8,32 when no --rate is given)")
    h.add_argument("--rate", type=_floats, default=[], metavar="R",
                   help="open loop: Poisson arrivals at R requests/s (several: 10,50); latency is measured "
                        "from the intended send time")
    h.add_argument("--duration", type=float, default=20.0, metavar="S", help="measured seconds per run (default 20)")
    h.add_argument("--warmup", type=float, default=3.0, metavar="S",
                   help="seconds of load before measuring, not recorded (default 3)")
    h.add_argument("--protocol", default="predict", choices=["predict", "predict-raw", "v2-binary", "grpc", "openai"],
                   help="predict: image uploads to /predict (default); predict-raw: each image as the raw body of a "
                        "/predict request (content-type image/png, ...); v2-binary: each image's tensor over the Open "
                        "Inference Protocol with binary tensors (as tritonclient.http sends); grpc: the same over gRPC "
                        "ModelInfer with raw tensors (as tritonclient.grpc sends); to a pipeline, v2-binary and grpc "
                        "send each image's file as a BYTES tensor. To a text model: predict sends JSON texts, "
                        "predict-raw a text/plain body, v2-binary and grpc a BYTES tensor of texts, openai "
                        "POST /v1/embeddings")
    h.add_argument("--grpc-target", default=None, metavar="HOST:PORT",
                   help="with --protocol grpc: the server's gRPC address (default: URL's host, port 8001)")
    h.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a request unanswered after S seconds counts as failed (default 60)")
    source = h.add_mutually_exclusive_group()
    source.add_argument("--images", default=None, metavar="DIR", help="upload the image files in DIR")
    source.add_argument("--dataset", default="digits", choices=["digits", "synthetic"],
                        help="built-in images when no --images: digits (real, bundled) or synthetic (default digits)")
    source.add_argument("--texts", default=None, metavar="text:FILE",
                        help="a text model's load: the texts of FILE (.txt one text a line, or .tsv/.csv read as "
                             "optimize --dataset text: reads them), sent in the file's order, cycling")
    h.add_argument("--texts-per-request", type=int, default=1, metavar="N", help="texts in each request (default 1)")
    h.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --texts: the served model's folder; its tokenizer counts each request's tokens, so the "
                        "results report tokens/s beside texts/s (without it, texts/s only)")
    h.add_argument("--image-size", type=int, default=32, metavar="PX",
                   help="side of the --dataset images in pixels (default 32; the server resizes)")
    _common(h, "bench-http.json")


def _common(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--out", default=default_out, metavar="FILE",
                   help=f"results file (default {default_out}); a perf_analyzer-style CSV is written beside it")
    p.add_argument("--quiet", action="store_true", help="no live progress line")


def run(args: argparse.Namespace) -> int:
    from optiserve.bench.report import build_report, print_summary
    from optiserve.bench.results import save_results, to_csv
    from optiserve.files import atomic_write

    if args.bench_command == "engine":
        from optiserve.bench.engine import bench_engine
        from optiserve.runtime import RuntimeOptions

        results = bench_engine(args.artifact_dir, args.variants, args.batch_sizes, args.duration,
                               RuntimeOptions(device=args.device, threads=args.threads), progress=not args.quiet,
                               texts=args.texts)
    else:
        from optiserve.bench.http import bench_http
        from optiserve.bench.payloads import dataset_images, images_from_folder

        if args.texts:
            images, sent = [], {}
        else:
            images = images_from_folder(args.images) if args.images else dataset_images(args.dataset, args.image_size)
            sent = {"images": args.images or f"{args.dataset} {args.image_size}px"}
        concurrency = args.concurrency if args.concurrency is not None else ([] if args.rate else [1, 8, 32])
        results = bench_http(args.url, images, args.variants, concurrency, args.rate, args.duration, args.warmup,
                             args.timeout, progress=not args.quiet, settings=sent,
                             model=args.model, protocol=args.protocol, grpc_target=args.grpc_target,
                             texts=args.texts, texts_per_request=args.texts_per_request, tokenizer=args.tokenizer)
    out = save_results(results, args.out)
    report = build_report([(out.name, results)], resamples=1000)
    csv_path = Path(out).with_suffix(".csv")
    with atomic_write(csv_path, "w") as f:
        f.write(to_csv(report["groups"]))
    print_summary(report)
    print(f"\nwrote {out} and {csv_path}; make a report with: optiserve compare {out} --out report/")
    return 0
