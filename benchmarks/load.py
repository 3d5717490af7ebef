"""The client side of the serving benchmarks: GenerateStream calls and what the client saw
of each (Attempt, Outcome), goodput (requests completed within their deadline), a server
that only refuses (the floor a burst of calls is measured against), and the processes'
RSS and CPU time from /proc."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.workload import BenchRequest

NUM_CHANNELS = 8  # client connections (one HTTP/2 connection caps its concurrent streams)


# What gRPC says of a call whose deadline passed (on either side). Any other message on a
# DEADLINE_EXCEEDED is the server's own: the gateway refused a deadline it could not meet.
DEADLINE_PASSED = "Deadline Exceeded"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One call as the client saw it: its status, seconds to its end, and its tokens."""

    status: str  # "OK" or the gRPC status name
    seconds: float
    ttft: float | None  # seconds to its first token; None: none came
    num_tokens: int
    retry_after_s: float | None  # a refusal's RetryInfo
    timeout_s: float | None  # the call's gRPC deadline, seconds from its send; None: none
    message: str = ""  # a failure's

    @property
    def is_shed(self) -> bool:
        """Admitted, then ended by the gateway when the deployment fell behind (its
        DEADLINE_EXCEEDED says "shed"), before its deadline, with or without a token."""
        return self.status == "DEADLINE_EXCEEDED" and self.message.startswith("shed")

    @property
    def is_refusal(self) -> bool:
        """Refused before any work: RESOURCE_EXHAUSTED, or a DEADLINE_EXCEEDED that the
        server sent before its deadline passed (a deadline the gateway could not meet;
        not a shedding: that request was admitted)."""
        return self.status == "RESOURCE_EXHAUSTED" or (
            self.status == "DEADLINE_EXCEEDED" and self.ttft is None and self.message != DEADLINE_PASSED
            and not self.is_shed)

    @property
    def is_unanswered(self) -> bool:
        """Its deadline passed with neither a refusal nor a token: refused too late, or
        admitted and never started (the client cannot tell which; either fails a target)."""
        return self.status == "DEADLINE_EXCEEDED" and self.ttft is None and not self.is_refusal \
            and not self.is_shed

    def missed_by_s(self, max_tokens: int) -> float | None:
        """A call cut off by its deadline after its first token (so admitted): how much later
        it would have finished, its tokens left at its own pace so far. None for any other."""
        if self.status != "DEADLINE_EXCEEDED" or self.ttft is None:
            return None
        pace = (self.seconds - self.ttft) / max(1, self.num_tokens - 1)
        return max(0, max_tokens - self.num_tokens) * pace


@dataclass
class Outcome:
    """One request as the client saw it (seconds since its phase began): its last attempt,
    and the refusals before it."""

    status: str  # "OK" or the gRPC status name of its last attempt
    sent: float  # its first attempt
    finished: float
    ttft: float | None = None  # of its last attempt
    refusal_seconds: tuple[float, ...] = ()  # each refused attempt's latency (Attempt.is_refusal)
    retry_after_s: float | None = None  # the last refusal's hint
    num_output_tokens: int = 0
    deadline_s: float | None = None  # the time it had from its first attempt; None: no deadline
    is_refused: bool = False  # its last attempt was refused: never admitted
    is_unanswered: bool = False  # its last attempt: Attempt.is_unanswered
    missed_by_s: float | None = None  # started, then cut off by its deadline: Attempt.missed_by_s
    message: str = ""  # its last attempt's failure's

    @property
    def is_within_deadline(self) -> bool:
        """Completed, within its deadline (any completion, without one): goodput."""
        return self.status == "OK" and (self.deadline_s is None or self.finished - self.sent <= self.deadline_s)


def goodput(outcomes: list[Outcome], window_s: float, end: float = float("inf")) -> dict:
    """Requests completed within their deadline (and by `end`, seconds since the phase
    began) per second of `window_s`, and their output tokens per second."""
    good = [o for o in outcomes if o.is_within_deadline and o.finished <= end]
    return {"goodput_requests_per_s": len(good) / window_s if window_s > 0 else 0.0,
            "goodput_output_tokens_per_s": sum(o.num_output_tokens for o in good) / window_s if window_s > 0 else 0.0}


def statuses(outcomes: list[Outcome]) -> dict[str, int]:
    """How many ended with each status."""
    return {status: sum(1 for o in outcomes if o.status == status) for status in sorted({o.status for o in outcomes})}


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# ------------------------------------------------------------------------ client
class Client:
    """GenerateStream over a few channels; each call's outcome as an Outcome."""

    def __init__(self, address: str) -> None:
        import grpc

        from baton.wire.v1 import generation_pb2_grpc

        self._channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                          for _ in range(NUM_CHANNELS)]
        self._stubs = itertools.cycle([generation_pb2_grpc.GenerationStub(c) for c in self._channels])

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def attempt(self, request: BenchRequest, timeout: float | None,
                      answered: Callable[[], None] = lambda: None) -> Attempt:
        """One call, with a gRPC deadline `timeout` seconds away (None: none); `answered()`
        at its first token or its failure, whichever comes first."""
        import grpc

        from baton.wire.status import error_details_from_trailers
        from baton.wire.v1 import generation_pb2 as pb

        message = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
        )
        sent = time.perf_counter()
        ttft, num_tokens = None, 0
        try:
            async for reply in next(self._stubs).GenerateStream(message, timeout=timeout):
                if ttft is None:
                    ttft = time.perf_counter() - sent
                    answered()
                num_tokens += len(reply.token_ids)
        except grpc.aio.AioRpcError as error:
            if ttft is None:
                answered()
            retry = error_details_from_trailers(error.trailing_metadata()).retry_after_s
            return Attempt(error.code().name, time.perf_counter() - sent, ttft, num_tokens, retry, timeout,
                           error.details() or "")
        return Attempt("OK", time.perf_counter() - sent, ttft, num_tokens, None, timeout)

    async def once(self, request: BenchRequest, base: float, timeout: float | None) -> Outcome:
        """One call, its deadline `timeout` seconds away (None: none); no retry."""
        sent = time.perf_counter() - base
        attempt = await self.attempt(request, timeout)
        refused = attempt.is_refusal
        return Outcome(attempt.status, sent, sent + attempt.seconds, attempt.ttft,
                       (attempt.seconds,) if refused else (), attempt.retry_after_s, attempt.num_tokens,
                       timeout, refused, attempt.is_unanswered, attempt.missed_by_s(request.max_tokens),
                       attempt.message)

    async def until_served(self, request: BenchRequest, base: float, deadline_s: float,
                           answered: Callable[[bool], None] = lambda first: None) -> Outcome:
        """Retry after each RESOURCE_EXHAUSTED's hint (doubling backoff, jitter) until
        `deadline_s` from the first attempt (a retry the backoff would put past it is not
        sent: it could only time out), each attempt's gRPC deadline what is left;
        `answered(first)` as each attempt has its answer: its refusal or its first token."""
        start = time.perf_counter()
        sent = start - base
        refusals: list[float] = []
        backoff = 0.0
        while True:
            left = deadline_s - (time.perf_counter() - start)
            if left <= backoff:  # out of time, or the hint runs past it: no call that could only time out
                return Outcome("DEADLINE_EXCEEDED", sent, time.perf_counter() - base, None, tuple(refusals),
                               deadline_s=deadline_s, is_refused=True)
            await asyncio.sleep(backoff)
            first = not refusals
            attempt = await self.attempt(request, deadline_s - (time.perf_counter() - start), lambda: answered(first))
            if attempt.is_refusal:
                refusals.append(attempt.seconds)
            if attempt.status != "RESOURCE_EXHAUSTED":
                return Outcome(attempt.status, sent, time.perf_counter() - base, attempt.ttft, tuple(refusals),
                               attempt.retry_after_s, attempt.num_tokens, deadline_s, attempt.is_refusal,
                               attempt.is_unanswered, attempt.missed_by_s(request.max_tokens))
            backoff = (attempt.retry_after_s or 1.0) * random.uniform(1, 2) * 2 ** min(len(refusals) - 1, 3)


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Each process's resident memory, sampled every `interval_s` while running."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: dict[str, list[int]] = {role: [] for role in pids}
        self._task: asyncio.Task | None = None

    def sample(self) -> dict[str, int]:
        now = {role: rss_or_zero(pid) for role, pid in self.pids.items()}
        for role, value in now.items():
            self.samples[role].append(value)
        return now

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict:
        self._task.cancel()
        self.sample()
        # A process that exited meanwhile reads 0 from then on: its ratios are infinite,
        # which fails any bound on them.
        return {role: {"start_mb": s[0] / 2**20, "max_mb": max(s) / 2**20, "end_mb": s[-1] / 2**20,
                       "exited": 0 in s,
                       "max_ratio": max(s) / s[0] if 0 not in s else float("inf"),
                       "end_ratio": s[-1] / s[0] if 0 not in s else float("inf")}
                for role, s in self.samples.items()}


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (`field`: VmRSS now, VmHWM its peak); 0 once it has
    exited (unreaped: no such line); OSError once it is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss(pid: int) -> None:
    """Start a process's VmHWM afresh from its present RSS (Linux >= 4.0), so that a later
    peak is not one reached before (while importing, say)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def rss_or_zero(pid: int) -> int:
    """rss_bytes, or 0 for a process that is gone."""
    try:
        return rss_bytes(pid)
    except OSError:
        return 0


# ------------------------------------------------------------------------ floor
def _refusing_server(port: int, ready) -> None:
    """A baton.v1.Generation server that refuses every call at once and does nothing else."""
    import grpc
    import uvloop

    from baton.wire.v1 import generation_pb2_grpc

    class Refusing(generation_pb2_grpc.GenerationServicer):
        async def GenerateStream(self, request, context):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refusing every call")
            yield  # an async generator, as the gateway's handler is

    async def serve() -> None:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(Refusing(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(serve())


class RefusingServer:
    """A baton.v1.Generation server in a process of its own that refuses every call at once
    and does nothing else: `wave` measures what answering many calls at once costs this
    client and one Python gRPC process on this machine, however little the server does."""

    def __init__(self) -> None:
        import multiprocessing

        from baton.cli.local import free_port

        context = multiprocessing.get_context("spawn")  # never fork a process that runs grpc
        self.port, self._ready = free_port(), context.Event()
        self._process = context.Process(target=_refusing_server, args=(self.port, self._ready), daemon=True)

    async def __aenter__(self) -> RefusingServer:
        self._process.start()
        try:
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(self._ready.wait, 1):
                if not self._process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the refusing server did not start (exit code {self._process.exitcode})")
            self.client = Client(f"127.0.0.1:{self.port}")
            for _ in range(NUM_CHANNELS):  # every channel connected, as the gateway's are by then
                attempt = await self.client.attempt(BenchRequest("connect", [1], 1), 30)
                if attempt.status != "RESOURCE_EXHAUSTED":
                    raise RuntimeError(f"the refusing server answered {attempt.status}")
        except BaseException:
            self._process.kill()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.client.close()
        self._process.kill()
        await asyncio.to_thread(self._process.join)

    async def wave(self, requests: list[BenchRequest]) -> dict:
        """Every request at once, each once: their refusal latency, and the server's CPU time
        per call."""
        base, start_cpu = time.perf_counter(), cpu_seconds(self._process.pid)
        outcomes = await asyncio.gather(*(self.client.once(r, base, 30) for r in requests))
        cpu_per_call = (cpu_seconds(self._process.pid) - start_cpu) / len(requests)
        seconds = [o.refusal_seconds[0] for o in outcomes if o.refusal_seconds]
        return {"num_calls": len(requests), "refusal_p50_ms": percentile(seconds, 50) * 1e3,
                "refusal_p99_ms": percentile(seconds, 99) * 1e3, "cpu_ms_per_call": cpu_per_call * 1e3}
