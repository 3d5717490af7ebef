"""The client side of the serving benchmarks: GenerateStream calls and what the client saw
of each (Outcome), a server that only refuses (the floor a burst of calls is measured
against), and the processes' RSS and CPU time from /proc."""

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


@dataclass
class Outcome:
    """One request as the client saw it (seconds since its phase began)."""

    status: str  # "OK" or the gRPC status name of its last attempt
    sent: float
    finished: float
    ttft: float | None = None
    refusal_seconds: tuple[float, ...] = ()  # each RESOURCE_EXHAUSTED attempt's latency
    retry_after_s: float | None = None  # the last refusal's hint



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

    async def attempt(self, request: BenchRequest, timeout: float,
                      answered: Callable[[], None] = lambda: None) -> tuple[str, float, float | None, float | None]:
        """(status, seconds, ttft, retry hint) of one call; `answered()` at its first token
        or its failure, whichever comes first."""
        import grpc

        from baton.wire.status import error_details_from_trailers
        from baton.wire.v1 import generation_pb2 as pb

        message = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
        )
        sent = time.perf_counter()
        ttft = None
        try:
            async for _ in next(self._stubs).GenerateStream(message, timeout=timeout):
                if ttft is None:
                    ttft = time.perf_counter() - sent
                    answered()
        except grpc.aio.AioRpcError as error:
            if ttft is None:
                answered()
            retry = error_details_from_trailers(error.trailing_metadata()).retry_after_s
            return error.code().name, time.perf_counter() - sent, ttft, retry
        return "OK", time.perf_counter() - sent, ttft, None

    async def once(self, request: BenchRequest, base: float, timeout: float) -> Outcome:
        sent = time.perf_counter() - base
        status, seconds, ttft, retry = await self.attempt(request, timeout)
        refusals = (seconds,) if status == "RESOURCE_EXHAUSTED" else ()
        return Outcome(status, sent, sent + seconds, ttft, refusals, retry)

    async def until_served(self, request: BenchRequest, base: float, deadline_s: float,
                           answered: Callable[[bool], None] = lambda first: None) -> Outcome:
        """Retry after each refusal's hint (doubling backoff, jitter) until `deadline_s`;
        `answered(first)` as each attempt has its answer: its refusal or its first token."""
        sent = time.perf_counter() - base
        refusals: list[float] = []
        while True:
            left = deadline_s - (time.perf_counter() - base)
            if left <= 0:
                return Outcome("DEADLINE_EXCEEDED", sent, time.perf_counter() - base, None, tuple(refusals))
            first = not refusals
            status, seconds, ttft, retry = await self.attempt(request, left, lambda: answered(first))
            if status != "RESOURCE_EXHAUSTED":
                return Outcome(status, sent, time.perf_counter() - base, ttft, tuple(refusals))
            refusals.append(seconds)
            backoff = (retry or 1.0) * random.uniform(1, 2) * 2 ** min(len(refusals) - 1, 3)
            await asyncio.sleep(min(backoff, max(0.0, deadline_s - (time.perf_counter() - base))))


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


def rss_bytes(pid: int) -> int:
    """A process's resident memory; 0 once it has exited (unreaped: no VmRSS line);
    OSError once it is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


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
                status, *_ = await self.client.attempt(BenchRequest("connect", [1], 1), 30)
                if status != "RESOURCE_EXHAUSTED":
                    raise RuntimeError(f"the refusing server answered {status}")
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
