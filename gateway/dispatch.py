"""Running one prepared request on the workers, as a stream of token events.

Disaggregated:

    Prefill(prompt) on a prefill worker  ->  first token + KV handle
        the first token goes to the client at once (TTFT does not wait for the handoff)
    Decode(prompt, first token, handle) on a decode worker  ->  one event per step
        (the decode worker pulls the KV from the prefill worker itself)

Colocated (no prefill worker up, or the routing policy keeps the prompt local):
Decode(prompt) alone, and the decode worker prefills it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from baton.runtime import tracing
from baton.runtime.tasks import BackgroundTasks
from baton.wire.records import DecodeRequest, PrefillResult, ReleaseKv, TokenEvent, WorkRequest
from gateway.errors import RequestError
from gateway.prepare import PreparedRequest
from gateway.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0


class Dispatcher:
    """Routes each request to its workers and streams back what they generate."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._background = BackgroundTasks()

    async def run(self, prepared: PreparedRequest,
                  time_remaining: Callable[[], float | None]) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they are produced; `time_remaining()` is the caller's
        deadline, passed on to each worker call. Closing the stream aborts the request
        on its workers."""
        work = prepared.work()
        num_prompt = len(work.prompt_token_ids)
        decode = self.pool.pick_decode(num_prompt + 1)
        if decode is None:
            await self.pool.refresh_decode()
            decode = self.pool.pick_decode(num_prompt + 1)
        if decode is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker is serving")
        prefill = self.pool.pick_prefill(num_prompt, decode)
        span = prepared.span
        trace_metadata = tracing.metadata(span)
        if tracing.recording(span):
            tracing.set_route(span, decode.address, prefill.address if prefill is not None else None)
        request = DecodeRequest(work)
        if prefill is not None:
            try:
                result = await self._prefill(prefill, decode, work, time_remaining, trace_metadata)
            except asyncio.CancelledError:
                # The worker may have held the KV just as the call was cancelled, and its
                # answer is lost: drop the lease now, not at expiry.
                self._background.spawn(self._release(prefill, work, trace_metadata))
                raise
            if result is None and tracing.recording(span):
                tracing.set_route(span, decode.address, None)  # the prefill worker was unreachable
            if result is not None:
                first = TokenEvent(
                    [result.first_token_id],
                    [result.first_logprob] if result.first_logprob is not None else [],
                    result.finish_reason,
                    stop_token_id=result.first_token_id if result.finish_reason == "stop" else None,
                )
                try:
                    yield first  # TTFT does not wait for the handoff
                except BaseException:  # closed at the first token (client gone, stop string)
                    if result.kv_handle is not None:
                        self._background.spawn(self._release(prefill, work, trace_metadata))
                    raise
                if result.finish_reason is not None:
                    return
                request = DecodeRequest(work, result.first_token_id, result.kv_handle)
        holder = prefill if request.kv_handle is not None else None
        async for event in self._decode(decode, request, holder, time_remaining, trace_metadata):
            yield event

    async def _prefill(self, worker: Worker, decode: Worker, work: WorkRequest,
                       time_remaining: Callable[[], float | None], trace_metadata) -> PrefillResult | None:
        """Prefill on `worker`; None if it is unreachable (the caller then runs colocated)."""
        worker.num_in_flight += 1
        try:
            return await worker.client.prefill(work, timeout=time_remaining(), metadata=trace_metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                logger.warning("prefill worker %s unavailable; running %s colocated", worker.address,
                               work.request_id)
                self.pool.mark_down(worker)
                self.pool.prefill_moved(worker, decode, len(work.prompt_token_ids))
                return None
            raise RequestError(error.code(), error.details() or "prefill failed") from None
        except ValueError as error:  # a KV handle no cache could have: a worker of another release
            self._background.spawn(self._release(worker, work, trace_metadata))
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"prefill worker {worker.address} sent an unusable KV handle: {error}") from None
        finally:
            worker.num_in_flight -= 1

    async def _decode(self, worker: Worker, request: DecodeRequest, holder: Worker | None,
                      time_remaining: Callable[[], float | None], trace_metadata) -> AsyncIterator[TokenEvent]:
        """Stream the decode worker's events; `holder` is the prefill worker holding the
        request's KV, if it was handed off."""
        events = worker.client.decode(request, timeout=time_remaining(), metadata=trace_metadata)
        worker.num_in_flight += 1
        got_event = False
        try:
            async for event in events:
                got_event = True
                yield event
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(worker)
            raise RequestError(code, error.details() or "decode failed") from None
        finally:
            worker.num_in_flight -= 1
            await events.aclose()  # the client went away or a stop string matched: abort on the worker
            if holder is not None and not got_event:
                # The decode side may never have pulled the KV: drop the lease now, not at expiry.
                self._background.spawn(self._release(holder, request.request, trace_metadata))

    async def _release(self, prefill: Worker, work: WorkRequest, trace_metadata) -> None:
        """Drop the KV `prefill` holds for a request that will not pull it (best effort: the
        lease expires anyway); its kv_token proves the KV is ours."""
        try:
            await prefill.client.release_kv(ReleaseKv(work.request_id, work.kv_token), timeout=RELEASE_TIMEOUT_S,
                                            metadata=trace_metadata)
        except grpc.aio.AioRpcError:
            pass
