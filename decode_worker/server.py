"""The decode worker: continuous batching over a paged cache. A request arrives with a KV
handle (its prompt prefilled elsewhere) and joins the batch once its KV is pulled, or
without one (colocated mode) and is prefilled here, chunked and mixed with decodes."""

from __future__ import annotations

import asyncio
import logging

import grpc

from baton.runtime import tracing
from baton.wire.convert import finish_reason_to_pb, logprobs_to_pb, sampling_params_from_pb
from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.runtime.worker import WorkerBase, WorkerSettings, kv_layout_spec, layout_from_pb, run_worker
from decode_worker.kv_receiver import KvReceiver, ReceiveResult
from engine.outputs import KvReceive
from kvtransfer import KvLayoutMismatchError

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class DecodeWorkerService(WorkerBase, worker_pb2_grpc.DecodeWorkerServicer):
    """gRPC DecodeWorker over a continuous-batching engine."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.receiver: KvReceiver | None = None
        # Requests admitted with a handle: the handle, and the future their pull resolves.
        self._handles: dict[str, worker_pb2.KvHandle] = {}
        self._pulls: dict[str, asyncio.Future[ReceiveResult]] = {}
        self._spans: dict[str, object] = {}  # traced requests' decode spans, for their kv_transfer
        self._tasks: set[asyncio.Task] = set()

    async def load(self, address: str) -> None:
        await super().load(address)
        self.layout = kv_layout_spec(self.llm)
        self.receiver = KvReceiver(
            self.worker_id,
            self.llm.kv_cache,
            self.layout,
            host=self.settings.transfer_host,
            timeout_s=self.settings.transfer_timeout_s,
            verify=self.settings.verify_kv,
        )

    async def stop(self) -> None:
        await super().stop()
        if self.receiver is not None:
            await self.receiver.close()

    def extra_stats(self) -> dict:
        receiver = self.receiver
        return dict(
            num_transfers=receiver.num_transfers,
            num_transfer_failures=receiver.num_transfer_failures,
            num_transfers_verified=receiver.num_transfers_verified,
            num_transferred_bytes=receiver.num_transferred_bytes,
            transfer_seconds=receiver.transfer_seconds,
        )

    # ------------------------------------------------------------------ decode
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        work = request.request
        span = self._start_span("decode", context, work.request_id, {
            "gen_ai.usage.input_tokens": len(work.prompt_token_ids),
            "baton.kv.handoff": request.HasField("kv_handle"),
        })
        async for event in tracing.stream_in_span(span, context, self._decode(request, context, span)):
            yield event

    async def _decode(self, request: worker_pb2.DecodeRequest, context, span):
        engine = await self._require_engine(context)
        work = request.request
        request_id = work.request_id
        prompt = list(work.prompt_token_ids)
        has_handle = request.HasField("kv_handle")
        traced = tracing.recording(span)
        try:
            params = sampling_params_from_pb(work.sampling, with_stop_strings=False)
            if traced:
                span.set_attributes(tracing.request_attributes(
                    self._model_info.model, params, operation="text_completion"))
            if has_handle:
                if not request.HasField("first_token_id"):
                    raise ValueError("a KV handle needs first_token_id")
                layout_from_pb(request.kv_handle.layout).check_matches(self.layout)
                if request.kv_handle.num_tokens != len(prompt):
                    raise ValueError(
                        f"KV handle covers {request.kv_handle.num_tokens} tokens; "
                        f"the prompt has {len(prompt)}"
                    )
                self._handles[request_id] = request.kv_handle
                self._pulls[request_id] = asyncio.get_running_loop().create_future()
                if span is not None:
                    self._spans[request_id] = span
                stream = await engine.add_prefilled_request(
                    request_id, prompt, request.first_token_id, params, priority=work.priority, trace=traced
                )
            else:
                stream = await engine.add_request(request_id, prompt, params, priority=work.priority, trace=traced)
        except KvLayoutMismatchError as error:
            self._forget(request_id)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            self._forget(request_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

        finished = False
        try:
            transfer = None
            if has_handle:
                result = await self._pulls[request_id]
                transfer = worker_pb2.TransferReport(
                    ok=result.ok,
                    verified=result.verified,
                    num_bytes=result.num_bytes,
                    seconds=result.seconds,
                    error=result.error,
                )
            async for output in stream:
                if output.events is not None:
                    tracing.add_events(span, output.events)
                if output.finished:
                    self._observe(output, span)
                    if traced:
                        span.set_attributes({
                            "gen_ai.response.finish_reasons": [output.finish_reason],
                            "gen_ai.usage.output_tokens": output.num_output_tokens,
                        })
                if output.finish_reason == "abort":
                    finished = True
                    await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
                event = worker_pb2.DecodeEvent(
                    token_ids=output.new_token_ids,
                    logprobs=logprobs_to_pb(output.new_logprobs),
                    num_prompt_tokens=output.num_prompt_tokens,
                    num_output_tokens=output.num_output_tokens,
                )
                if transfer is not None:
                    event.transfer.CopyFrom(transfer)
                    transfer = None
                if output.finished:
                    finished = True
                    event.finish_reason = finish_reason_to_pb(output.finish_reason)
                    if isinstance(output.stop_reason, int):
                        event.stop_token_id = output.stop_reason
                yield event
        finally:
            self._forget(request_id)
            if not finished:
                # Client gone (cancel, deadline, gateway loss) or shutdown: free it here now.
                await engine.abort(request_id)

    def _forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        self._spans.pop(request_id, None)
        pull = self._pulls.pop(request_id, None)
        if pull is not None and not pull.done():
            pull.cancel()

    # -------------------------------------------------------------- KV receive
    def _on_kv_receive(self, receive: KvReceive) -> None:
        """The engine admitted a handed-off request and allocated its blocks: pull its KV."""
        self._spawn(self._pull(receive))

    def _spawn(self, coroutine) -> None:
        """Run `coroutine` as a task kept referenced until it ends (asyncio holds only a weak one)."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pull(self, receive: KvReceive) -> None:
        request_id = receive.request_id
        handle = self._handles.get(request_id)
        if handle is None:  # the Decode call already ended; the engine aborts it when told
            result = ReceiveResult(ok=False, error="request gone")
        else:
            result = await self._receive(handle, receive)
            if result.ok:
                self.metrics.record_transfer(result.num_bytes, result.seconds)
            else:
                self.metrics.transfer_failures.inc()
        # NOTE: the engine keeps the blocks of a request aborted meanwhile until this call,
        # so the receive above never writes into blocks that belong to someone else.
        await self.engine.call(lambda llm: llm.complete_kv_receive(request_id, result.ok))
        if handle is not None:
            # Tell the prefill worker to drop its lease if the send never happened.
            if not result.ok:
                self._spawn(self._release_remote(handle))
        pull = self._pulls.get(request_id)
        if pull is not None and not pull.done():
            pull.set_result(result)

    async def _receive(self, handle: worker_pb2.KvHandle, receive: KvReceive) -> ReceiveResult:
        """The pull itself, in a `kv_transfer` span under the request's decode span when traced."""
        parent = self._spans.get(receive.request_id)
        if parent is None:
            return await self.receiver.receive(handle, receive.block_ids)
        span = tracing.start_span("kv_transfer", parent, tracing.CLIENT, {
            "baton.request_id": receive.request_id,
            "baton.kv.direction": "receive",
            "baton.kv.peer": handle.prefill_address,
        })
        result = None
        try:
            result = await self.receiver.receive(handle, receive.block_ids, tracing.metadata(span))
        finally:
            if result is None:  # cancelled (shutdown)
                tracing.end_span(span, grpc.StatusCode.CANCELLED, "the pull was cancelled")
            elif result.ok:
                span.set_attributes(tracing.transfer_attributes(
                    num_blocks=len(receive.block_ids), num_bytes=result.num_bytes, seconds=result.seconds,
                    verified=result.verified,
                ))
                tracing.end_span(span)
            else:
                tracing.end_span(span, grpc.StatusCode.UNAVAILABLE, result.error)
        return result

    async def _release_remote(self, handle: worker_pb2.KvHandle) -> None:
        try:
            peer_stub = self.receiver.stub_for(handle.prefill_address)
            await peer_stub.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=handle.request_id), timeout=5)
        except grpc.aio.AioRpcError as error:
            logger.info("release of %s on %s failed: %s", handle.request_id, handle.prefill_address,
                        error.code().name)


def serve(settings: WorkerSettings) -> None:
    """Run a decode worker in this process until SIGTERM."""
    from baton.runtime.server import install_uvloop
    from baton.runtime.tracing import configure_tracing, shutdown_tracing

    install_uvloop()
    configure_tracing("decode-worker", settings.worker_id)
    service = DecodeWorkerService(settings)
    try:
        asyncio.run(
            run_worker(settings, service, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, SERVICE_NAME)
        )
    finally:
        shutdown_tracing()
