"""The prefill worker: chunked prefill under a token budget, first token, KV held under a
lease until a decode worker has pulled it over a kvtransfer channel."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from baton.runtime import tracing
from baton.wire.convert import finish_reason_to_pb, logprobs_to_pb, sampling_params_from_pb
from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.runtime.worker import WorkerBase, WorkerSettings, kv_layout_spec, layout_from_pb, layout_to_pb, run_worker
from kvtransfer import KvChannel, KvLayoutMismatchError, KvLeaseTable, KvTransferError, block_checksums

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
LEASE_SWEEP_S = 0.25


@dataclass
class _Channel:
    """An open channel to one decode worker; its transfers run one at a time on its thread."""

    channel: KvChannel
    executor: ThreadPoolExecutor
    decode_worker_id: str


class PrefillWorkerService(WorkerBase, worker_pb2_grpc.PrefillWorkerServicer):
    """gRPC PrefillWorker over an engine whose requests are all prefill_only."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.leases = KvLeaseTable()
        self.channels: dict[str, _Channel] = {}
        self._sweeper: asyncio.Task | None = None
        self.num_transfers = 0
        self.num_transfer_failures = 0
        self.num_transferred_bytes = 0
        self.transfer_seconds = 0.0
        self.num_leases_expired = 0

    async def load(self, address: str) -> None:
        await super().load(address)
        self.layout = kv_layout_spec(self.llm)
        self._sweeper = asyncio.create_task(self._sweep_leases())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for entry in self.channels.values():
            entry.executor.submit(entry.channel.close)
            entry.executor.shutdown(wait=False)
        self.channels.clear()
        await super().stop()

    def extra_stats(self) -> dict:
        return dict(
            num_transfers=self.num_transfers,
            num_transfer_failures=self.num_transfer_failures,
            num_transferred_bytes=self.num_transferred_bytes,
            transfer_seconds=self.transfer_seconds,
            num_leases_expired=self.num_leases_expired,
        )

    # ----------------------------------------------------------------- prefill
    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        work = request.request
        span = self._start_span("prefill", context, work.request_id,
                                {"gen_ai.usage.input_tokens": len(work.prompt_token_ids)})
        return await tracing.call_in_span(span, context, self._prefill(work, context, span))

    async def _prefill(self, work: worker_pb2.WorkRequest, context, span) -> worker_pb2.PrefillResponse:
        engine = await self._require_engine(context)
        try:
            params = sampling_params_from_pb(work.sampling, with_stop_strings=False)
            stream = await engine.add_request(
                work.request_id,
                list(work.prompt_token_ids),
                params,
                priority=work.priority,
                prefill_only=True,
                trace=tracing.recording(span),
            )
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = work.request_id
        try:
            output = await stream.get()
        except asyncio.CancelledError:
            # The gateway gave up (client cancel, deadline): nothing may stay behind.
            await engine.abort(request_id)
            raise
        tracing.add_events(span, output.events)
        self._observe(output, span)
        if output.finish_reason == "abort":
            await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        if tracing.recording(span):
            span.set_attributes({
                "baton.prefill.chunks": sum(name == "prefill_chunk" for _, name, _ in output.events or ()),
                "baton.first_token_id": output.new_token_ids[0],
                "baton.kv.blocks": len(output.kv_block_ids or ()),
            })
        response = worker_pb2.PrefillResponse(
            first_token_id=output.new_token_ids[0],
            finish_reason=finish_reason_to_pb(output.finish_reason if output.finished else None),
        )
        if output.new_logprobs:
            response.first_logprob.CopyFrom(logprobs_to_pb(output.new_logprobs)[0])
        if output.finished:
            return response
        lease_s = self.settings.lease_s
        self.leases.hold(request_id, output.kv_block_ids, output.num_prompt_tokens, lease_s)
        response.kv_handle.CopyFrom(
            worker_pb2.KvHandle(
                prefill_worker_id=self.worker_id,
                prefill_address=self.address,
                request_id=request_id,
                num_tokens=output.num_prompt_tokens,
                num_blocks=len(output.kv_block_ids),
                layout=layout_to_pb(self.layout),
                lease_ms=int(lease_s * 1000),
            )
        )
        return response

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest, context) -> worker_pb2.ReleaseKvResponse:
        engine = await self._require_engine(context)
        request_id = request.request_id
        if request_id not in self.leases:
            # Not held (yet): it may still be prefilling, so abort it there too.
            return worker_pb2.ReleaseKvResponse(released=await engine.abort(request_id))
        if self.leases.release(request_id):
            await engine.call(lambda llm: llm.release_kv(request_id))
        return worker_pb2.ReleaseKvResponse(released=True)

    async def _sweep_leases(self) -> None:
        """Free KV nobody pulled in time (a decode worker that vanished, a gateway that gave up)."""
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            expired = self.leases.expired(time.monotonic())
            if not expired:
                continue
            self.num_leases_expired += len(expired)
            logger.warning("KV lease expired for %d request(s): %s", len(expired), expired[:5])
            await self.engine.call(lambda llm: [llm.release_kv(rid) for rid in expired])

    # -------------------------------------------------------------- KV handoff
    async def OpenKvChannel(self, request: worker_pb2.OpenKvChannelRequest, context):
        await self._require_engine(context)
        try:
            self.layout.check_matches(layout_from_pb(request.layout))
        except KvLayoutMismatchError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        old = self.channels.pop(request.channel_id, None)
        if old is not None:  # the decode worker reopened it (e.g. after a failed transfer)
            old.executor.submit(old.channel.close)
            old.executor.shutdown(wait=False)
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-send-{request.channel_id}")
        device = self.llm.kv_cache.blocks.device
        loop = asyncio.get_running_loop()
        try:
            channel = await loop.run_in_executor(
                executor,
                lambda: KvChannel.connect(
                    channel_id=request.channel_id,
                    host=request.store_host,
                    port=request.store_port,
                    rank=0,
                    device=device,
                    timeout_s=request.timeout_seconds or self.settings.transfer_timeout_s,
                ),
            )
        except KvTransferError as error:
            executor.shutdown(wait=False)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV channel rendezvous failed: {error}")
        self.channels[request.channel_id] = _Channel(channel, executor, request.decode_worker_id)
        logger.info("opened KV channel %s to decode worker %s (%s)", request.channel_id,
                    request.decode_worker_id, channel.backend)
        return worker_pb2.OpenKvChannelResponse(prefill_worker_id=self.worker_id, backend=channel.backend)

    async def SendKv(self, request: worker_pb2.SendKvRequest, context):
        span = self._start_span("kv_transfer", context, request.request_id,
                                {"baton.kv.direction": "send", "baton.kv.channel": request.channel_id})
        async for event in tracing.stream_in_span(span, context, self._send_kv(request, context, span)):
            yield event

    async def _send_kv(self, request: worker_pb2.SendKvRequest, context, span):
        engine = await self._require_engine(context)
        entry = self.channels.get(request.channel_id)
        if entry is None or entry.channel.is_broken:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no open KV channel {request.channel_id!r}")
        request_id = request.request_id
        try:
            lease = self.leases.begin_send(request_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no KV held for {request_id!r} (released, sent or lease expired)")
        except ValueError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV of {request_id!r} is already being sent")
        block_ids = list(lease.block_ids)
        try:
            peer_block_ids = list(request.block_ids)
            if request.num_blocks != len(block_ids) or len(peer_block_ids) != len(block_ids):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"receiver allocated {request.num_blocks} blocks ({len(peer_block_ids)} ids given); "
                    f"{len(block_ids)} are held",
                )
            yield worker_pb2.SendKvEvent(
                accepted=worker_pb2.SendKvAccepted(num_blocks=len(block_ids), block_ids=block_ids)
            )
            loop = asyncio.get_running_loop()
            kv_cache = self.llm.kv_cache
            try:
                stats = await loop.run_in_executor(
                    entry.executor, entry.channel.send_blocks, kv_cache, block_ids, request.tag, peer_block_ids
                )
                checksums = []
                if request.verify:
                    checksums = await loop.run_in_executor(
                        entry.executor, block_checksums, kv_cache, block_ids
                    )
            except KvTransferError as error:
                self.num_transfer_failures += 1
                self.metrics.transfer_failures.inc()
                logger.warning("KV send of %s failed: %s", request_id, error)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV send failed: {error}")
            self.num_transfers += 1
            self.num_transferred_bytes += stats.num_bytes
            self.metrics.record_transfer(stats.num_bytes, stats.seconds)
            self.transfer_seconds += stats.seconds
            if tracing.recording(span):
                # The sender computes checksums; the receiver compares them (its span says verified).
                span.set_attributes(tracing.transfer_attributes(
                    num_blocks=len(block_ids), num_bytes=stats.num_bytes, seconds=stats.seconds,
                ))
                span.set_attributes({"baton.kv.checksummed": request.verify, "baton.kv.backend": entry.channel.backend})
            yield worker_pb2.SendKvEvent(
                done=worker_pb2.SendKvDone(
                    block_checksums=[c & 0xFFFF_FFFF_FFFF_FFFF for c in checksums],
                    num_bytes=stats.num_bytes,
                    seconds=stats.seconds,
                )
            )
        finally:
            # Sent or failed, the blocks are done with: the decode side has them or re-prefills.
            self.leases.end_send(request_id)
            await engine.call(lambda llm: llm.release_kv(request_id))


def serve(settings: WorkerSettings) -> None:
    """Run a prefill worker in this process until SIGTERM."""
    from baton.runtime.server import install_uvloop
    from baton.runtime.tracing import configure_tracing, shutdown_tracing

    install_uvloop()
    configure_tracing("prefill-worker", settings.worker_id)
    service = PrefillWorkerService(settings)
    try:
        asyncio.run(
            run_worker(settings, service, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, SERVICE_NAME)
        )
    finally:
        shutdown_tracing()
