"""The gRPC deadline travels with a request: each worker reads its call's deadline into
the engine, whose queues it orders within a priority level (tests/engine/test_scheduler.py),
and a prefill worker frees the KV it holds for a handoff at the deadline, not at the
end of the lease. In-process workers, called directly as the gateway calls them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from baton.runtime.clients import DecodeWorkerClient, PrefillWorkerClient
from baton.runtime.settings import DecodeWorkerSettings, PrefillWorkerSettings, WorkerSettings
from baton.runtime.worker import WorkerBase, run_worker
from baton.wire.records import DecodeRequest, WorkRequest
from decode_worker.server import SERVICE as DECODE_SERVICE
from decode_worker.server import DecodeWorkerService
from engine import SamplingParams
from prefill_worker.server import SERVICE as PREFILL_SERVICE
from prefill_worker.server import PrefillWorkerService
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)


async def _start(settings: WorkerSettings, service: WorkerBase, descriptor) -> asyncio.Task:
    task = asyncio.create_task(run_worker(settings, service, descriptor))
    for _ in range(1200):
        if service.engine is not None and service.engine.is_alive and service.address != settings.listen:
            return task
        await asyncio.sleep(0.05)
    raise TimeoutError("the worker did not start")


async def _stop(service: WorkerBase, task: asyncio.Task) -> None:
    service.failed.set()  # the quick way
    await task


def _settings(cls, tmp_path, **fields):
    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    return cls(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1, grace_s=0.5, **fields)


def test_a_decode_calls_deadline_reaches_its_engine_request(tmp_path):
    settings = _settings(DecodeWorkerSettings, tmp_path)
    service = DecodeWorkerService(settings)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def first_event(client: DecodeWorkerClient, request_id: str, timeout: float | None):
        events = aiter(client.decode(DecodeRequest(WorkRequest(request_id, [5, 6, 7, 8], params)), timeout=timeout))
        await anext(events)
        return events

    async def scenario() -> tuple[float | None, float | None, float]:
        task = await _start(settings, service, DECODE_SERVICE)
        client = DecodeWorkerClient(service.address)
        try:
            sent = time.monotonic()
            streams = [await first_event(client, "timed", 20.0), await first_event(client, "untimed", None)]
            deadlines = await service.engine.call(
                lambda llm: [llm.scheduler.requests[request_id].deadline for request_id in ("timed", "untimed")])
            for stream in streams:
                await stream.aclose()
        finally:
            await client.close()
            await _stop(service, task)
        return *deadlines, sent

    timed, untimed, sent = asyncio.run(scenario())
    assert untimed is None
    assert sent + 15.0 < timed <= sent + 20.5  # monotonic seconds, read at the call's start


def test_kv_held_for_a_prefill_is_freed_at_its_deadline_not_at_lease_expiry(tmp_path):
    """Its decode call shares the deadline: KV nobody pulled by then never will be."""
    settings = _settings(PrefillWorkerSettings, tmp_path, lease_s=30.0)
    service = PrefillWorkerService(settings)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario():
        task = await _start(settings, service, PREFILL_SERVICE)
        client = PrefillWorkerClient(service.address)
        try:
            prompt = list(range(5, 45))
            untimed = await client.prefill(WorkRequest("untimed", prompt, params, kv_token="u" * 32), timeout=None)
            timed = await client.prefill(WorkRequest("timed", prompt, params, kv_token="t" * 32), timeout=2.0)
            prefilled = time.monotonic()
            leases = service.sender.leases
            assert "untimed" in leases and "timed" in leases
            held_s = None
            for _ in range(100):  # 5 s
                if "timed" not in leases:
                    held_s = time.monotonic() - prefilled
                    break
                await asyncio.sleep(0.05)
            held = await service.engine.call(lambda llm: sorted(llm.scheduler.handoffs.held))
            return untimed.kv_handle, timed.kv_handle, held_s, held, service.sender.num_leases_expired
        finally:
            await client.close()
            await _stop(service, task)

    untimed, timed, held_s, held, num_expired = asyncio.run(scenario())
    assert untimed.lease_s == 30.0 and 0 < timed.lease_s <= 2.1  # (gRPC rounds the timeout it sends up)
    assert held_s is not None and held_s < 2.1 + 0.5  # its deadline and a sweep, not 30 s
    assert held == ["untimed"]  # its blocks went back to the engine
    assert num_expired == 0  # no decode worker was too slow: nobody could have pulled it
