"""OpenTelemetry tracing: one trace per request across the gateway, the prefill worker,
the KV handoff and the decode worker.

Configured the standard way, from the environment, in every process:

- OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) turns it on:
  spans go over OTLP (gRPC by default; http/protobuf if that exporter is
  installed) through a batch processor, off the request path. With no endpoint,
  or OTEL_SDK_DISABLED=true, tracing is off: every helper here returns at once
  and no span object is ever made.
- OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names the process (default: baton-gateway,
  baton-prefill-worker, baton-decode-worker); every process also carries the
  resource attribute `baton.role`.
- OTEL_TRACES_SAMPLER / _ARG, OTEL_PROPAGATORS, OTEL_BSP_* and the exporter's
  own variables (headers, TLS, compression, timeout) work as they do anywhere.

Context travels as W3C `traceparent` / `tracestate` in the gRPC metadata of every
call a request makes (Prefill, Decode, SendKv, ReleaseKv, OpenKvChannel), injected
and extracted with the configured propagator. A client's own `traceparent` on a
Generate call makes the gateway's `generate` span a child of the caller's span.
Only request calls are traced: health checks, stats polls and reflection make no
spans.

Contexts are passed explicitly (a span in, metadata out), never through the
current-context variable: the handlers are async generators that grpc may close
from another task.

Spans (names and attributes: docs/observability.md, Tracing):

    generate (gateway, SERVER)          GenAI request/response attributes
      tokenize
      prefill (prefill worker, SERVER)  one event per chunk, with its batch
      decode (decode worker, SERVER)    admission, preemptions, first decode step
        kv_transfer (decode, CLIENT)    blocks, bytes, duration, bandwidth, verified
          kv_transfer (prefill, SERVER)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from typing import TypeVar

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from baton.runtime.settings import tracing_env
from engine.timeline import (
    Admitted,
    FirstDecodeStep,
    KvReceived,
    KvReceiveFailed,
    Preempted,
    PrefillChunk,
    SwappedIn,
    TimelineEvent,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

SERVER = SpanKind.SERVER
CLIENT = SpanKind.CLIENT
INTERNAL = SpanKind.INTERNAL

# Metadata keys a propagator may read; anything else in a call's metadata is ignored.
_CONTEXT_KEYS = frozenset({"traceparent", "tracestate", "baggage"})

_tracer: trace.Tracer | None = None  # None: tracing is off
_provider = None


def configure_tracing(role: str, instance_id: str | None = None) -> bool:
    """Set up this process's tracing from the environment (see the module docstring).

    `role` is "gateway", "prefill-worker" or "decode-worker". Returns whether
    spans are exported.
    """
    global _tracer, _provider
    env = tracing_env()
    if not env.endpoint or env.disabled:
        return False
    exporter = _exporter(env.protocol)
    if exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"baton.role": role}
    if not env.names_service:
        attributes["service.name"] = f"baton-{role}"
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("baton")
    logger.info("tracing: exporting spans to %s", env.endpoint)
    return True


def _exporter(protocol: str):
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            logger.error("tracing off: OTLP protocol %r is not supported (use grpc or http/protobuf)", protocol)
            return None
    except ImportError as error:
        logger.error("tracing off: no OTLP exporter for %s (%s)", protocol, error)
        return None
    return OTLPSpanExporter()


def shutdown_tracing() -> None:
    """Export what is still buffered and stop (at process exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


# ------------------------------------------------------------------ spans
def start_span(
    name: str, parent: Context | Span | None, kind: SpanKind = INTERNAL, attributes: dict | None = None
) -> Span | None:
    """A started span (end it yourself), child of `parent` (a span, or a context from
    `extract`); None when tracing is off."""
    if _tracer is None:
        return None
    if isinstance(parent, Span):
        parent = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def recording(span: Span | None) -> bool:
    """Whether `span` records (tracing on and the trace sampled): gate costly attributes on it."""
    return span is not None and span.is_recording()


def add_events(span: Span | None, events: Iterable[TimelineEvent] | None) -> None:
    """Add a request's engine timeline events (engine.timeline) as span events, with their own times."""
    if span is None or not events:
        return
    for event in events:
        name, attributes = _event_name_and_attributes(event)
        span.add_event(name, attributes, timestamp=event.time_ns)


def _event_name_and_attributes(event: TimelineEvent) -> tuple[str, dict]:
    """The span event name and attributes of one engine timeline event."""
    match event:
        case Admitted():
            return "admitted", {
                "baton.queue_time_s": event.queue_time_s,
                "baton.readmitted": event.readmitted,
                "baton.kv_remote": event.kv_remote,
                "baton.prefix_cache.cached_tokens": event.cached_tokens,
                "baton.prefix_cache.host_cached_tokens": event.host_cached_tokens,
            }
        case PrefillChunk():
            return "prefill_chunk", {
                "baton.chunk.start": event.start,
                "baton.chunk.tokens": event.num_tokens,
                "baton.chunk.recompute": event.is_recompute,
                "baton.step": event.batch.step_index,
                "baton.batch.num_seqs": event.batch.num_seqs,
                "baton.batch.num_tokens": event.batch.num_tokens,
            }
        case FirstDecodeStep():
            return "first_decode_step", {
                "baton.step": event.batch.step_index,
                "baton.batch.num_seqs": event.batch.num_seqs,
                "baton.batch.num_tokens": event.batch.num_tokens,
            }
        case Preempted():
            return "preempted", {
                "baton.preemption.kind": event.kind.value,
                "baton.preemption.blocks": event.num_blocks,
                "baton.computed_tokens": event.num_computed_tokens,
            }
        case SwappedIn():
            return "swapped_in", {"baton.preemption.blocks": event.num_blocks}
        case KvReceived():
            return "kv_received", {}
        case KvReceiveFailed():
            return "kv_receive_failed", {}
    raise TypeError(f"not an engine timeline event: {event!r}")


def end_span(span: Span | None, error_code=None, error: str = "") -> None:
    """End `span`; with `error_code` (a grpc.StatusCode) it ends in error."""
    if span is None:
        return
    if error_code is not None:
        span.set_attribute("rpc.grpc.status_code", error_code.value[0])
        span.set_status(Status(StatusCode.ERROR, f"{error_code.name}: {error}" if error else error_code.name))
    span.end()


# ---------------------------------------------------------- propagation
def extract(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context from a call's invocation metadata (None: none, or off)."""
    if _tracer is None or not metadata:
        return None
    carrier = {key: value for key, value in metadata if key in _CONTEXT_KEYS and isinstance(value, str)}
    if not carrier:
        return None
    return propagate.extract(carrier)


def metadata(span: Span | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying `span`'s context to the next hop (None when off)."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items()) or None


# ------------------------------------------------------------ attributes
def request_attributes(model: str, params, *, operation: str) -> dict:
    """OpenTelemetry GenAI request attributes of one generation request."""
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if params.top_k:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return attributes


def set_request(span: Span, model: str, params, operation: str, request_id: str, num_prompt_tokens: int,
                priority: int) -> None:
    """The gateway's `generate` span, once its request is read and tokenized."""
    span.set_attributes({
        **request_attributes(model, params, operation=operation),
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": num_prompt_tokens,
        "baton.request_id": request_id,
        "baton.priority": priority,
    })


def set_route(span: Span, decode_address: str, prefill_address: str | None) -> None:
    """Where the gateway sends a request (no prefill worker: colocated on the decode worker)."""
    span.set_attributes({
        "baton.route": "disaggregated" if prefill_address is not None else "colocated",
        "baton.decode_worker": decode_address,
    })
    if prefill_address is not None:
        span.set_attribute("baton.prefill_worker", prefill_address)


def set_response(span: Span, model: str, finish_reason: str, num_output_tokens: int,
                 time_to_first_token: float | None) -> None:
    """The gateway's `generate` span, as its stream ends."""
    span.set_attributes({
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.usage.output_tokens": num_output_tokens,
    })
    if time_to_first_token is not None:
        span.set_attribute("baton.time_to_first_token_s", time_to_first_token)


def set_phases(span: Span, phases: dict[str, float], time_to_second_token: float | None) -> None:
    """Where the request's time went, by phase (baton/runtime/latency.py), onto its `generate` span."""
    span.set_attributes({f"baton.latency.{name}_s": seconds for name, seconds in phases.items()})
    if time_to_second_token is not None:
        span.set_attribute("baton.time_to_second_token_s", time_to_second_token)


def set_prefill_result(span: Span, output) -> None:
    """A prefill worker's span, once its first token is out (output: engine RequestOutput)."""
    span.set_attributes({
        "baton.prefill.chunks": sum(isinstance(event, PrefillChunk) for event in output.events or ()),
        "baton.first_token_id": output.new_token_ids[0],
        "baton.kv.blocks": len(output.kv_block_ids or ()),
        "baton.prefix_cache.cached_tokens": output.num_cached_tokens or 0,
        "baton.prefix_cache.host_cached_tokens": output.num_host_cached_tokens,
    })


# Spans (by id) of calls whose request has finished: a caller that hangs up once it has
# the last message (a gateway closing a decode stream) does not fail them. (Marked as the
# last message is produced: a deadline or cancel at that very moment also ends OK.)
_FINISHED: set[int] = set()


def set_finish(span: Span, finish_reason: str | None, num_output_tokens: int) -> None:
    """A worker's span, at its request's last output."""
    span.set_attributes({
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.usage.output_tokens": num_output_tokens,
    })
    _FINISHED.add(id(span))


def end_call_span(span: Span | None, context, error: BaseException | None) -> None:
    """End a server handler's span: in error with the call's status when `error` ended
    the handler (an abort's code, CANCELLED for a cancelled call, else UNKNOWN)."""
    if span is None:
        return
    import asyncio

    import grpc

    finished = id(span) in _FINISHED
    _FINISHED.discard(id(span))
    # The request had finished and its last message was out when the caller hung up (it
    # had what it wanted): not an error.
    if error is None or (finished and isinstance(error, (asyncio.CancelledError, GeneratorExit))
                         and _status_code(context.code()) in (None, grpc.StatusCode.CANCELLED)):
        span.end()
        return
    code = _status_code(context.code())
    if code is None:
        cancelled = isinstance(error, (asyncio.CancelledError, GeneratorExit))
        code = grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN  # as grpc reports it
    end_span(span, code, context.details() or repr(error))


async def call_in_span(span: Span | None, context, call: Awaitable[T]) -> T:
    """Await a unary handler's work, then end its span (in error if it raised)."""
    error = None
    try:
        return await call
    except BaseException as caught:
        error = caught
        raise
    finally:
        end_call_span(span, context, error)


async def stream_in_span(span: Span | None, context, stream: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    """Yield a streaming handler's messages, then close it and end its span (in error if
    it raised or the call was cancelled)."""
    error = None
    try:
        async for message in stream:
            yield message
    except BaseException as caught:
        error = caught
        raise
    finally:
        await stream.aclose()  # its cleanup runs now, not when it is collected
        end_call_span(span, context, error)


def _status_code(code):
    """A grpc.StatusCode from what ServicerContext.code() gives (a StatusCode, an int or None)."""
    import grpc

    if code is None or isinstance(code, grpc.StatusCode):
        return None if code == grpc.StatusCode.OK else code
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return None if status == grpc.StatusCode.OK else status
    return None


def set_timings(span: Span, timings) -> None:
    """A request's engine timings (engine.request.RequestTimings) onto its worker span."""
    if timings.queue_time is not None:
        span.set_attribute("baton.queue_time_s", timings.queue_time)
    if timings.prefill_time is not None:
        span.set_attribute("baton.prefill_time_s", timings.prefill_time)
    span.set_attribute("baton.num_preemptions", timings.num_preemptions)


def transfer_attributes(*, num_blocks: int, num_bytes: int, seconds: float, verified: bool | None = None,
                        transport: str | None = None) -> dict:
    """A KV transfer's attributes (either side; only the receiver can say `verified`)."""
    attributes = {} if transport is None else {"baton.kv.transport": transport}
    attributes |= {
        "baton.kv.blocks": num_blocks,
        "baton.kv.bytes": num_bytes,
        "baton.kv.duration_s": seconds,
        "baton.kv.bandwidth_gbps": num_bytes / seconds / 1e9 if seconds > 0 else 0.0,
    }
    if verified is not None:
        attributes["baton.kv.verified"] = verified
    return attributes
