"""Optional OpenTelemetry tracing (`--otlp-endpoint`, the `otel` extra).

Every HTTP request and gRPC call gets a server span that continues the caller's W3C `traceparent`,
with children for its admission, its wait in the queue and its response; every batch gets a span
of its own, linked to the requests it served (a batch belongs to several traces at once), with the
inference inside. Off by default: then OpenTelemetry is never imported and every call here is a
no-op that costs one check.
"""

from __future__ import annotations

import contextlib
import time
from typing import ContextManager, Mapping

from optiserve.errors import UserError

_tracer = None     # the SDK's tracer once configured; None: tracing is off
_provider = None
INSTALL = "tracing needs OpenTelemetry: pip install 'optiserve[otel]'"
_OFF = contextlib.nullcontext()  # what a span is while tracing is off: entering it yields None


def configure_tracing(endpoint: str | None = None, exporter=None, service_name: str = "optiserve") -> None:
    """Send spans to the OTLP/gRPC collector at `endpoint` (http://host:4317 in clear, https:// over
    TLS), batched in the background — or, for tests, to `exporter` as each span ends. Neither: off."""
    global _tracer, _provider
    shutdown_tracing()
    if endpoint is None and exporter is None:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise UserError(INSTALL) from None
    import optiserve

    provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                        "service.version": optiserve.__version__}))
    if exporter is None:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("optiserve.serve")


def shutdown_tracing() -> None:
    """Send what is still buffered and stop (at server shutdown)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def flush(timeout_s: float = 5.0) -> None:
    """Send the spans still buffered (at server shutdown, while the exporter can still reach its collector)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def enabled() -> bool:
    return _tracer is not None


def request_span(name: str, carrier: Mapping[str, str], attributes: dict | None = None) -> ContextManager:
    """The server span of one request, current while it is handled; a `traceparent` (and
    `tracestate`) in `carrier` (its headers or gRPC metadata) makes it a child of the caller's span."""
    if _tracer is None:
        return _OFF
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(carrier)
    return _tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def span(name: str, attributes: dict | None = None) -> ContextManager:
    """A child of the current span for the work inside the block (entering it yields the span, or
    None while tracing is off)."""
    return _OFF if _tracer is None else _tracer.start_as_current_span(name, attributes=attributes)


def current_span_context():
    """The current span's context, for a batch to link to (None when off or outside a request)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def record_span(name: str, start: float, end: float, attributes: dict | None = None) -> None:
    """A child of the current span for work already done, timed by `time.perf_counter()` values."""
    if _tracer is None:
        return
    epoch_ns = _epoch_clock()
    _tracer.start_span(name, start_time=epoch_ns(start), attributes=attributes).end(end_time=epoch_ns(end))


def record_batch(links: list, start: float, inference_start: float, end: float, attributes: dict,
                 error: str | None = None, inference_end: float | None = None) -> None:
    """A batch, already run (`time.perf_counter()` values): a span of its own linked to the spans of
    the requests it served, with its inference (until `inference_end`, else `end`) as a child."""
    if _tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link, Status, StatusCode

    epoch_ns = _epoch_clock()
    unique = {(c.trace_id, c.span_id): c for c in links}  # a request's rows may share a batch
    batch = _tracer.start_span("batch", context=trace.set_span_in_context(trace.INVALID_SPAN),
                               links=[Link(c) for c in unique.values()], attributes=attributes,
                               start_time=epoch_ns(start))
    inference = _tracer.start_span("inference", context=trace.set_span_in_context(batch), attributes=attributes,
                                   start_time=epoch_ns(inference_start))
    if error is not None:
        for s in (inference, batch):
            s.set_status(Status(StatusCode.ERROR, error))
    inference.end(end_time=epoch_ns(end if inference_end is None else inference_end))
    batch.end(end_time=epoch_ns(end))


def _epoch_clock():
    """Turns `time.perf_counter()` readings into nanoseconds since the epoch, as spans are timed —
    with one offset, so that the readings of one span keep their order."""
    offset = time.time_ns() - int(time.perf_counter() * 1e9)
    return lambda perf: offset + int(perf * 1e9)
