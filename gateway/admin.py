"""baton.internal.v1.GatewayAdmin: the deployment as the gateway sees it, for operators
(`baton status`)."""

from __future__ import annotations

import asyncio

import grpc

from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from gateway.workers import Worker, WorkerPool

STATS_TIMEOUT_S = 5.0


class GatewayAdminService(worker_pb2_grpc.GatewayAdminServicer):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.model = ""  # set once the workers are known

    async def GetDeploymentStatus(self, request, context) -> worker_pb2.DeploymentStatus:
        """Every configured worker's stats, asked for now, all at once."""
        statuses = await asyncio.gather(*(self._status(worker) for worker in self.pool.workers))
        return worker_pb2.DeploymentStatus(model=self.model, workers=statuses)

    @staticmethod
    async def _status(worker: Worker) -> worker_pb2.WorkerStatus:
        status = worker_pb2.WorkerStatus(address=worker.address, role=worker.role, in_rotation=worker.is_up)
        try:
            stats = await worker.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            status.error = f"{error.code().name}: {error.details()}"
            return status
        status.reachable = True
        status.stats.CopyFrom(stats)
        return status
