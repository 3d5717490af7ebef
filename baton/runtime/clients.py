"""Typed clients of the internal services: records in, records out.

The gateway calls the workers through these, and the decode worker calls the
prefill worker (the KV handoff's control plane). Each method converts at the edge
(baton.wire.convert) and raises grpc.aio.AioRpcError as the call failed. A
streaming method is an async generator: closing it (or leaving its `async for`)
cancels the call on the server, which aborts the request there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from baton.runtime.security import TlsConfig, bearer_metadata
from baton.runtime.server import open_channel
from baton.wire import convert, kv_convert, stats_convert
from baton.wire.internal.v1 import admin_pb2_grpc, worker_pb2_grpc
from baton.wire.v1 import generation_pb2_grpc
from baton.wire.records import (
    DecodeRequest,
    DeploymentStatus,
    GenerateRequest,
    KvChannelOpened,
    ModelInfo,
    OpenKvChannel,
    PrefillResult,
    ReleaseKv,
    SendKv,
    SendKvAccepted,
    SendKvDone,
    TextDelta,
    TokenEvent,
    WorkerStats,
    WorkRequest,
)

Metadata = Sequence[tuple[str, str]] | None


class WorkerClient:
    """What both worker services answer: stats and model info (a subclass names its service)."""

    _stub_class: type

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None, *,
                 tls: TlsConfig | None = None) -> None:
        self.address = address
        self.channel = channel or open_channel(address, tls)
        self._stub = self._stub_class(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def get_stats(self, timeout: float) -> WorkerStats:
        return stats_convert.worker_stats_from_pb(await self._stub.GetStats(convert.GET_STATS, timeout=timeout))

    async def get_model_info(self, timeout: float) -> ModelInfo:
        return convert.model_info_from_pb(await self._stub.GetModelInfo(convert.GET_MODEL_INFO, timeout=timeout))


class PrefillWorkerClient(WorkerClient):
    _stub_class = worker_pb2_grpc.PrefillWorkerStub

    async def prefill(self, work: WorkRequest, *, timeout: float | None, metadata: Metadata = None) -> PrefillResult:
        call = self._stub.Prefill(convert.prefill_request_to_pb(work), timeout=timeout, metadata=metadata)
        try:
            return convert.prefill_result_from_pb(await call)
        finally:
            if not call.done():  # cancelled while waiting: abort it on the worker
                call.cancel()

    async def release_kv(self, request: ReleaseKv, *, timeout: float, metadata: Metadata = None) -> bool:
        response = await self._stub.ReleaseKv(kv_convert.release_kv_to_pb(request), timeout=timeout,
                                              metadata=metadata)
        return kv_convert.released_from_pb(response)

    async def open_kv_channel(self, request: OpenKvChannel, *, timeout: float,
                              metadata: Metadata = None) -> KvChannelOpened:
        response = await self._stub.OpenKvChannel(kv_convert.open_kv_channel_to_pb(request), timeout=timeout,
                                                  metadata=metadata)
        return kv_convert.kv_channel_opened_from_pb(response)

    def send_kv(self, request: SendKv, *, timeout: float, metadata: Metadata = None) -> SendKvCall:
        """Start a send; read its events from the returned call."""
        return SendKvCall(self._stub.SendKv(kv_convert.send_kv_to_pb(request), timeout=timeout, metadata=metadata))


class SendKvCall:
    """A running SendKv: the sender's events, accepted (the lease is pinned), then done."""

    def __init__(self, call) -> None:
        self._call = call

    async def next_event(self) -> SendKvAccepted | SendKvDone | None:
        """The next event; None if the stream ended, or sent something neither."""
        message = await self._call.read()
        if message is grpc.aio.EOF:
            return None
        return kv_convert.send_kv_event_from_pb(message)

    def cancel(self) -> None:
        """Stop the send on the prefill worker (it then frees the blocks unsent)."""
        self._call.cancel()


class DecodeWorkerClient(WorkerClient):
    _stub_class = worker_pb2_grpc.DecodeWorkerStub

    async def decode(self, request: DecodeRequest, *, timeout: float | None,
                     metadata: Metadata = None) -> AsyncIterator[TokenEvent]:
        call = self._stub.Decode(convert.decode_request_to_pb(request), timeout=timeout, metadata=metadata)
        try:
            async for message in call:
                yield convert.token_event_from_pb(message)
        finally:
            if not call.done():  # the client went away or a stop string matched: abort on the worker
                call.cancel()


def worker_stats(channel: grpc.Channel, role: str, timeout: float) -> WorkerStats:
    """A worker's stats over a blocking channel (`role`: "prefill" or "decode")."""
    stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    return stats_convert.worker_stats_from_pb(stub_class(channel).GetStats(convert.GET_STATS, timeout=timeout))


class GenerationClient:
    """The public service, blocking (`baton generate`); `api_key` goes with every call."""

    def __init__(self, channel: grpc.Channel, api_key: str | None = None) -> None:
        self._stub = generation_pb2_grpc.GenerationStub(channel)
        self._metadata = bearer_metadata(api_key)

    def generate(self, request: GenerateRequest, timeout: float) -> TextDelta:
        """The whole answer, as one delta."""
        return convert.text_delta_from_pb(self._stub.Generate(convert.generate_request_to_pb(request),
                                                              timeout=timeout, metadata=self._metadata))

    def generate_stream(self, request: GenerateRequest, timeout: float) -> Iterator[TextDelta]:
        for message in self._stub.GenerateStream(convert.generate_request_to_pb(request), timeout=timeout,
                                                 metadata=self._metadata):
            yield convert.text_delta_from_pb(message)


class GatewayAdminClient:
    """`baton status`'s view: blocking, one call; `api_key` goes with it."""

    def __init__(self, channel: grpc.Channel, api_key: str | None = None) -> None:
        self._stub = admin_pb2_grpc.GatewayAdminStub(channel)
        self._metadata = bearer_metadata(api_key)

    def get_deployment_status(self, timeout: float, latest_requests: int = 0) -> DeploymentStatus:
        """The deployment now; its latency over the gateway's latest `latest_requests` (0: all it keeps)."""
        response = self._stub.GetDeploymentStatus(stats_convert.deployment_status_request(latest_requests),
                                                  timeout=timeout, metadata=self._metadata)
        return stats_convert.deployment_status_from_pb(response)
