"""The server's log lines: text (uvicorn's style) or one JSON object a line, at a chosen level, each
line about a request carrying that request's ID.

A request's ID is the caller's `X-Request-ID` (HTTP header or gRPC metadata) when it is a sensible
token, else one made here; it is answered back and set in a context variable for the request's
task, so every line logged while answering it says which request it was about.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid

REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata keys are lower case
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_ACCEPTED = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def accepted_request_id(sent: str | bytes | None) -> str:
    """The caller's ID when it is 1-128 printable token characters (what a log line and a header can
    carry safely), else a new one: 32 hex digits."""
    if isinstance(sent, bytes):
        sent = sent.decode("latin-1")
    if sent and _ACCEPTED.fullmatch(sent):
        return sent
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Puts the current request's ID (or None) on every record, as `record.request_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    """uvicorn's style (`INFO:     message`), with `[request ID]` on lines about a request."""

    def __init__(self):
        super().__init__("%(levelname)s:     %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid:
            first, sep, rest = text.partition("\n")
            text = f"{first} [request {rid}]{sep}{rest}"
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the request ID when the
    line is about a request, and the traceback (`exception`) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            line["request_id"] = rid
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """Send the server's lines, and uvicorn's, to stderr in `log_format` at `level` (replacing any
    earlier setup: uvicorn workers and Ray replicas call this in their own processes)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True  # through the root's handler, in the same format
        logger.setLevel(level.upper())

