"""`optiserve serve`: serve an artifact folder over HTTP (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time

from optiserve.batch_window import IMAGE_MAX_DELAY_MS, TEXT_MAX_DELAY_MS
from optiserve.errors import UserError
from optiserve.serve.config import ServeConfig

DESCRIPTION = """\
Load the variants of PATH once, warm them up, and serve them with dynamic batching. PATH is one
artifact folder (one model, named by its manifest) or a repository: a folder of artifact folders,
each a model named after its sub-folder. Without --ab a model's traffic goes to its fastest
accepted variant: the one optimize recommended when it timed on this kind of machine, else the
fastest timed at start-up (--choose-seconds).

  optiserve serve artifacts/resnet18-digits
  optiserve serve artifacts/resnet18-digits --variants onnx-int8,fp32 --ab onnx-int8=0.9,fp32=0.1
  optiserve serve models/ --model-control poll --admin-token-file token.txt"""

DEFAULTS = ServeConfig(artifact_dir="")
log = logging.getLogger("optiserve.serve")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = DESCRIPTION
    p.add_argument("artifact_dir", metavar="PATH",
                   help="a folder written by `optimize`, or a repository: a folder of such folders")
    p.add_argument("--variants", type=_names, default=None, metavar="A,B",
                   help="variants to serve (default: every accepted variant that can run here); a variant "
                        "named here is served whatever its status, with a warning")
    p.add_argument("--ab", default=None, metavar="A=W,B=W",
                   help="traffic split for requests that name no variant (default: all to the fastest accepted "
                        "variant, timed at start-up)")
    p.add_argument("--choose-seconds", type=float, default=DEFAULTS.choose_seconds, metavar="S",
                   help=f"without --ab, the default variant is the one optimize recommended when this machine "
                        f"matches the one it timed on (CPU, cores, flags, engine versions); otherwise the variants "
                        f"are timed at start-up for at most S seconds (default {DEFAULTS.choose_seconds:g}; 0: never "
                        f"time, take the recommendation whatever machine it came from)")
    p.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size, metavar="N",
                   help=f"largest batch the batcher forms (default {DEFAULTS.max_batch_size}; 1 turns batching off)")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="text models: a batch holds at most N padded tokens (rows x its longest row; a packed "
                        "variant's rows of several texts x their length), at least a "
                        "model's max length; a text that would take a batch past it starts the next one "
                        "(default: no cap, only --max-batch-size)")
    p.add_argument("--max-delay-ms", type=float, default=None, metavar="T",
                   help=f"longest the oldest queued image waits for a fuller batch (default {IMAGE_MAX_DELAY_MS:g}; "
                        f"text models {TEXT_MAX_DELAY_MS:g}: a batch is cut as soon as an instance is free)")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue, metavar="N",
                   help=f"queued images per variant (and per priority level) beyond which requests get 429 "
                        f"(default {DEFAULTS.max_queue})")
    p.add_argument("--priority-levels", type=int, default=DEFAULTS.priority_levels, metavar="N",
                   help="request priorities 1 (highest) to N, from the protocol's `priority` parameter, the "
                        "X-Priority header or /predict?priority=; higher ones are served first and each level has "
                        "its own --max-queue places (default 1: all requests equal)")
    p.add_argument("--default-priority", type=int, default=None, metavar="P",
                   help="the priority of a request that names none (default: the lowest, N)")
    p.add_argument("--max-queue-bytes", type=int, default=None, metavar="N",
                   help="bytes that requests may hold in memory at once (bodies being read, JSON being parsed, "
                        "decoded images); past it requests are answered 429, and one that could never fit 413 "
                        "(default: a quarter of the memory limit, the container's else the machine's, divided "
                        "among the --workers)")
    p.add_argument("--timeout-ms", type=float, default=DEFAULTS.timeout_ms, metavar="T",
                   help=f"per-request limit; past it the answer is 504 (default {DEFAULTS.timeout_ms:g})")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads per variant (default: the runtime's, all cores)")
    p.add_argument("--instances", type=int, default=DEFAULTS.instances, metavar="N",
                   help=f"inference workers per variant, each with its own session and a share of the threads, so "
                        f"one batch runs while the next forms (default {DEFAULTS.instances})")
    p.add_argument("--inference-nice", type=int, default=DEFAULTS.inference_nice, metavar="N",
                   help=f"CPU priority of inference threads below request handling, as a nice value (Linux; "
                        f"default {DEFAULTS.inference_nice}, 0 for equal priority)")
    p.add_argument("--body-timeout-s", type=float, default=DEFAULTS.body_timeout_s, metavar="S",
                   help=f"a request body not received within S seconds gets 408 and gives its queue place back "
                        f"(default {DEFAULTS.body_timeout_s:g})")
    p.add_argument("--drain-seconds", type=float, default=DEFAULTS.drain_seconds, metavar="S",
                   help=f"on SIGTERM, report not ready (/v2/health/ready 503) for S seconds while still answering, "
                        f"so load balancers stop sending first (default {DEFAULTS.drain_seconds:g}; SIGINT and a "
                        f"second SIGTERM skip it)")
    p.add_argument("--shutdown-timeout-s", type=float, default=DEFAULTS.shutdown_timeout_s, metavar="S",
                   help=f"after the drain, how long queued requests may still be served; the rest get 503 "
                        f"(default {DEFAULTS.shutdown_timeout_s:g})")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULTS.max_image_pixels, metavar="N",
                   help=f"larger uploads are refused from their header (default {DEFAULTS.max_image_pixels:,})")
    p.add_argument("--top-k", type=int, default=DEFAULTS.top_k, metavar="K",
                   help=f"a classifier's classes answered per input where the request names no top_k "
                        f"(default {DEFAULTS.top_k})")
    p.add_argument("--decode-threads", type=int, default=None, metavar="N",
                   help="threads that parse JSON bodies, tokenize texts beyond a few sentences and decode images with "
                        "Pillow, off the event loop (default: min(4, cores))")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the name a single artifact folder's model is served under (default: the manifest's model; "
                        "under KServe, the InferenceService's name)")
    p.add_argument("--manifest-sha256", default=None, metavar="HEX",
                   help="serve the folder only if its manifest.json has this sha256 (pins every variant file)")
    p.add_argument("--model-control", default=DEFAULTS.model_control, choices=["none", "explicit", "poll"],
                   help="none: load every model at start-up, no load/unload API (default); explicit: load the "
                        "--load-model ones, then what the repository API asks; poll: follow the folder, "
                        "loading new, reloading changed and unloading removed models")
    p.add_argument("--load-model", action="append", default=None, metavar="NAME", dest="load_models",
                   help="with --model-control explicit: a model to load at start-up, or a pipeline with its "
                        "steps' models (repeatable; * for all)")
    p.add_argument("--poll-seconds", type=float, default=DEFAULTS.poll_seconds, metavar="S",
                   help=f"with --model-control poll: how often the repository is re-read (default "
                        f"{DEFAULTS.poll_seconds:g})")
    p.add_argument("--strict-readiness", type=_true_or_false, default=DEFAULTS.strict_readiness, metavar="true|false",
                   help="true (default): ready once at least one model is loaded and every model named at start-up "
                        "(--load-model, or all in none/poll mode) is; false: a start-up model that failed to load "
                        "does not hold readiness back (its reason is in the repository index)")
    p.add_argument("--admin-token-file", default=None, metavar="FILE",
                   help="enables the repository and traffic endpoints, for requests with `Authorization: "
                        "Bearer <the file's token>` (without it they answer 403)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="default: the PORT environment variable if set (as KServe and other platforms set it), else 8000")
    p.add_argument("--grpc-port", type=int, default=None, metavar="N",
                   help="also serve the Open Inference Protocol over gRPC (KServe v2 GRPCInferenceService, as "
                        "tritonclient.grpc calls it) on this port, e.g. 8001 (default: HTTP only)")
    p.add_argument("--tls-cert-file", default=None, metavar="PEM",
                   help="serve HTTPS and gRPC over TLS with this certificate (chain); needs --tls-key-file")
    p.add_argument("--tls-key-file", default=None, metavar="PEM", help="the private key of --tls-cert-file")
    p.add_argument("--tls-client-ca-file", default=None, metavar="PEM",
                   help="mutual TLS: accept only clients whose certificate this CA (bundle) signed")
    p.add_argument("--access-log", action="store_true", help="log every request (off: it costs CPU under load)")
    p.add_argument("--log-format", default=DEFAULTS.log_format, choices=["text", "json"],
                   help="text: uvicorn's style (default); json: one object a line (time, level, logger, message, "
                        "request_id), for log collectors")
    p.add_argument("--log-level", default=DEFAULTS.log_level, choices=["debug", "info", "warning", "error"],
                   help=f"the least severe lines logged (default {DEFAULTS.log_level})")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="OpenTelemetry tracing: send spans (request, admission, queue, batch, inference, response) "
                        "to this OTLP/gRPC collector, e.g. http://otel-collector:4317; a caller's W3C traceparent "
                        "is continued. Needs pip install 'optiserve[otel]' (default: off)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes, each with its own copy of every variant; the default --max-queue-bytes "
                        "is divided among them (default 1)")


def _true_or_false(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig that `optiserve serve ARGS` runs with (also what the Ray deployment parses)."""
    return ServeConfig(artifact_dir=args.artifact_dir, variants=args.variants, ab=args.ab,
                      max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                      max_delay_ms=args.max_delay_ms,
                      max_queue=args.max_queue, max_queue_bytes=args.max_queue_bytes, timeout_ms=args.timeout_ms,
                      threads=args.threads, instances=args.instances, priority_levels=args.priority_levels,
                      default_priority=args.default_priority,
                      inference_nice=args.inference_nice, device=args.device, body_timeout_s=args.body_timeout_s,
                      drain_seconds=args.drain_seconds, shutdown_timeout_s=args.shutdown_timeout_s, max_image_pixels=args.max_image_pixels, top_k=args.top_k,
                      decode_threads=args.decode_threads, manifest_sha256=args.manifest_sha256,
                      model_control=args.model_control, load_models=args.load_models,
                      poll_seconds=args.poll_seconds, strict_readiness=args.strict_readiness,
                      admin_token_file=args.admin_token_file,
                      model_name=args.model_name, grpc_port=args.grpc_port, host=args.host,
                      choose_seconds=args.choose_seconds, log_format=args.log_format, log_level=args.log_level,
                      tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file,
                      tls_client_ca_file=args.tls_client_ca_file, otlp_endpoint=args.otlp_endpoint,
                      workers=args.workers)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from optiserve.serve.app import config_to_environment, configure_logging, create_app
    from optiserve.serve.tracing import configure_tracing

    cfg = config_from_args(args)
    if args.workers > 1 and (cfg.model_control == "explicit" or cfg.admin_token_file):
        # each worker is a process with its own models: an API call would change one of them at random
        raise UserError("--workers N > 1 cannot be combined with --model-control explicit or --admin-token-file: "
                        "a load, unload or traffic call would reach only the worker that answered it. Use one "
                        "worker per process (and replicas for scale), or --model-control poll")
    cfg.validate()  # option mistakes first, in one line, before any port is tried
    if args.workers > 1 and cfg.grpc_port is not None:
        raise UserError("--grpc-port serves from one process: it cannot be combined with --workers N > 1 (run "
                        "one process per replica instead)")
    port = listening_port(args.port)
    if cfg.grpc_port is not None:
        if cfg.grpc_port == port:
            raise UserError(f"--grpc-port {cfg.grpc_port} is the HTTP port too: give gRPC a port of its own (e.g. 8001)")
        check_port_free(args.host, cfg.grpc_port, "--grpc-port")
    configure_logging(cfg.log_format, cfg.log_level)
    configure_tracing(cfg.otlp_endpoint)
    app = create_app(cfg)  # checks the manifest and the variant choice before anything listens
    # uvicorn's own bound on waiting for open requests: ours plus a margin, so it only acts if ours failed
    graceful = cfg.shutdown_timeout_s + 5
    # log_config=None: the loggers set up above, uvicorn's included
    options = dict(host=args.host, port=port, access_log=args.access_log, timeout_graceful_shutdown=graceful,
                   log_config=None, **tls_options(cfg))
    if args.workers > 1:
        config_to_environment(cfg)
        uvicorn.run("optiserve.serve.app:app_from_environment", factory=True, workers=args.workers, **options)
        return 0
    config = uvicorn.Config(app, **options)
    draining_server(config, app.state.server).run()  # a stuck model's daemon thread cannot hold the exit
    return 0


def tls_options(cfg: ServeConfig) -> dict:
    """uvicorn's TLS settings for --tls-cert-file, --tls-key-file and --tls-client-ca-file."""
    if not cfg.tls:
        return {}
    import ssl

    return {"ssl_certfile": cfg.tls_cert_file, "ssl_keyfile": cfg.tls_key_file, "ssl_ca_certs": cfg.tls_client_ca_file,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if cfg.tls_client_ca_file else ssl.CERT_NONE}


def listening_port(port: int | None) -> int:
    """--port, else $PORT (set by KServe, Cloud Run and the like), else 8000."""
    if port is not None:
        return port
    text = os.environ.get("PORT", "").strip()
    if not text:
        return 8000
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"the PORT environment variable is {text!r}, not a port number: set it to one, or pass --port")
    return int(text)


def check_port_free(host: str, port: int, option: str) -> None:
    """A clear error now, before models load, when something already listens on `port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"{option} {port}: cannot listen on {host}:{port} ({e.strerror}); choose a free port") from None


def draining_server(config, server):
    """uvicorn's Server with the termination a rolling update needs. On SIGTERM it first reports not
    ready for --drain-seconds while answering as before (load balancers and Kubernetes endpoints
    stop sending meanwhile); then it stops accepting, and drains the batchers the moment shutdown
    begins — uvicorn would first wait for the open requests, so requests stuck behind a hung model
    would otherwise hold the process until their own timeouts. SIGINT or a second SIGTERM skip the
    drain window."""
    import uvicorn

    drain_s = server.cfg.drain_seconds

    class DrainingServer(uvicorn.Server):
        drain_until: float | None = None
        drain_logged = False

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and drain_s > 0 and self.drain_until is None and not self.should_exit:
                self.drain_until = time.monotonic() + drain_s
                server.terminating = True  # a flag only: this runs in a signal handler
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_until is not None and not self.should_exit:
                if not self.drain_logged:
                    self.drain_logged = True
                    log.info("SIGTERM: reporting not ready for %g s while still answering, then shutting down",
                             drain_s)
                if time.monotonic() >= self.drain_until:
                    self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            server.begin_shutdown()
            await super().shutdown(sockets)

    return DrainingServer(config)
