"""baton.internal.v1.GatewayAdmin: the deployment as the gateway sees it, for operators
(`baton status`)."""

from __future__ import annotations

import asyncio

import grpc

from baton.runtime.latency import RecentLatency
from baton.wire import stats_convert
from baton.wire.internal.v1 import admin_pb2, admin_pb2_grpc
from baton.wire.records import DeploymentStatus, WorkerStatus
from gateway.admission import GatewayAdmission
from gateway.workers import Worker, WorkerPool

STATS_TIMEOUT_S = 5.0


class GatewayAdminService(admin_pb2_grpc.GatewayAdminServicer):
    def __init__(self, pool: WorkerPool, admission: GatewayAdmission | None = None,
                 latency: RecentLatency | None = None) -> None:
        self.pool = pool
        self.admission = admission
        self.latency = latency
        self.model = ""  # set once the workers are known

    async def GetDeploymentStatus(self, request, context) -> admin_pb2.DeploymentStatus:
        """Every configured worker's stats, asked for now, all at once; admission's; the
        latest requests' latency."""
        statuses = await asyncio.gather(*(self._status(worker) for worker in self.pool.workers))
        admission = self.admission.status() if self.admission is not None else None
        latency = self.latency.status(request.latest_requests or None) if self.latency is not None else None
        return stats_convert.deployment_status_to_pb(DeploymentStatus(self.model, tuple(statuses), admission, latency))

    @staticmethod
    async def _status(worker: Worker) -> WorkerStatus:
        try:
            with worker.polls.held():
                stats = await worker.client.get_stats(timeout=STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return WorkerStatus(worker.address, worker.role, reachable=False, in_rotation=worker.routable,
                                error=f"{error.code().name}: {error.details()}")
        except grpc.aio.UsageError:  # retired and closed before this call began
            return WorkerStatus(worker.address, worker.role, reachable=False, in_rotation=False,
                                error="no longer listed")
        return WorkerStatus(worker.address, worker.role, reachable=True, in_rotation=worker.routable, stats=stats)
