"""One OpenTelemetry trace per request across the gateway, the prefill worker, the KV
handoff and the decode worker: three real processes export OTLP to an in-test receiver."""

from __future__ import annotations

import json
import random
import time

import grpc
import httpx2 as httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.cli.local import start_deployment
from baton.devtools.otlp_sink import OtlpSink, SinkSpan
from baton.runtime import latency
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.tokenizer import load_tokenizer
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
BLOCK_SIZE = 4
PREFILL_BUDGET = 8  # the prefill worker's tokens per step: long prompts run in chunks
SPAN_NAMES = {"generate", "tokenize", "prefill", "decode", "kv_transfer"}
JSON_LOGS = ["--log-format", "json", "--log-level", "DEBUG"]


def caller_context() -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """A caller's trace id, span id and the W3C traceparent metadata naming them."""
    trace_id = f"{random.getrandbits(128):032x}"
    span_id = f"{random.getrandbits(64):016x}"
    return trace_id, span_id, (("traceparent", f"00-{trace_id}-{span_id}-01"),)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Run the workload against a traced deployment, stop it (which flushes every
    process's spans) and hand the test what was sent, received and exported."""
    directory = tmp_path_factory.mktemp("tiny-tracing")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.save_pretrained(directory)
    sink = OtlpSink().start()
    deployment = start_deployment(
        path,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--dtype", "float64", "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "300", *JSON_LOGS],
        prefill_args=["--max-num-batched-tokens", str(PREFILL_BUDGET)],
        decode_args=["--verify-kv"],
        gateway_args=["--max-prefill-queue-tokens", "0", *JSON_LOGS],  # every prompt is handed off
        http_port=0,
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )
    run = {"sink": sink}
    try:
        with grpc.insecure_channel(deployment.gateway) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            run["model"] = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

            # A streamed text prompt under the caller's trace: long enough for 3+ chunks.
            text = "The quick brown fox jumps over the lazy dog, then it runs far away into the dark woods."
            trace_id, span_id, metadata = caller_context()
            request = pb.GenerateRequest(
                request_id="traced-stream",
                text=text,
                sampling=pb.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
            )
            messages = list(stub.GenerateStream(request, timeout=60, metadata=metadata))
            run["stream"] = dict(trace_id=trace_id, span_id=span_id, messages=messages,
                                 prompt_tokens=len(tokenizer.encode(text)))

            # A unary chat request under another caller's trace.
            trace_id, span_id, metadata = caller_context()
            chat = pb.GenerateRequest(
                request_id="traced-chat",
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello there, how are you?")]),
                sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            response = stub.Generate(chat, timeout=60, metadata=metadata)
            run["chat"] = dict(trace_id=trace_id, span_id=span_id, response=response)

            # Over the OpenAI HTTP API, under a caller's trace: the same trace across the hops.
            trace_id, span_id, metadata = caller_context()
            answer = httpx.post(f"http://{deployment.http}/v1/completions", headers=dict(metadata), timeout=60,
                                json={"model": run["model"], "prompt": "A prompt of its own, so that its KV is handed over: "
                                      "nothing of it is cached on the decode worker yet.", "max_tokens": 3,
                                      "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            run["http"] = dict(trace_id=trace_id, span_id=span_id)

            # A mesh's x-request-id and no request id of its own: that is its id, and it comes back.
            trace_id, span_id, metadata = caller_context()
            _, call = stub.Generate.with_call(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(400, 430))),
                sampling=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
                timeout=60, metadata=(*metadata, ("x-request-id", "mesh-grpc-1")))
            run["mesh_grpc"] = dict(trace_id=trace_id, echoed=dict(call.initial_metadata()).get("x-request-id"))
            trace_id, span_id, metadata = caller_context()
            answer = httpx.post(f"http://{deployment.http}/v1/completions", timeout=60,
                                headers={**dict(metadata), "X-Request-Id": "mesh-http-1"},
                                json={"model": run["model"], "prompt": "Another prompt, with a mesh's request id.",
                                      "max_tokens": 3, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            run["mesh_http"] = dict(trace_id=trace_id, echoed=answer.headers.get("x-request-id"))

            # No traceparent: Baton starts the trace.
            run["untraced"] = list(stub.GenerateStream(pb.GenerateRequest(
                request_id="no-parent", token_ids=pb.TokenIds(ids=list(range(200, 230))),
                sampling=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)), timeout=60))

            # Refused at validation: an error span, nothing on the workers.
            trace_id, span_id, metadata = caller_context()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(pb.GenerateRequest(request_id="refused", text=""), timeout=10, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            run["refused"] = dict(trace_id=trace_id)

            # Cancelled mid-stream by the caller.
            trace_id, span_id, metadata = caller_context()
            call = stub.GenerateStream(pb.GenerateRequest(
                request_id="cancelled", token_ids=pb.TokenIds(ids=list(range(300, 340))),
                sampling=pb.SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)),
                timeout=60, metadata=metadata)
            received = 0
            for message in call:  # tokens after the first come from the decode worker
                received += len(message.token_ids)
                if received >= 3:
                    break
            call.cancel()
            run["cancelled"] = dict(trace_id=trace_id)
            time.sleep(1.0)  # let the cancel reach the workers
    finally:
        codes = deployment.stop()
        sink.stop()
    assert codes == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()
    run["spans"] = sink.spans()
    run["logs"] = {process.role: process.log() for process in deployment.processes}
    return run


def trace_of(spans: list[SinkSpan], trace_id: str) -> dict[str, list[SinkSpan]]:
    by_name: dict[str, list[SinkSpan]] = {}
    for span in spans:
        if span.trace_id == trace_id:
            by_name.setdefault(span.name, []).append(span)
    return by_name


def one(by_name: dict[str, list[SinkSpan]], name: str, kind: str | None = None) -> SinkSpan:
    spans = [s for s in by_name.get(name, []) if kind is None or s.kind == kind]
    assert len(spans) == 1, (name, kind, spans)
    return spans[0]


def test_one_trace_across_all_processes_under_the_callers_span(traced):
    stream = traced["stream"]
    spans = trace_of(traced["spans"], stream["trace_id"])
    assert set(spans) == SPAN_NAMES, set(spans)
    generate = one(spans, "generate")
    tokenize = one(spans, "tokenize")
    prefill = one(spans, "prefill")
    decode = one(spans, "decode")
    receive = one(spans, "kv_transfer", "CLIENT")
    send = one(spans, "kv_transfer", "SERVER")
    assert sum(len(v) for v in spans.values()) == 6

    # The caller's span is the root's parent; then the hops, parent to child.
    assert generate.parent_span_id == stream["span_id"]
    assert tokenize.parent_span_id == generate.span_id
    assert prefill.parent_span_id == generate.span_id
    assert decode.parent_span_id == generate.span_id
    assert receive.parent_span_id == decode.span_id
    assert send.parent_span_id == receive.span_id
    # Each span comes from the process that did the work.
    assert {s.service_name for s in (generate, tokenize)} == {"baton-gateway"}
    assert {s.service_name for s in (prefill, send)} == {"baton-prefill-worker"}
    assert {s.service_name for s in (decode, receive)} == {"baton-decode-worker"}
    assert prefill.resource["baton.role"] == "prefill-worker"
    assert [s.kind for s in (generate, prefill, decode)] == ["SERVER"] * 3
    failed = [(s.name, s.kind, s.status_message, s.attributes) for s in (generate, tokenize, prefill, decode, receive,
                                                                          send) if s.status_code == "ERROR"]
    assert not failed, failed
    # The hops happen in order, inside the request.
    assert generate.start_ns <= tokenize.start_ns <= tokenize.end_ns <= prefill.start_ns
    assert prefill.end_ns <= receive.end_ns <= decode.end_ns <= generate.end_ns + 50_000_000


def test_an_http_request_joins_the_callers_trace_as_a_grpc_call_does(traced):
    http = traced["http"]
    spans = trace_of(traced["spans"], http["trace_id"])
    assert set(spans) == SPAN_NAMES, set(spans)
    generate = one(spans, "generate")
    assert generate.parent_span_id == http["span_id"]
    assert generate.attributes["http.route"] == "/v1/completions"
    assert one(spans, "decode").parent_span_id == generate.span_id


def test_genai_attributes_hold_the_requests_values(traced):
    stream = traced["stream"]
    spans = trace_of(traced["spans"], stream["trace_id"])
    generate = one(spans, "generate").attributes
    messages = stream["messages"]
    output_tokens = sum(len(m.token_ids) for m in messages)
    assert output_tokens == 6
    assert generate["gen_ai.operation.name"] == "text_completion"
    assert generate["gen_ai.request.model"] == traced["model"]
    assert generate["gen_ai.response.model"] == traced["model"]
    assert generate["gen_ai.request.max_tokens"] == 6
    assert generate["gen_ai.request.temperature"] == pytest.approx(0.8)
    assert generate["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert generate["gen_ai.request.seed"] == 7
    assert generate["gen_ai.response.finish_reasons"] == ["length"]
    assert generate["gen_ai.response.id"] == "traced-stream"
    assert generate["gen_ai.usage.input_tokens"] == stream["prompt_tokens"] == messages[-1].usage.prompt_tokens
    assert generate["gen_ai.usage.output_tokens"] == output_tokens == messages[-1].usage.completion_tokens
    assert generate["baton.request_id"] == "traced-stream"
    assert generate["baton.route"] == "disaggregated"
    assert generate["baton.time_to_first_token_s"] > 0
    assert one(spans, "tokenize").attributes["baton.prompt.tokens"] == stream["prompt_tokens"]

    decode = one(spans, "decode").attributes
    assert decode["gen_ai.request.model"] == traced["model"]
    assert decode["gen_ai.request.max_tokens"] == 6
    assert decode["gen_ai.response.finish_reasons"] == ["length"]
    assert decode["gen_ai.usage.output_tokens"] == output_tokens  # the first token counts here too
    assert decode["baton.kv.handoff"] is True and decode["baton.queue_time_s"] >= 0

    chat = traced["chat"]
    chat_spans = trace_of(traced["spans"], chat["trace_id"])
    assert set(chat_spans) == SPAN_NAMES
    generate = one(chat_spans, "generate")
    assert generate.parent_span_id == chat["span_id"]
    assert generate.attributes["gen_ai.operation.name"] == "chat"
    assert generate.attributes["rpc.method"] == "Generate"
    assert generate.attributes["gen_ai.usage.output_tokens"] == len(chat["response"].token_ids) == 4
    assert generate.attributes["gen_ai.usage.input_tokens"] == chat["response"].usage.prompt_tokens


def test_prefill_has_an_event_per_chunk_with_its_batch(traced):
    stream = traced["stream"]
    spans = trace_of(traced["spans"], stream["trace_id"])
    prefill = one(spans, "prefill")
    chunks = [event for event in prefill.events if event.name == "prefill_chunk"]
    num_prompt = stream["prompt_tokens"]
    assert len(chunks) == -(-num_prompt // PREFILL_BUDGET) >= 3
    assert [c.attributes["baton.chunk.start"] for c in chunks] == [i * PREFILL_BUDGET for i in range(len(chunks))]
    assert sum(c.attributes["baton.chunk.tokens"] for c in chunks) == num_prompt
    for chunk in chunks:
        assert chunk.attributes["baton.batch.num_seqs"] >= 1
        assert chunk.attributes["baton.chunk.tokens"] <= chunk.attributes["baton.batch.num_tokens"] <= PREFILL_BUDGET
        assert prefill.start_ns <= chunk.time_ns <= prefill.end_ns
    steps = [c.attributes["baton.step"] for c in chunks]
    assert steps == sorted(set(steps))
    assert prefill.attributes["baton.prefill.chunks"] == len(chunks)
    assert prefill.attributes["gen_ai.usage.input_tokens"] == num_prompt
    assert prefill.attributes["baton.kv.blocks"] == -(-num_prompt // BLOCK_SIZE)
    assert prefill.attributes["baton.queue_time_s"] >= 0 and prefill.attributes["baton.prefill_time_s"] > 0


def test_kv_transfer_spans_on_both_sides_and_the_decode_timeline(traced):
    stream = traced["stream"]
    spans = trace_of(traced["spans"], stream["trace_id"])
    receive = one(spans, "kv_transfer", "CLIENT").attributes
    send = one(spans, "kv_transfer", "SERVER").attributes
    blocks = -(-stream["prompt_tokens"] // BLOCK_SIZE)
    assert receive["baton.kv.blocks"] == send["baton.kv.blocks"] == blocks
    assert receive["baton.kv.bytes"] == send["baton.kv.bytes"] > 0
    assert receive["baton.kv.verified"] is True and send["baton.kv.checksummed"] is True
    for attributes in (receive, send):
        assert attributes["baton.kv.duration_s"] > 0
        assert attributes["baton.kv.bandwidth_gbps"] == pytest.approx(
            attributes["baton.kv.bytes"] / attributes["baton.kv.duration_s"] / 1e9)
    assert receive["baton.kv.direction"] == "receive" and send["baton.kv.direction"] == "send"
    assert receive["baton.kv.transport"] == send["baton.kv.transport"] == "ipc"  # one host
    # The pull's waits and copy, within its duration.
    parts = [receive[f"baton.kv.{name}_s"] for name in ("kv_channel", "kv_copy", "kv_checksum")]
    assert all(part >= 0 for part in parts) and sum(parts) <= receive["baton.kv.duration_s"]
    # The gateway's span: the request's time, phase by phase (baton/runtime/latency.py).
    generate = one(spans, "generate").attributes
    phases = {name: generate[f"baton.latency.{name}_s"] for name in latency.PHASE_NAMES}
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert sum(phases[name] for name in ("gateway_queue", "prefill_queue", "prefill_compute", "first_token_out")) \
        == pytest.approx(generate["baton.time_to_first_token_s"], rel=0.05)
    assert sum(phases[name] for name in ("gateway_queue", "prefill_queue", "prefill_compute",
                                         *latency.HANDOFF_PHASES)) \
        == pytest.approx(generate["baton.time_to_second_token_s"], rel=0.05)

    decode = one(spans, "decode")
    names = [event.name for event in decode.events]
    assert names[:3] == ["admitted", "kv_received", "first_decode_step"], names
    assert "prefill_chunk" not in names  # its prompt was prefilled elsewhere
    assert decode.events[0].attributes["baton.kv_remote"] is True


def test_untraced_refused_and_cancelled_requests(traced):
    spans = traced["spans"]
    # Without a traceparent the gateway's span is the root of a new trace.
    roots = [s for s in spans if s.name == "generate" and s.attributes.get("baton.request_id") == "no-parent"]
    assert len(roots) == 1 and roots[0].parent_span_id == ""
    assert set(trace_of(spans, roots[0].trace_id)) == SPAN_NAMES

    refused = trace_of(spans, traced["refused"]["trace_id"])
    assert set(refused) == {"generate", "tokenize"}
    generate = one(refused, "generate")
    assert generate.status_code == "ERROR" and "INVALID_ARGUMENT" in generate.status_message
    assert generate.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    cancelled = trace_of(spans, traced["cancelled"]["trace_id"])
    assert one(cancelled, "generate").status_code == "ERROR"
    assert "CANCELLED" in one(cancelled, "generate").status_message
    decode = one(cancelled, "decode")
    assert decode.status_code == "ERROR" and "CANCELLED" in decode.status_message

    # Only request work is traced: no spans for health checks, stats polls or model info.
    assert {s.name for s in spans} == SPAN_NAMES


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("front", ["mesh_grpc", "mesh_http"])
def test_json_log_lines_name_the_request_and_its_trace_in_every_process(traced, front):
    """--log-format json: each line a JSON object; the lines a request's calls log carry its
    id (a mesh's x-request-id, sent back to it) and the trace and span they belong to, the
    very ids of the exported spans, in the gateway and both workers."""
    request_id = front.replace("_", "-") + "-1"
    run = traced[front]
    assert run["echoed"] == request_id
    spans = trace_of(traced["spans"], run["trace_id"])
    generate = one(spans, "generate")
    assert generate.attributes["baton.request_id"] == request_id
    lines = {role: json_lines(text) for role, text in traced["logs"].items()}
    assert all(lines.values())
    for line in lines["gateway"][:5]:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    gateway = [line for line in lines["gateway"] if line.get("request_id") == request_id]
    assert gateway and all((line["trace_id"], line["span_id"]) == (run["trace_id"], generate.span_id)
                           for line in gateway), gateway
    for role, span_name in (("prefill", "prefill"), ("decode", "decode")):
        mine = [line for line in lines[role] if line.get("request_id", "").startswith(request_id + "@")]
        assert mine and all(line["trace_id"] == run["trace_id"] for line in mine), (role, mine)
        assert one(spans, span_name).span_id in {line["span_id"] for line in mine}, (role, mine)
