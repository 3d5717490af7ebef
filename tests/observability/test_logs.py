"""Log lines that name their request (baton/runtime/logs.py) and the request ids the
gateway takes from a client's or a mesh's x-request-id (gateway/service.py). End to end,
with the exported spans of three processes: tests/observability/test_tracing.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from baton.cli.local import REPO_ROOT
from gateway.service import GenerationService, header_request_id
from gateway.workers import RoutingPolicy, WorkerPool

LOG_ONE_REQUEST = """
import logging
from opentelemetry.sdk.trace import TracerProvider
from baton.runtime.logs import bind_request, configure_logging
configure_logging("DEBUG", "json")
log = logging.getLogger("baton.test")
log.info("before")
span = TracerProvider().get_tracer("t").start_span("generate")
bind_request("req-7", span)
log.debug("during %d", 1)
context = span.get_span_context()
print(format(context.trace_id, "032x"), format(context.span_id, "016x"))
"""


def test_json_lines_carry_the_bound_request_and_its_span():
    """In a process of its own: configure_logging replaces the root logger's handlers."""
    result = subprocess.run([sys.executable, "-c", LOG_ONE_REQUEST], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    trace_id, span_id = result.stdout.split()
    before, during = [json.loads(line) for line in result.stderr.splitlines()]
    assert {k: before[k] for k in ("level", "logger", "message")} == {"level": "INFO", "logger": "baton.test",
                                                                       "message": "before"}
    assert "time" in before and "request_id" not in before and "trace_id" not in before
    assert (during["message"], during["level"]) == ("during 1", "DEBUG")
    assert (during["request_id"], during["trace_id"], during["span_id"]) == ("req-7", trace_id, span_id)


def test_a_request_id_header_is_taken_only_when_it_is_a_plain_id():
    assert header_request_id([("x-request-id", "2f1c-9a")]) == "2f1c-9a"
    assert header_request_id((("X-Request-Id", "abc"),)) == "abc"  # HTTP header names, any case
    for bad in ("", "has space", "é", "x" * 129, "tab\there", b"bytes"):
        assert header_request_id([("x-request-id", bad)]) == "", bad
    assert header_request_id([("traceparent", "00-ab")]) == "" and header_request_id(None) == ""


def test_the_id_a_request_names_wins_and_a_repeated_header_id_is_made_unique():
    """A mesh retries a request under the same x-request-id while the first may still be
    running: the retry is served under an id of its own (a client's own repeated id is
    refused instead, ALREADY_EXISTS)."""
    asyncio.run(request_ids())


async def request_ids() -> None:
    """On an event loop: the pool's gRPC channels are asyncio's."""
    service = GenerationService(WorkerPool([], ["127.0.0.1:9"], RoutingPolicy(0, 0)))
    assert service._request_id("mine", "from-header") == "mine"
    assert service._request_id("", "from-header") == "from-header"
    service._in_flight.add("from-header")
    retry = service._request_id("", "from-header")
    assert retry.startswith("from-header-") and retry != service._request_id("", "from-header")
    generated = service._request_id("", "")
    assert generated and generated not in ("from-header", retry)
