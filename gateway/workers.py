"""The gateway's view of its workers: stubs, load polled from each, and the routing choice.

Routing follows the load each worker reported at its last poll, corrected by
what this gateway sent it since (so a burst between two polls spreads out):

- prefill: the worker with the fewest queued prefill tokens;
- decode: the worker with the most free KV blocks.

A worker that fails a poll or a call is marked down and skipped until a
later poll finds it serving again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from baton.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.server import CHANNEL_OPTIONS
from baton.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
POLL_TIMEOUT_S = 2.0


@dataclass
class Worker:
    """One worker as the gateway sees it."""

    address: str
    role: str  # "prefill" | "decode"
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    channel: grpc.aio.Channel
    is_up: bool = False
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    # Sent since the last poll: prompt tokens (prefill), blocks (decode).
    pending_prefill_tokens: int = 0
    pending_blocks: int = 0
    num_in_flight: int = 0

    def load_key(self) -> tuple[int, int]:
        if self.role == "prefill":
            return (self.stats.num_queued_prefill_tokens + self.pending_prefill_tokens, self.num_in_flight)
        return (-(self.stats.num_kv_blocks_free - self.pending_blocks), self.num_in_flight)


class WorkerPool:
    """Stubs for every configured worker, a background poller, and `pick_*`."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str]) -> None:
        self.prefill = [self._make(address, "prefill") for address in prefill_addresses]
        self.decode = [self._make(address, "decode") for address in decode_addresses]
        self._poller: asyncio.Task | None = None
        self.block_size = 16

    @staticmethod
    def _make(address: str, role: str) -> Worker:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        return Worker(address, role, stub_class(channel), channel)

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for worker in self.workers:
            await worker.channel.close()

    async def model_info(self, timeout_s: float) -> pb.ModelInfo:
        """The served model, from the first worker that answers (waits for one to load)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            for worker in self.decode + self.prefill:
                try:
                    return await worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=POLL_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    continue
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"no worker answered GetModelInfo within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ polling
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in self.workers))

    async def _poll(self, worker: Worker) -> None:
        try:
            stats = await worker.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if worker.is_up:
                logger.warning("%s worker %s is down: %s", worker.role, worker.address, error.code().name)
            worker.is_up = False
            return
        if not worker.is_up and stats.serving:
            logger.info("%s worker %s (%s) is up", worker.role, worker.address, stats.worker_id)
        worker.is_up = stats.serving
        worker.stats = stats
        worker.pending_prefill_tokens = 0
        worker.pending_blocks = 0

    def mark_down(self, worker: Worker) -> None:
        worker.is_up = False

    # ------------------------------------------------------------------ routing
    def pick_prefill(self, num_prompt_tokens: int) -> Worker | None:
        """The prefill worker with the fewest queued prefill tokens; None when none is up."""
        worker = min((w for w in self.prefill if w.is_up), key=Worker.load_key, default=None)
        if worker is not None:
            worker.pending_prefill_tokens += num_prompt_tokens
        return worker

    def pick_decode(self, num_tokens: int) -> Worker | None:
        """The decode worker with the most free KV blocks; None when none is up."""
        worker = min((w for w in self.decode if w.is_up), key=Worker.load_key, default=None)
        if worker is not None:
            worker.pending_blocks += -(-num_tokens // self.block_size)
        return worker
