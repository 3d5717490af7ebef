"""The prefill worker's gRPC service: chunked prefill under a token budget, the first
token, and the prompt's KV held for a decode worker to pull (kv_sender.py)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from baton.runtime import latency, tracing
from baton.runtime.settings import PrefillWorkerSettings
from baton.runtime.worker import WorkerBase, abort_invalid, abort_refused, call_deadline, serve_worker
from baton.wire import convert, kv_convert
from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.wire.records import KvHandle, PrefillResult, SendKvDone, WorkRequest
from engine.async_engine import EngineDeadError
from kvtransfer import KvLayoutMismatchError, KvTransferError, ReleasedBeforeHeld, TransportRefusedError
from prefill_worker.kv_sender import (
    AlreadyClaimed,
    AlreadySending,
    BlockCountMismatch,
    ChannelInUse,
    KvSender,
    NoChannel,
    NotHeld,
    SendRefused,
)

logger = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
# Why a send was refused, as the status its caller gets.
_REFUSALS = {
    NoChannel: grpc.StatusCode.FAILED_PRECONDITION,
    NotHeld: grpc.StatusCode.NOT_FOUND,
    AlreadySending: grpc.StatusCode.FAILED_PRECONDITION,
    BlockCountMismatch: grpc.StatusCode.INVALID_ARGUMENT,
}


class PrefillWorkerService(WorkerBase, worker_pb2_grpc.PrefillWorkerServicer):
    """gRPC PrefillWorker over an engine whose requests are all prefill_only."""

    def __init__(self, settings: PrefillWorkerSettings) -> None:
        super().__init__(settings)
        self.sender: KvSender | None = None  # set by load

    async def load(self, address: str) -> None:
        await super().load(address)
        self.sender = KvSender(self.worker_id, self.engine, self.llm_engine.kv_cache, self.layout, self.kv_endpoint,
                               self.settings.lease_s, self.transfers)
        self.sender.start()

    async def stop(self) -> None:
        if self.sender is not None:
            await self.sender.close()
        await super().stop()

    def extra_stats(self) -> dict:
        return self.sender.counters()

    def num_in_flight(self) -> int:
        return super().num_in_flight() + (self.sender.leases.num_held if self.sender is not None else 0)

    # ----------------------------------------------------------------- prefill
    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        span = self._start_span("prefill", context, request.request.request_id,
                                {"gen_ai.usage.input_tokens": len(request.request.prompt_token_ids)})
        return await tracing.call_in_span(span, context, self._prefill(request, context, span))

    async def _prefill(self, request: worker_pb2.PrefillRequest, context, span) -> worker_pb2.PrefillResponse:
        deadline = call_deadline(context)
        engine = await self._require_engine(context)
        request_id = request.request.request_id
        await self.accept_call(context, request_id, len(request.request.prompt_token_ids), request.request.attempt)
        try:  # its prompt is queued here until the call ends, at its first token
            return await self._prefill_admitted(engine, request, context, span, deadline)
        finally:
            self.admission.release(request_id)

    async def _prefill_admitted(self, engine, request: worker_pb2.PrefillRequest, context, span,
                                deadline: float | None) -> worker_pb2.PrefillResponse:
        try:
            work = convert.prefill_request_from_pb(request)
            self.sender.claim(work.request_id, work.kv_token)
        except AlreadyClaimed as error:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        except ValueError as error:
            await abort_invalid(context, error)
        result = None
        try:
            result = await self._run(engine, work, context, span, deadline)
            return convert.prefill_result_to_pb(result)
        finally:
            if result is None or result.kv_handle is None:  # nothing held: the token owns nothing
                self.sender.disown(work.request_id)

    async def _run(self, engine, work: WorkRequest, context, span, deadline: float | None) -> PrefillResult:
        """The prefill, to its first token (and its KV held, unless that token ended it,
        until the lease or the call's `deadline` ends, whichever comes first)."""
        try:
            stream = await engine.add_request(work.request_id, work.prompt_token_ids, work.params,
                                              priority=work.priority, deadline=deadline, prefill_only=True,
                                              num_generated_tokens=work.num_generated_tokens,
                                              trace=tracing.recording(span))
        except ValueError as error:  # the engine refused it (InvalidRequestError names the field)
            await abort_refused(context, error)
        except EngineDeadError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine failed")
        try:
            output = await stream.get()
        except EngineDeadError:  # the gateway prefills elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine failed")
        except asyncio.CancelledError:
            # The gateway gave up (client cancel, deadline): nothing may stay behind.
            await engine.abort(work.request_id)
            raise
        tracing.add_events(span, output.events)
        self._observe(output, span)
        if output.finish_reason == "abort":
            await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        try:
            return self._result(work, output, span, deadline)
        except ReleasedBeforeHeld:  # its gateway let it go while it was prefilled: nothing waits a lease out
            await engine.call(lambda llm: llm.release_kv(work.request_id))
            await context.abort(grpc.StatusCode.CANCELLED, "its KV was released while it was prefilled")

    def _result(self, work: WorkRequest, output, span, deadline: float | None) -> PrefillResult:
        first_logprob = output.new_logprobs[0] if output.new_logprobs else None
        if tracing.recording(span):
            tracing.set_prefill_result(span, output)
        moments = latency.engine_moments(output.timings)
        if output.finished:  # the first token ended it: nothing is held
            return PrefillResult(output.new_token_ids[0], first_logprob, output.finish_reason,
                                 num_cached_tokens=output.num_cached_tokens or 0,
                                 num_host_cached_tokens=output.num_host_cached_tokens,
                                 prompt_logprobs=output.prompt_logprobs, moments=moments)
        # NOTE: the decode call shares the request's deadline: KV nobody pulled by then never will be.
        lease_s = self.sender.hold(work.request_id, output.kv_block_ids, output.num_prompt_tokens, deadline)
        handle = KvHandle(
            prefill_worker_id=self.worker_id,
            prefill_address=self.address,
            request_id=work.request_id,
            num_tokens=output.num_prompt_tokens,
            num_blocks=len(output.kv_block_ids),
            layout=self.layout,
            lease_s=lease_s,
            kv_token=work.kv_token,
            prefill_endpoint=self.kv_endpoint,
        )
        return PrefillResult(output.new_token_ids[0], first_logprob, kv_handle=handle,
                             num_cached_tokens=output.num_cached_tokens or 0,
                             num_host_cached_tokens=output.num_host_cached_tokens,
                             prompt_logprobs=output.prompt_logprobs, moments=moments)

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest, context) -> worker_pb2.ReleaseKvResponse:
        await self._require_engine(context)
        return kv_convert.released_to_pb(await self.sender.release(kv_convert.release_kv_from_pb(request)))

    # -------------------------------------------------------------- KV handoff
    async def OpenKvChannel(self, request: worker_pb2.OpenKvChannelRequest, context):
        await self._require_engine(context)
        try:
            opened = await self.sender.open_channel(
                kv_convert.open_kv_channel_from_pb(request, self.settings.transfer_timeout_s))
        except (KvLayoutMismatchError, TransportRefusedError) as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ChannelInUse as error:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        except ValueError as error:  # a malformed rendezvous (after the layout: a subclass)
            await abort_invalid(context, error)
        except KvTransferError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV channel rendezvous failed: {error}")
        return kv_convert.kv_channel_opened_to_pb(opened)

    async def SendKv(self, request: worker_pb2.SendKvRequest, context):
        span = self._start_span("kv_transfer", context, request.request_id,
                                {"baton.kv.direction": "send", "baton.kv.channel": request.channel_id})
        async for event in tracing.stream_in_span(span, context, self._send_kv(request, context, span)):
            yield event

    async def _send_kv(self, request: worker_pb2.SendKvRequest, context, span):
        await self._require_engine(context)
        send = kv_convert.send_kv_from_pb(request)
        events = self.sender.send(send)
        try:
            async for event in events:
                if isinstance(event, SendKvDone) and tracing.recording(span):
                    # The sender computes checksums; the receiver compares them (its span says verified).
                    span.set_attributes(tracing.transfer_attributes(
                        num_blocks=len(send.block_ids), num_bytes=event.num_bytes, seconds=event.seconds))
                    span.set_attributes({"baton.kv.checksummed": send.verify,
                                         "baton.kv.transport": self.sender.backend(send.channel_id)})
                yield kv_convert.send_kv_event_to_pb(event)
        except SendRefused as refusal:
            await context.abort(_REFUSALS[type(refusal)], str(refusal))
        except KvTransferError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV send failed: {error}")
        finally:
            await events.aclose()


def serve(settings: PrefillWorkerSettings) -> int:
    """Run a prefill worker in this process until SIGTERM; the exit code."""
    service = PrefillWorkerService(settings)
    return serve_worker(settings, service, SERVICE)
