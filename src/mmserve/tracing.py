"""OpenTelemetry traces of requests across the server, the router and the replicas (`--otlp-traces-endpoint`).

Role: `Tracing` owns one tracer provider (never the process-global one) exporting over OTLP, or into
any span exporter a test hands it. Spans cross processes as W3C `traceparent` strings: the API server
opens a request's span (continuing a client's `traceparent` header), its children — media loading,
the routing decision — carry it, and it travels inside the request to the engine, local or in a
replica's process, whose spans (queue, encode hit or miss, prefill chunks, decode, the hand-off into
the replica) hang under it. Engine spans are written when the request finishes, from the records of
engine/timeline.py, so a step costs no span calls. Without an endpoint nothing here is imported and
nothing is recorded.
What it does not know: the engine, HTTP routes, routing policy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path, added to an endpoint given without one
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # http/protobuf (default) or grpc, as OpenTelemetry names it


@dataclass(frozen=True)
class SpanRecord:
    """One child span of a request as a plain record (engine/timeline.py writes them while the request runs)."""

    name: str
    start_s: float  # time.time()
    end_s: float
    attributes: dict[str, Any] = field(default_factory=dict)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracing:
    def __init__(self, exporter: Any, service_name: str, batch: bool = True,
                 resource_attributes: dict[str, Any] | None = None) -> None:
        """`exporter`: an OpenTelemetry `SpanExporter`; `batch`: export from a background thread (a
        test's in-memory exporter sees spans at once with batch=False)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                                 **(resource_attributes or {})}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("mmserve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_endpoint(cls, endpoint: str, service_name: str, **kwargs: Any) -> Tracing:
        """Export to an OTLP collector. Raises ValueError with what to install when the SDK is missing."""
        return cls(otlp_exporter(endpoint), service_name, **kwargs)

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()

    # ---- context ----------------------------------------------------------------------------------
    def _context(self, trace_parent: str | None) -> Any:
        return None if trace_parent is None else self._propagator.extract({"traceparent": trace_parent})

    def traceparent(self, span: Any) -> str:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier["traceparent"]

    # ---- spans --------------------------------------------------------------------------------------
    def start_server_span(self, name: str, headers: dict[str, str], attributes: dict[str, Any]) -> Any:
        """A request's span in the API server, continuing the caller's trace when it sent one."""
        from opentelemetry.trace import SpanKind

        context = self._propagator.extract(headers)
        return self.tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=attributes)

    @contextlib.contextmanager
    def span(self, name: str, trace_parent: str | None, attributes: dict[str, Any] | None = None) -> Iterator[Any]:
        """A child span around a block of the caller's (its attributes can be added inside)."""
        span = self.tracer.start_span(name, context=self._context(trace_parent), attributes=attributes)
        try:
            yield span
        finally:
            span.end()

    def record(self, name: str, trace_parent: str | None, start_s: float, end_s: float,
               attributes: dict[str, Any] | None = None) -> str:
        """A span of what already happened; returns its traceparent (for children of its own)."""
        span = self.tracer.start_span(name, context=self._context(trace_parent), start_time=_ns(start_s),
                                      attributes=attributes)
        span.end(end_time=_ns(end_s))
        return self.traceparent(span)

    def record_request(self, trace_parent: str | None, start_s: float, end_s: float, attributes: dict[str, Any],
                       children: list[SpanRecord], error: str | None = None) -> None:
        """The engine's span of one request with its children: written at the finish, all at once."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        span = self.tracer.start_span("engine.request", context=self._context(trace_parent),
                                      start_time=_ns(start_s), attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        context = trace.set_span_in_context(span)
        for child in children:
            self.tracer.start_span(child.name, context=context, start_time=_ns(child.start_s),
                                   attributes=child.attributes).end(end_time=_ns(max(child.end_s, child.start_s)))
        span.end(end_time=_ns(end_s))


def otlp_exporter(endpoint: str) -> Any:
    """The OTLP span exporter for `endpoint`: OTLP/HTTP (protobuf) unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    says grpc. An HTTP endpoint without a path gets OTLP's /v1/traces."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter
    except ImportError as exc:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "mmserve[otel]"
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and exporter: pip install {extra} "
                         f"({exc})") from None
    if protocol not in ("http/protobuf", "grpc"):
        raise ValueError(f"{PROTOCOL_ENV} must be http/protobuf or grpc, got {protocol!r}")
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    url = parts.geturl() if parts.path not in ("", "/") else f"{parts.scheme}://{parts.netloc}{OTLP_TRACES_PATH}"
    return HTTPExporter(endpoint=url)

