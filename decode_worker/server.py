"""The decode worker's gRPC service: continuous batching over a paged cache. A request
arrives with a KV handle (its prompt prefilled elsewhere) and joins the batch once its
KV is pulled (kv_receiver.py), or without one (colocated mode) and is prefilled here,
chunked and mixed with decodes."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import replace

import grpc

from baton.runtime import latency, tracing
from baton.runtime.addresses import split_address
from baton.runtime.settings import DecodeWorkerSettings
from baton.runtime.tasks import BackgroundTasks
from baton.runtime.worker import WorkerBase, abort_refused, call_deadline, serve_worker
from baton.wire import convert
from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.wire.records import DecodeRequest, FieldError, KvHandle, ReleaseKv, TokenEvent
from decode_worker.kv_receiver import KvReceiver, ReceiveResult
from engine.async_engine import EngineDeadError
from engine.outputs import KvReceive, RequestOutput
from kvtransfer import KvLayoutMismatchError, KvTransferError
from kvtransfer.endpoint import receiver_shares_cache
from kvtransfer.ipc_memory import export_cache

logger = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]

# How many prompts' first blocks _lands remembers.
RECENT_PROMPTS = 4096
# A stream pauses between its messages (--max-stream-messages-per-s) only if for longer than this.
MIN_STREAM_PAUSE_S = 0.001


class DecodeWorkerService(WorkerBase, worker_pb2_grpc.DecodeWorkerServicer):
    """gRPC DecodeWorker over a continuous-batching engine."""

    def __init__(self, settings: DecodeWorkerSettings) -> None:
        super().__init__(settings)
        self.receiver: KvReceiver | None = None
        # Requests admitted with a handle, until their Decode call ends.
        self._handles: dict[str, KvHandle] = {}
        self._spans: dict[str, object] = {}  # traced requests' decode spans, for their kv_transfer
        self._pull_moments: dict[str, dict[str, int]] = {}  # a pull's moments, for its request's last event
        self._pulls: dict[str, asyncio.Task] = {}  # KV pulls under way, cancelled if their call ends
        self._fence_ids = itertools.count()
        self._background = BackgroundTasks()
        # The first blocks of the prompts served lately, to guess which the prefix cache holds (_lands).
        self._recent_prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()

    async def load(self, address: str) -> None:
        await super().load(address)
        self.receiver = KvReceiver(
            self.worker_id,
            self.llm_engine.kv_cache,
            self.layout,
            self.kv_endpoint,
            host=self.settings.transfer_host or split_address(address)[0],
            ports=self.settings.kv_ports,
            timeout_s=self.settings.transfer_timeout_s,
            verify=self.settings.verify_kv,
            tally=self.transfers,
            tls=self.settings.tls,
        )
        await self._share_cache()
        # Handed-off requests land in blocks set aside while a step runs (engine/kv/landing.py):
        # as many as one step's worth of prompt tokens.
        num_tokens = self.llm_engine.config.scheduler.max_num_batched_tokens
        await self.engine.call(lambda llm: llm.scheduler.landing.open(num_tokens))
        allowlist = self.settings.prefill_allowlist
        await allowlist.refresh(force=True)
        if allowlist.is_closed:
            logger.warning("decode worker %s pulls KV from no prefill worker (--allowed-prefill-workers unset): it "
                           "prefills handed-off prompts itself; name the prefill workers to take their KV",
                           self.worker_id)
        else:
            logger.info("decode worker %s pulls KV from %s", self.worker_id,
                        "any address a handle names (--allowed-prefill-workers '*')" if allowlist.is_open
                        else ", ".join(target.text for target in allowlist.targets.targets))

    async def _share_cache(self) -> None:
        """Export the KV cache for ipc channels (kvtransfer/ipc_memory.py) now, as the engine
        thread's first command: nothing has stepped yet, and a request added meanwhile is
        queued behind it, so no channel is offered before it is done. A CUDA export replaces
        the cache storage's data pointer, so it must never run on the event loop while the
        engine thread steps; every channel offered later reuses it."""
        if not receiver_shares_cache(self.settings.kv_transport):
            return
        try:
            await self.engine.call(lambda llm: export_cache(llm.kv_cache))
        except KvTransferError as error:  # each ipc channel then fails with it, its prompt prefilled here
            logger.error("decode worker %s cannot share its KV cache with prefill workers on this host: %s",
                         self.worker_id, error)

    async def stop(self) -> None:
        await super().stop()
        if self.receiver is not None:
            await self.receiver.close()

    def extra_stats(self) -> dict:
        return self.receiver.counters()

    # ------------------------------------------------------------------ decode
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        span = self._start_span("decode", context, request.request.request_id, {
            "gen_ai.usage.input_tokens": len(request.request.prompt_token_ids),
            "baton.kv.handoff": request.HasField("kv_handle"),
        })
        async for event in tracing.stream_in_span(span, context, self._decode(request, context, span)):
            yield convert.token_event_to_pb(event)

    async def _decode(self, message: worker_pb2.DecodeRequest, context, span):
        received_at = time.monotonic()
        deadline = call_deadline(context)
        engine = await self._require_engine(context)
        request_id = message.request.request_id
        # Released by _forget, whichever way the call ends.
        await self.accept_call(context, request_id, len(message.request.prompt_token_ids), message.request.attempt)
        traced = tracing.recording(span)
        try:
            request = convert.decode_request_from_pb(message)
            work = request.request
            if traced:
                span.set_attributes(tracing.request_attributes(
                    self.model_info.model, work.params, operation="text_completion"))
            stream = await self._admit(request, span, traced, deadline)
        except KvLayoutMismatchError as error:
            self._forget(request_id)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:  # read or refused by the engine (InvalidRequestError names the field)
            self._forget(request_id)
            await abort_refused(context, error)
        except EngineDeadError:
            self._forget(request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine failed")
        except BaseException:  # cancelled while it was being added: the engine aborts it (AsyncEngine._add)
            self._forget(request_id)
            raise

        finished = timed = False
        handed_off = message.HasField("kv_handle")
        rate = min(self.settings.max_stream_messages_per_s, request.max_messages_per_s or math.inf)
        try:
            async for output in stream:
                self.admission.started(request_id)  # prefilled or received: no longer queued
                tracing.add_events(span, output.events)
                if output.finished:
                    finished = True
                    self._observe(output, span)
                    if traced:
                        tracing.set_finish(span, output.finish_reason, output.num_output_tokens)
                if output.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
                moments = {}
                timings = output.decode_timings or (output.timings if output.finished else None)
                if timings is not None and not timed:  # with its second token (or its last, if none)
                    timed = True
                    moments = self._moments(request_id, timings, received_at if handed_off else None)
                yield _token_event(output, moments)
                if not output.finished:
                    # Past the worker's message rate, the steps' outputs gather meanwhile and
                    # the next get takes them as one (RequestStream.get).
                    pause = self.engine.num_streams / rate
                    if pause > MIN_STREAM_PAUSE_S:
                        await asyncio.sleep(pause)
        except EngineDeadError:  # the gateway moves the request to another worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine failed")
        finally:
            self._forget(request_id)
            if not finished:
                # Client gone (cancel, deadline, gateway loss) or shutdown: free it here now.
                await engine.abort(request_id)

    async def _admit(self, request: DecodeRequest, span, traced: bool, deadline: float | None):
        """Queue the request in the engine (a handed-off one is pulled once admitted), its
        call's `deadline` ordering it among the waiting."""
        work, handle = request.request, request.kv_handle
        land = self._lands(work.prompt_token_ids)
        if handle is None:
            return await self.engine.add_request(work.request_id, work.prompt_token_ids, work.params,
                                                 priority=work.priority, deadline=deadline, trace=traced,
                                                 num_generated_tokens=work.num_generated_tokens)
        handle = await self._check_prefill_worker(handle)
        handle.layout.check_matches(self.layout)
        self._handles[work.request_id] = handle
        if span is not None:
            self._spans[work.request_id] = span
        return await self.engine.add_prefilled_request(work.request_id, work.prompt_token_ids,
                                                       request.first_token_id, work.params,
                                                       priority=work.priority, deadline=deadline, trace=traced,
                                                       num_generated_tokens=work.num_generated_tokens, land=land)

    def _lands(self, prompt_token_ids: list[int]) -> bool:
        """Whether a handed-off prompt may take blocks set aside (engine/kv/landing.py), which it
        fills whole, rather than wait for admission, which starts its table with the blocks the
        prefix cache holds and pulls only the rest: not when a prompt served lately began with
        the same block (it may be cached here). Every prompt served is remembered."""
        kv = self.llm_engine.kv_manager
        first = tuple(prompt_token_ids[:kv.block_size])
        if not kv.enable_prefix_caching or len(first) < kv.block_size:
            return True
        recent = self._recent_prompts
        seen = first in recent
        recent[first] = None
        recent.move_to_end(first)
        if len(recent) > RECENT_PROMPTS:
            recent.popitem(last=False)
        return not seen

    async def _check_prefill_worker(self, handle: KvHandle) -> KvHandle:
        """The handle, to be pulled from its listed address; FieldError if its prefill worker
        is not one of --allowed-prefill-workers, so that a forged handle cannot make this worker
        dial an address of the caller's choosing. A list with DNS names is looked up again
        (at most once a second) before a handle is refused: a prefill pod that just started
        is not in the last lookup. With none listed, no address is dialled: the handle's
        address is cleared, its pull refused (KvReceiver), its prompt prefilled here."""
        allowlist = self.settings.prefill_allowlist
        if allowlist.is_closed:
            return replace(handle, prefill_address="")
        address = allowlist.dial_address(handle.prefill_address)
        if address is None and allowlist.is_dynamic:
            await allowlist.refresh()
            address = allowlist.dial_address(handle.prefill_address)
        if address is None:  # forged, or --allowed-prefill-workers misses what a prefill worker advertises
            logger.warning("refused a KV handle naming prefill worker %r: not in --allowed-prefill-workers",
                           handle.prefill_address[:200])
            raise FieldError("kv_handle.prefill_address",
                             "the KV handle's prefill worker is not one of this decode worker's --allowed-prefill-workers")
        return replace(handle, prefill_address=address)

    def _moments(self, request_id: str, timings, received_at: float | None) -> dict[str, int]:
        """Where a request's time went here (baton/runtime/latency.py): a handed-off one's
        call's arrival and pull; its engine's moments."""
        moments = self._pull_moments.pop(request_id, {})
        moments.update(latency.engine_moments(timings, handed_off=received_at is not None))
        return latency.stamp(moments, **{latency.DECODE_RECEIVED: received_at})

    def _forget(self, request_id: str) -> None:
        """Its call ended: its pull, if any, is cancelled (its peer may never answer: the
        blocks are freed now, not after its timeouts)."""
        self.admission.release(request_id)
        self._handles.pop(request_id, None)
        self._spans.pop(request_id, None)
        self._pull_moments.pop(request_id, None)
        pull = self._pulls.get(request_id)
        if pull is not None:
            pull.cancel()

    # -------------------------------------------------------------- KV receive
    def _on_kv_receive(self, receive: KvReceive) -> None:
        """The engine admitted a handed-off request and allocated its blocks (or it claimed
        blocks set aside): pull its KV."""
        self._background.spawn(self._pull(receive))

    async def _pull(self, receive: KvReceive) -> None:
        request_id = receive.request_id
        # Cancellable from here on (_forget): a task cancelled before it ran would never
        # complete the receive, and its blocks would stay RECEIVING.
        self._pulls[request_id] = asyncio.current_task()
        handle = self._handles.get(request_id)
        if handle is None:  # the Decode call already ended; the engine aborts it when told
            self._end_pull(request_id)
            self.transfers.failed("")
            result = ReceiveResult(ok=False, error="request gone")
        else:
            try:
                result = await self._receive(handle, receive)
            except asyncio.CancelledError:  # its Decode call ended
                result = ReceiveResult(ok=False, error="the Decode call ended")
            except Exception as error:  # noqa: BLE001 - the request must leave RECEIVING whatever happened
                logger.exception("KV pull of %s failed unexpectedly", request_id)
                result = ReceiveResult(ok=False, error=f"{type(error).__name__}: {error}")
            finally:
                self._end_pull(request_id)
            if result.ok and request_id in self._handles:
                self._pull_moments[request_id] = latency.stamp({}, **result.moments)
        # NOTE: the engine keeps the blocks of a request aborted meanwhile until this call,
        # so the receive above never writes into blocks that belong to someone else; blocks
        # a sender may still be writing into stay under a fence until it no longer can.
        fence_id = None if result.settled is None else f"{request_id}#fence-{next(self._fence_ids)}"
        ticket = receive.ticket
        completed = await self.engine.call(lambda llm: llm.complete_kv_receive(request_id, result.ok, fence_id, ticket))
        if fence_id is not None:
            self._background.spawn(self._release_fence(fence_id, result.settled))
        if ticket is not None and not completed:  # its add may have been refused: its blocks fenced
            self._background.spawn(self._release_fence(ticket, result.settled))
        if handle is not None and not result.ok:
            # Tell the prefill worker to drop its lease if the send never happened.
            self._background.spawn(self._release_remote(handle))

    async def _release_fence(self, fence_id: str, settled: asyncio.Future | None) -> None:
        """Free a fence's blocks once its transfer's sender no longer writes (`settled`;
        None: it never will)."""
        if settled is not None:
            await settled
        freed = await self.engine.call(lambda llm: llm.release_fence(fence_id))
        if freed:
            logger.info("no KV transfer writes into the blocks of %s any more: %d back in use", fence_id, freed)

    def _end_pull(self, request_id: str) -> None:
        if self._pulls.get(request_id) is asyncio.current_task():  # not a later request's, same id
            del self._pulls[request_id]

    async def _receive(self, handle: KvHandle, receive: KvReceive) -> ReceiveResult:
        """The pull itself, in a `kv_transfer` span under the request's decode span when traced.
        Blocks our prefix cache holds already are not pulled; when it holds them all, nothing
        is, and the prefill worker is told to drop its lease."""
        reused = receive.num_reused_blocks
        block_ids = receive.block_ids[reused:]
        parent = self._spans.get(receive.request_id)
        if not block_ids and reused == handle.num_blocks:
            self._background.spawn(self._release_remote(handle))
            if parent is not None:
                parent.add_event("kv_reused", {"baton.kv.reused_blocks": reused})
            now = time.monotonic()  # nothing to pull: no wait, no copy
            return ReceiveResult(ok=True, moments=dict.fromkeys((latency.RECEIVE_STARTED, latency.CHANNEL_READY,
                                                                 latency.COPIED, latency.KV_RECEIVED), now))
        if parent is None:
            return await self.receiver.receive(handle, block_ids, first_block=reused)
        span = tracing.start_span("kv_transfer", parent, tracing.CLIENT, {
            "baton.request_id": receive.request_id,
            "baton.kv.direction": "receive",
            "baton.kv.peer": handle.prefill_address,
            "baton.kv.reused_blocks": reused,
        })
        result = None
        try:
            result = await self.receiver.receive(handle, block_ids, tracing.metadata(span), first_block=reused)
        finally:
            if result is None:  # cancelled (shutdown)
                tracing.end_span(span, grpc.StatusCode.CANCELLED, "the pull was cancelled")
            elif result.ok:
                span.set_attributes(tracing.transfer_attributes(
                    num_blocks=len(block_ids), num_bytes=result.num_bytes, seconds=result.seconds,
                    verified=result.verified, transport=result.transport,
                ))
                # Its waits and copy (kv_channel, kv_copy, kv_checksum: baton/runtime/latency.py).
                span.set_attributes({f"baton.kv.{name}_s": seconds for name, seconds
                                     in latency.phases(latency.stamp({}, **result.moments)).items()})
                tracing.end_span(span)
            else:
                if result.transport:
                    span.set_attribute("baton.kv.transport", result.transport)
                tracing.end_span(span, grpc.StatusCode.UNAVAILABLE, result.error)
        return result

    async def _release_remote(self, handle: KvHandle) -> None:
        try:
            await self.receiver.client_for(handle.prefill_address).release_kv(
                ReleaseKv(handle.request_id, handle.kv_token), timeout=5)
        except grpc.aio.AioRpcError as error:
            logger.info("release of %s on %s failed: %s", handle.request_id, handle.prefill_address,
                        error.code().name)


def _token_event(output: RequestOutput, moments: dict[str, int]) -> TokenEvent:
    return TokenEvent(
        token_ids=output.new_token_ids,
        logprobs=output.new_logprobs or [],
        finish_reason=output.finish_reason if output.finished else None,
        stop_token_id=output.stop_reason if isinstance(output.stop_reason, int) else None,
        # With its usage, on the last event: set when the prompt was prefilled here.
        num_cached_tokens=output.num_cached_tokens if output.finished else None,
        num_host_cached_tokens=output.num_host_cached_tokens,
        prompt_logprobs=output.prompt_logprobs,  # on its first output, when asked
        moments=moments,
    )


def serve(settings: DecodeWorkerSettings) -> int:
    """Run a decode worker in this process until SIGTERM; the exit code."""
    service = DecodeWorkerService(settings)
    return serve_worker(settings, service, SERVICE)
