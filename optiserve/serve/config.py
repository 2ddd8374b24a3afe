"""What `optiserve serve` is told: the options, checked. Kept free of the web stack, so building the
CLI parser (for any subcommand) does not import FastAPI."""

from __future__ import annotations

import re
from dataclasses import dataclass

from optiserve.artifacts import is_repository
from optiserve.errors import UserError

MAX_IMAGE_PIXELS = 4096 * 4096  # larger uploads are refused from their header (Pillow's own limit: 179 M)


MODEL_CONTROL = ("none", "explicit", "poll")
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


@dataclass
class ServeConfig:
    artifact_dir: str                 # an artifact folder, or a repository: a folder of artifact folders
    variants: list[str] | None = None
    ab: str | None = None
    max_batch_size: int = 16
    max_delay_ms: float | None = None  # a batch's window; None: each model's kind's own (model_settings)
    max_batch_tokens: int | None = None  # a text model's batch: at most this many padded tokens; None: no cap
    max_queue: int = 256
    timeout_ms: float = 30_000
    threads: int | None = None        # intra-op threads per variant; None: the runtime's default (all cores)
    instances: int = 1                # inference workers (sessions) per variant, the threads divided between them
    priority_levels: int = 1          # request priorities 1 (highest) .. this, each with its own queue limit
    default_priority: int | None = None  # a request's priority when it names none; None: the lowest
    inference_nice: int = 10          # CPU priority of inference threads below the event loop's (Linux); 0: same
    device: str = "auto"
    max_body_bytes: int = 16 << 20
    max_queue_bytes: int | None = None  # bodies and decoded tensors held at once; None: a quarter of the memory
                                        # limit, shared by the worker processes
    workers: int = 1                  # server processes (uvicorn workers) sharing this machine's memory
    top_k: int = 5
    body_timeout_s: float = 10.0      # a request whose body has not arrived by then gets 408 and its queue place back
    drain_seconds: float = 5.0        # on SIGTERM: not ready, still answering, so load balancers move away first
    shutdown_timeout_s: float = 20.0  # then queued requests are served for this long: 5 + 20 < Kubernetes' 30 s grace
    max_image_pixels: int = MAX_IMAGE_PIXELS
    decode_threads: int | None = None  # threads that parse bodies and decode images; None: min(4, cores)
    manifest_sha256: str | None = None  # serve the folder only if manifest.json has this hash
    model_control: str = "none"       # none: load all at start; explicit: --load-model then the API; poll
    load_models: list[str] | None = None  # explicit mode: loaded at start-up ("*": all)
    poll_seconds: float = 5.0
    strict_readiness: bool = True     # ready only when every start-up model is; false: failed ones may be missing
    admin_token_file: str | None = None  # without it the repository and traffic endpoints answer 403
    model_name: str | None = None     # a single folder's model name (default: its manifest's model)
    grpc_port: int | None = None      # also serve the Open Inference Protocol over gRPC on this port
    host: str = "127.0.0.1"           # where HTTP (uvicorn) and gRPC listen
    tls_cert_file: str | None = None  # HTTPS and gRPC over TLS with this certificate (chain) and key
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # mutual TLS: clients must present a certificate this CA signed
    log_format: str = "text"          # text (uvicorn's style) or json (one object a line)
    log_level: str = "info"
    otlp_endpoint: str | None = None  # OpenTelemetry: send trace spans to this OTLP/gRPC collector
    choose_seconds: float = 4.0       # longest a model's start may time its variants for the default (0: never)

    def queue_bytes(self) -> int:
        """--max-queue-bytes, or by default a quarter of the memory this process may use (its
        container's limit where it has one), divided among the --workers processes that share it:
        room for the models and everything else besides."""
        if self.max_queue_bytes is not None:
            return self.max_queue_bytes
        from optiserve.machine import memory_limit_bytes

        return max(64 << 20, memory_limit_bytes() // 4 // self.workers)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def check_tls(self) -> None:
        """One line naming the option when the TLS files are incomplete, unreadable or do not load
        (a key that is not the certificate's, a file that is not PEM), before anything listens."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise UserError("--tls-cert-file and --tls-key-file go together: give both (the certificate and its key)")
        if self.tls_client_ca_file is not None and not self.tls:
            raise UserError("--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file too")
        if not self.tls:
            return
        import ssl

        for option, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file),
                             ("--tls-client-ca-file", self.tls_client_ca_file)):
            if path is not None:
                try:
                    with open(path, "rb"):
                        pass
                except OSError as e:
                    raise UserError(f"{option} {path}: cannot read it ({e.strerror})") from None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (ssl.SSLError, ValueError) as e:
            raise UserError(f"--tls-cert-file {self.tls_cert_file} with --tls-key-file {self.tls_key_file}: not a PEM "
                            f"certificate and its private key ({e})") from None
        if self.tls_client_ca_file is not None:
            try:
                context.load_verify_locations(self.tls_client_ca_file)
            except (ssl.SSLError, ValueError) as e:
                raise UserError(f"--tls-client-ca-file {self.tls_client_ca_file}: not PEM CA certificates ({e})") from None

    def validate(self) -> None:
        for name, value in (("--max-batch-size", self.max_batch_size), ("--max-queue", self.max_queue),
                            ("--max-batch-tokens", self.max_batch_tokens),
                            ("--max-image-pixels", self.max_image_pixels), ("--decode-threads", self.decode_threads),
                            ("--top-k", self.top_k),
                            ("--workers", self.workers)):
            if value is not None and value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        from optiserve.serve.model_settings import MAX_INSTANCES, MAX_PRIORITY_LEVELS

        if not 1 <= self.instances <= MAX_INSTANCES:
            raise UserError(f"--instances must be from 1 to {MAX_INSTANCES}, got {self.instances}")
        if not 1 <= self.priority_levels <= MAX_PRIORITY_LEVELS:
            raise UserError(f"--priority-levels must be from 1 to {MAX_PRIORITY_LEVELS}, got {self.priority_levels}")
        if self.default_priority is not None and not 1 <= self.default_priority <= self.priority_levels:
            raise UserError(f"--default-priority must be one of the priority levels 1..{self.priority_levels} "
                            f"(--priority-levels), got {self.default_priority}")
        if self.max_queue_bytes is not None and self.max_queue_bytes < 1 << 20:
            raise UserError(f"--max-queue-bytes must be at least 1 MiB (1048576), got {self.max_queue_bytes}")
        if (self.max_delay_ms is not None and self.max_delay_ms < 0) or self.timeout_ms <= 0:
            raise UserError("--max-delay-ms must be >= 0 and --timeout-ms > 0")
        if self.body_timeout_s <= 0 or self.shutdown_timeout_s < 0 or self.drain_seconds < 0:
            raise UserError("--body-timeout-s must be > 0, --shutdown-timeout-s and --drain-seconds >= 0")
        if self.model_control not in MODEL_CONTROL:
            raise UserError(f"--model-control must be one of {', '.join(MODEL_CONTROL)}, got {self.model_control!r}")
        if self.load_models and self.model_control != "explicit":
            raise UserError("--load-model only applies with --model-control explicit (the other modes load "
                            "every model)")
        if self.grpc_port is not None and not 0 < self.grpc_port < 65536:
            raise UserError(f"--grpc-port must be a port number (1-65535), got {self.grpc_port}")
        from optiserve.serve.logs import LOG_FORMATS, LOG_LEVELS

        if self.log_format not in LOG_FORMATS or self.log_level not in LOG_LEVELS:
            raise UserError(f"--log-format must be one of {', '.join(LOG_FORMATS)} and --log-level one of "
                            f"{', '.join(LOG_LEVELS)}; got {self.log_format!r} and {self.log_level!r}")
        self.check_tls()
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise UserError(f"--otlp-endpoint is a collector's OTLP/gRPC address, http://HOST:4317 (or https:// "
                            f"over TLS); got {self.otlp_endpoint[:100]!r}")
        if self.choose_seconds < 0:
            raise UserError(f"--choose-seconds must be >= 0 (0: never time, take the manifest's recommendation), "
                            f"got {self.choose_seconds:g}")
        if self.poll_seconds <= 0:
            raise UserError("--poll-seconds must be positive")
        if self.model_name is not None:
            if not MODEL_NAME.fullmatch(self.model_name):
                raise UserError(f"--model-name {self.model_name!r}: use letters, digits, '.', '_' and '-' only "
                                f"(it is part of URLs such as /v2/models/NAME/infer)")
            if is_repository(self.artifact_dir):
                raise UserError("--model-name names the model of one artifact folder; in a repository each model "
                                "is named after its sub-folder")
        if self.manifest_sha256 and is_repository(self.artifact_dir):
            raise UserError("--manifest-sha256 pins one artifact folder; it cannot apply to a repository")


