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
from baton.wire.internal.v1 import worker_pb2_grpc
from decode_worker.server import SERVICE_NAME, DecodeWorkerService
from engine import SamplingParams
from engine.async_engine import EngineDeadError
from tests.tiny_models import make_tiny_model

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
        worker = asyncio.create_task(run_worker(settings, service, worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                                                SERVICE_NAME))
        for _ in range(600):
            if service.engine is not None and service.engine.is_alive and service.address != settings.listen:
                break
            await asyncio.sleep(0.05)
        statuses = [await health(service.address)]

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
