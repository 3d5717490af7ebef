"""The in-memory OTLP sink receives what the OpenTelemetry SDK's OTLP/gRPC exporter sends."""

from __future__ import annotations

import pytest
from grpc import Compression
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from baton.devtools.otlp_sink import OtlpSink, any_value

pytestmark = pytest.mark.timeout(60)

ATTRIBUTES = {
    "s": "text",
    "b": True,
    "i": 42,
    "f": 0.25,
    "ss": ("a", "b"),
    "bs": (True, False),
    "is": (1, 2, 3),
    "fs": (0.5, 1.5),
}


@pytest.fixture
def sink():
    with OtlpSink() as running:
        yield running


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_receives_sdk_spans(sink, compression):
    provider = TracerProvider(resource=Resource.create({"service.name": "sink-test"}))
    exporter = OTLPSpanExporter(endpoint=sink.endpoint, insecure=True, compression=compression)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests.otlp_sink")
    with tracer.start_as_current_span("parent", kind=trace.SpanKind.SERVER) as parent:
        parent.set_attributes(ATTRIBUTES)
        with tracer.start_as_current_span("child", kind=trace.SpanKind.CLIENT) as child:
            child.add_event("handoff", {"blocks": 7, "ok": True, "where": "decode-0"})
            child.set_status(trace.Status(trace.StatusCode.ERROR, "transfer failed"))
    provider.shutdown()

    spans = sink.wait_for(lambda s: len(s) == 2, timeout_s=5)
    assert sink.num_spans == 2 and sink.num_exports == 2  # SimpleSpanProcessor: one export per span
    by_name = {s.name: s for s in spans}
    parent_span, child_span = by_name["parent"], by_name["child"]
    parent_context = parent.get_span_context()
    assert parent_span.trace_id == format(parent_context.trace_id, "032x")
    assert parent_span.span_id == format(parent_context.span_id, "016x")
    assert parent_span.parent_span_id == ""
    assert child_span.trace_id == parent_span.trace_id
    assert child_span.parent_span_id == parent_span.span_id
    assert len(child_span.span_id) == 16 and child_span.span_id != parent_span.span_id
    assert (parent_span.kind, child_span.kind) == ("SERVER", "CLIENT")
    assert parent_span.start_ns <= child_span.start_ns <= child_span.end_ns <= parent_span.end_ns
    assert 0 <= child_span.duration_s <= parent_span.duration_s < 5

    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in ATTRIBUTES.items()}
    assert parent_span.attributes == expected
    for key, value in expected.items():
        received = parent_span.attributes[key]
        assert type(received) is type(value)
        if isinstance(value, list):
            assert [type(x) for x in received] == [type(x) for x in value]

    (event,) = child_span.events
    assert event.name == "handoff"
    assert event.attributes == {"blocks": 7, "ok": True, "where": "decode-0"}
    assert child_span.start_ns <= event.time_ns <= child_span.end_ns

    assert (parent_span.status_code, parent_span.status_message) == ("UNSET", "")
    assert (child_span.status_code, child_span.status_message) == ("ERROR", "transfer failed")
    for span in spans:
        assert span.service_name == "sink-test"
        assert span.resource["service.name"] == "sink-test"
        assert span.scope == "tests.otlp_sink"

    sink.clear()
    assert sink.spans() == [] and sink.num_exports == 2


def test_wait_for_times_out(sink):
    with pytest.raises(TimeoutError, match="0 spans"):
        sink.wait_for(lambda spans: len(spans) > 0, timeout_s=0.1)


def test_any_value_kinds():
    value = common_pb2.AnyValue(kvlist_value=common_pb2.KeyValueList(values=[
        common_pb2.KeyValue(key="bytes", value=common_pb2.AnyValue(bytes_value=b"\x00\x01")),
        common_pb2.KeyValue(key="nested", value=common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[
            common_pb2.AnyValue(int_value=-3), common_pb2.AnyValue(double_value=2.5),
            common_pb2.AnyValue(string_value="x"), common_pb2.AnyValue(bool_value=False),
        ]))),
    ]))
    assert any_value(value) == {"bytes": b"\x00\x01", "nested": [-3, 2.5, "x", False]}
    assert any_value(common_pb2.AnyValue()) is None
