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
    max_delay_ms: float = 5.0
    max_queue: int = 256
    timeout_ms: float = 30_000
    threads: int | None = None        # intra-op threads per variant; None: the runtime's default (all cores)
    inference_nice: int = 10          # CPU priority of inference threads below the event loop's (Linux); 0: same
    device: str = "auto"
    max_body_bytes: int = 16 << 20
    max_queue_bytes: int | None = None  # bodies and decoded tensors held at once; None: a quarter of the memory limit
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

    def queue_bytes(self) -> int:
        """--max-queue-bytes, or by default a quarter of the memory this process may use (its
        container's limit where it has one): room for the models and everything else besides."""
        if self.max_queue_bytes is not None:
            return self.max_queue_bytes
        from optiserve.machine import memory_limit_bytes

        return max(64 << 20, memory_limit_bytes() // 4)

    def validate(self) -> None:
        for name, value in (("--max-batch-size", self.max_batch_size), ("--max-queue", self.max_queue),
                            ("--max-image-pixels", self.max_image_pixels), ("--decode-threads", self.decode_threads)):
            if value is not None and value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if self.max_queue_bytes is not None and self.max_queue_bytes < 1 << 20:
            raise UserError(f"--max-queue-bytes must be at least 1 MiB (1048576), got {self.max_queue_bytes}")
        if self.max_delay_ms < 0 or self.timeout_ms <= 0:
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


