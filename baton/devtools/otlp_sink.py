"""A minimal OTLP/gRPC trace receiver that keeps spans in memory: for tests and the
tracing-overhead benchmark."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

_KINDS = {
    trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED",
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
_STATUS_CODES = {
    trace_pb2.Status.STATUS_CODE_UNSET: "UNSET",
    trace_pb2.Status.STATUS_CODE_OK: "OK",
    trace_pb2.Status.STATUS_CODE_ERROR: "ERROR",
}


@dataclass(frozen=True, slots=True)
class SinkEvent:
    """A span event."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SinkSpan:
    """A received span, with its resource's attributes and its instrumentation scope."""

    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str  # 16 lowercase hex digits, "" for a root span
    name: str
    kind: str  # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER or UNSPECIFIED
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[SinkEvent, ...]
    status_code: str  # UNSET, OK or ERROR
    status_message: str
    resource: dict[str, Any]
    scope: str

    @property
    def service_name(self) -> str:
        """The resource's `service.name` ("" when it has none)."""
        return str(self.resource.get("service.name", ""))

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def any_value(value: common_pb2.AnyValue) -> Any:
    """An OTLP AnyValue as a Python value (None when unset)."""
    which = value.WhichOneof("value")
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return None if which is None else getattr(value, which)


def attributes(key_values: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    """Repeated OTLP KeyValues as a dict."""
    return {kv.key: any_value(kv.value) for kv in key_values}


def _span(span: trace_pb2.Span, resource: dict[str, Any], scope: str) -> SinkSpan:
    return SinkSpan(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        name=span.name,
        kind=_KINDS.get(span.kind, "UNSPECIFIED"),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=attributes(span.attributes),
        events=tuple(SinkEvent(e.name, e.time_unix_nano, attributes(e.attributes)) for e in span.events),
        status_code=_STATUS_CODES.get(span.status.code, "UNSET"),
        status_message=span.status.message,
        resource=resource,
        scope=scope,
    )


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """Converts each export's spans and hands them to `on_export`."""

    def __init__(self, on_export: Callable[[list[SinkSpan]], None]) -> None:
        self._on_export = on_export

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                received.extend(_span(s, resource, scope_spans.scope.name) for s in scope_spans.spans)
        self._on_export(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    """Receives OTLP trace exports on host:port (port 0: a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._spans: list[SinkSpan] = []
        self._num_exports = 0
        self._server: grpc.Server | None = None

    def start(self) -> OtlpSink:
        """Start serving (a sync gRPC server on a thread pool); returns self."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._add), server)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """host:port"""
        return f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """http://host:port, for OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://{self.address}"

    def spans(self) -> list[SinkSpan]:
        """The spans received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        """Forget the spans received so far (`num_exports` keeps counting)."""
        with self._lock:
            self._spans.clear()

    @property
    def num_spans(self) -> int:
        with self._lock:
            return len(self._spans)

    @property
    def num_exports(self) -> int:
        """Export calls received."""
        with self._lock:
            return self._num_exports

    def wait_for(self, predicate: Callable[[list[SinkSpan]], bool], timeout_s: float) -> list[SinkSpan]:
        """Poll until `predicate(spans)` holds; returns those spans. TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() >= deadline:
                raise TimeoutError(f"OTLP sink: predicate not met after {timeout_s} s ({len(spans)} spans received)")
            time.sleep(0.02)

    def _add(self, spans: list[SinkSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self._num_exports += 1
