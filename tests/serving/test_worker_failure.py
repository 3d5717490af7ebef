"""A worker whose engine thread dies stops and exits non-zero, so that a supervisor
(Kubernetes, systemd, `baton up`) restarts it, instead of staying up SERVING while it
can serve nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.runtime.settings import DecodeWorkerSettings
from baton.runtime.worker import run_worker
from decode_worker.server import SERVICE, DecodeWorkerService
from engine import SamplingParams
from engine.async_engine import EngineDeadError
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)


def test_a_worker_whose_engine_fails_turns_not_serving_and_exits_1(tmp_path):
    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    settings = DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                    grace_s=1.0)
    service = DecodeWorkerService(settings)

    async def health(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                    timeout=5)
            return reply.status

    async def scenario() -> tuple[int, list[int]]:
        worker = asyncio.create_task(run_worker(settings, service, SERVICE))
        for _ in range(600):
            if service.engine is not None and service.engine.is_alive and service.address != settings.listen:
                break
            await asyncio.sleep(0.05)
        # Loaded, then SERVING: the worker turns SERVING a moment after its engine is up.
        for _ in range(600):
            if (status := await health(service.address)) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        statuses = [status]

        def fail_every_step() -> None:
            raise RuntimeError("injected step failure")

        await service.engine.call(lambda llm: setattr(llm, "step", fail_every_step))
        stream = await service.engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await stream.get()  # the request in flight fails at once
        await asyncio.wait_for(service.failed.wait(), 10)
        try:  # shutting down: NOT_SERVING, or already refusing calls
            statuses.append(await health(service.address))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        code = await asyncio.wait_for(worker, 60)
        return code, statuses

    code, statuses = asyncio.run(scenario())
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.SERVING not in statuses[1:]
    assert code == 1


async def _start(settings: DecodeWorkerSettings) -> tuple[DecodeWorkerService, asyncio.Task]:
    service = DecodeWorkerService(settings)
    task = asyncio.create_task(run_worker(settings, service, SERVICE))
    for _ in range(1200):
        if service.engine is not None and service.engine.is_alive and service.address != settings.listen:
            return service, task
        await asyncio.sleep(0.05)
    raise TimeoutError("the worker did not start")


def test_the_requests_of_a_failed_engine_move_to_another_worker(tmp_path):
    """Two decode workers behind the gateway's dispatcher; the engine of the one running
    a request fails mid-stream: the stream ends UNAVAILABLE there, the request moves to
    the other worker, and the client's tokens are those of an undisturbed run."""
    from baton.runtime.settings import GatewaySettings
    from gateway.dispatch import Dispatcher
    from gateway.prepare import PreparedRequest
    from gateway.workers import RoutingPolicy, WorkerPool

    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    settings = [DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                     grace_s=0.5, worker_id=f"decode-{i}") for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario():
        (a, a_task), (b, b_task) = [await _start(s) for s in settings]
        services = {a.address: a, b.address: b}
        pool = WorkerPool([], [a.address, b.address], RoutingPolicy.from_settings(
            GatewaySettings(decode_workers=(a.address,))))
        await pool.start()
        dispatcher = Dispatcher(pool)
        prepared = lambda rid: PreparedRequest(rid, list(range(10, 30)), params, priority=0, max_model_len=2048)  # noqa: E731
        undisturbed = [t async for e in dispatcher.run(prepared("calm"), lambda: 60.0) for t in e.token_ids]
        tokens, victim = [], None
        async for event in dispatcher.run(prepared("doomed"), lambda: 60.0):
            tokens.extend(event.token_ids)
            # Fail the engine the request runs on, once, at 5 tokens or the first gather past them.
            if victim is None and len(tokens) >= 5:
                (victim,) = [s for s in services.values() if s.engine.num_streams]

                def fail_every_step() -> None:
                    raise RuntimeError("injected step failure")

                await victim.engine.call(lambda llm: setattr(llm, "step", fail_every_step))
        codes = [await asyncio.wait_for(task, 60) for task in (a_task if victim is a else b_task,)]
        await pool.close()
        survivor = b if victim is a else a
        survivor.failed.set()  # stop it the quick way
        await (b_task if victim is a else a_task)
        return undisturbed, tokens, codes

    undisturbed, tokens, codes = asyncio.run(scenario())
    assert len(undisturbed) == 40 and tokens == undisturbed
    assert codes == [1]  # the failed worker exited non-zero


def test_a_stuck_engine_thread_turns_liveness_not_serving_until_it_steps_again(tmp_path):
    import time

    from baton.runtime.server import LIVENESS_SERVICE

    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    settings = DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                    grace_s=0.5, stall_report_s=1.0)

    async def liveness(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5)
            return reply.status

    async def scenario() -> list[int]:
        service, task = await _start(settings)
        statuses = [await liveness(service.address)]
        stuck = service.engine.call(lambda llm: time.sleep(3.5))  # a command that hangs the engine thread
        stuck = asyncio.ensure_future(stuck)
        await asyncio.sleep(2.5)
        statuses.append(await liveness(service.address))
        await stuck
        await asyncio.sleep(1.5)
        statuses.append(await liveness(service.address))
        service.failed.set()
        await task
        return statuses

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [serving, not_serving, serving]
