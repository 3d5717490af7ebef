"""The client side of benchmarks/serving.py: one pass of the workload through one of the
gateway's front ends, each request's RequestTiming as the client saw it.

    grpc    baton.v1.Generation/GenerateStream, the prompt as token ids
    http    the OpenAI API's POST /v1/completions, streamed as server-sent events, the
            prompt as token ids, `ignore_eos`, usage in a last chunk
            (`stream_options.include_usage`)

Both send the same requests (greedy, EOS ignored, so exactly `max_tokens` out) at the
same offsets and time them alike, so the two front ends' figures compare. A pass can
target a deployment this run started or one already running (Target: `grpc://HOST:PORT`,
`http://HOST:PORT`).

A server's prefix cache would serve a prompt it saw in an earlier pass (the same
deployment driven over its other front end, a target measured before) without
prefilling it: Workload.fresh() gives each pass prompts no earlier pass sent.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tqdm import tqdm

from benchmarks.serving_report import RequestTiming
from benchmarks.workload import BenchRequest

FRONT_ENDS = ("grpc", "http")
NO_DEADLINE_S = 3600.0  # how long a request may take when no deadline is sent


# ----------------------------------------------------------------------- workload
class Workload:
    """The requests and their arrival offsets, which every pass sends. Each pass's
    prompts differ from every other pass's in their first token alone (the same lengths,
    so the same work), which no prefix cache can match: `fresh()`.

    The first token is rotated within the range of ids the workload already uses (so
    valid for the model) by a salt that is new to each pass and starts at random, so a
    deployment that served an earlier run of this benchmark has not seen these either."""

    def __init__(self, requests: list[BenchRequest], offsets: list[float]) -> None:
        self.requests = requests
        self.offsets = offsets
        ids = [t for r in requests for t in r.prompt_token_ids]
        self._low, self._span = min(ids), max(ids) - min(ids) + 1
        self._salts = itertools.count(random.randrange(1 << 30))

    def _salted(self, request: BenchRequest, salt: int) -> BenchRequest:
        first, *rest = request.prompt_token_ids
        return replace(request, prompt_token_ids=[self._low + (first - self._low + salt) % self._span, *rest])

    def fresh(self) -> list[BenchRequest]:
        """The requests, with prompts no earlier pass sent."""
        salt = next(self._salts)
        return [self._salted(r, salt) for r in self.requests]

    def warm_up_request(self) -> BenchRequest:
        """A short request with a prompt unlike any other (warm_up())."""
        first = self.requests[0]
        return self._salted(replace(first, request_id="warm-up", prompt_token_ids=first.prompt_token_ids[:16],
                                    max_tokens=4), next(self._salts))


@dataclass(frozen=True)
class Target:
    """A running gateway's front end, as `--target` names it: grpc://HOST:PORT, http://HOST:PORT."""

    front_end: str
    address: str  # HOST:PORT

    @property
    def name(self) -> str:
        return f"{self.front_end}://{self.address}"


def parse_targets(values: list[str]) -> list[Target]:
    """`--target` values (each may be a comma list), in the order given."""
    targets = []
    for value in (v for text in values for v in text.split(",") if v):
        front_end, sep, address = value.partition("://")
        if not sep or front_end not in FRONT_ENDS or ":" not in address:
            raise SystemExit(f"--target {value!r}: expected grpc://HOST:PORT or http://HOST:PORT")
        target = Target(front_end, address.rstrip("/"))
        if target in targets:
            raise SystemExit(f"--target {value!r} is named twice")
        targets.append(target)
    return targets


def progress_bar(name: str, total: int) -> tqdm:
    """Requests finished, on stderr while a pass runs (left out when stderr is no terminal)."""
    return tqdm(total=total, desc=name, unit="req", disable=None, leave=False)


def warm_up(front_end: str, address: str, workload: Workload, api_key: str | None = None) -> None:
    """One short request through `front_end`, not measured: the first call's one-off
    costs (a connection, code run the first time) are no steady state."""
    run_pass(front_end, address, [workload.warm_up_request()], [0.0], name=f"{front_end} warm-up", api_key=api_key)


def run_pass(front_end: str, address: str, requests: list[BenchRequest], offsets: list[float], *, name: str,
             deadline_s: float | None = None, api_key: str | None = None) -> list[RequestTiming]:
    """`requests` at their `offsets` through `front_end` at `address`, with a progress bar."""
    drive = {"grpc": drive_grpc, "http": drive_http}[front_end]
    with progress_bar(name, len(requests)) as bar:
        return asyncio.run(drive(address, requests, offsets, deadline_s, api_key=api_key, progress=bar.update))


# --------------------------------------------------------------------------- gRPC
async def drive_grpc(address: str, requests: list[BenchRequest], offsets: list[float],
                     deadline_s: float | None = None, *, api_key: str | None = None,
                     progress: Callable[[], object] = lambda: None) -> list[RequestTiming]:
    """Each request at its offset; with `deadline_s`, as each call's gRPC deadline, a call
    that fails is recorded with its status (without, it stops the run)."""
    import grpc

    from baton.wire.v1 import generation_pb2 as pb
    from baton.wire.v1 import generation_pb2_grpc

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key is not None else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        base = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            sent = time.perf_counter()
            timing = RequestTiming(arrival=sent - base, deadline_s=deadline_s)
            message = pb.GenerateRequest(
                request_id=request.request_id,
                token_ids=pb.TokenIds(ids=request.prompt_token_ids),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
            )
            try:
                async for reply in stub.GenerateStream(message, timeout=deadline_s or NO_DEADLINE_S,
                                                       metadata=metadata):
                    now = time.perf_counter() - sent
                    timing.token_times.extend([now] * len(reply.token_ids))
                    timing.num_output_tokens += len(reply.token_ids)
            except grpc.aio.AioRpcError as error:
                if deadline_s is None:
                    raise
                timing.status = error.code().name
            return _finish(timing, request, sent, progress)

        return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))


def _finish(timing: RequestTiming, request: BenchRequest, sent: float, progress: Callable[[], object]) -> RequestTiming:
    timing.finished = time.perf_counter() - sent
    if timing.status == "OK" and timing.num_output_tokens != request.max_tokens:
        raise RuntimeError(f"{request.request_id}: {timing.num_output_tokens} of {request.max_tokens} tokens")
    progress()
    return timing


# --------------------------------------------------------------------------- HTTP
class _Failed(Exception):
    """A request the server refused or ended with an error: `status` as gRPC names it."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status


async def drive_http(address: str, requests: list[BenchRequest], offsets: list[float],
                     deadline_s: float | None = None, *, api_key: str | None = None,
                     progress: Callable[[], object] = lambda: None) -> list[RequestTiming]:
    """As drive_grpc, over the OpenAI API at `address` (HOST:PORT): streamed /v1/completions
    for the model /v1/models names. `deadline_s` is sent as X-Request-Timeout (the
    gateway's SLO, as a gRPC deadline is) and cuts the request off here when it passes, as
    gRPC's client does. A failure's status is the error's code, which the gateway gives as
    the gRPC status name (RESOURCE_EXHAUSTED, ...).

    One client for the pass: HTTP/1.1 streams one answer a connection, so its pool holds
    a connection for every request of the pass, and no request waits for another's."""
    import httpx2 as httpx

    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if deadline_s is not None:
        headers["X-Request-Timeout"] = str(deadline_s)
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    # trust_env=False: no proxy the shell names sits between the benchmark and the gateway.
    async with httpx.AsyncClient(base_url=f"http://{address}", headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(NO_DEADLINE_S, connect=30.0)) as client:
        models = await client.get("/v1/models")
        if models.status_code != 200:
            raise RuntimeError(f"GET http://{address}/v1/models: {models.status_code} {models.text}")
        model = models.json()["data"][0]["id"]
        base = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            sent = time.perf_counter()
            timing = RequestTiming(arrival=sent - base, deadline_s=deadline_s)
            body = json.dumps({
                "model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }).encode()
            try:
                async with asyncio.timeout(deadline_s):
                    async with client.stream("POST", "/v1/completions", content=body) as response:
                        await _read_events(response, timing, sent)
            except (TimeoutError, _Failed) as error:
                if deadline_s is None:
                    raise
                timing.status = error.status if isinstance(error, _Failed) else "DEADLINE_EXCEEDED"
            return _finish(timing, request, sent, progress)

        return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))


_TOKEN_CHUNK = '"choices":[{'  # in every chunk that carries output, and in no other event


async def _read_events(response, timing: RequestTiming, sent: float) -> None:
    """A streamed completion's events into `timing`. Each chunk with a choice is one
    message of the gateway's stream, as a GenerateStream reply is, but it says not how many
    tokens it carries (its text may hold several, or none yet): its time is recorded, and
    the usage chunk's count then fills the list up to one entry per token with the last
    chunk's time. TTFT, TPOT and the multiset of ITLs come out as from gRPC's replies, where
    a reply of k tokens adds k - 1 gaps of 0. Only the events that are not output chunks
    (usage, errors) are parsed as JSON."""
    if response.status_code != 200:
        raise _Failed(_status(await response.aread(), f"HTTP_{response.status_code}"),
                      f"{response.status_code} {response.text}")
    usage = None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue  # the blank line that ends each event
        data = line[6:]
        if _TOKEN_CHUNK in data:
            timing.token_times.append(time.perf_counter() - sent)
            continue
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise _Failed(_status(data.encode(), "HTTP_ERROR_EVENT"), data)
        if event.get("choices"):  # a chunk serialized unlike the fast check expects
            timing.token_times.append(time.perf_counter() - sent)
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
    timing.num_output_tokens = len(timing.token_times) if usage is None else usage
    if timing.token_times:
        timing.token_times.extend([timing.token_times[-1]] * (timing.num_output_tokens - len(timing.token_times)))


def _status(body: bytes, default: str) -> str:
    """An OpenAI error body's code, upper-cased: the gateway's is the gRPC status name."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return default
    return str(code).upper() if code else default
