"""Running one prepared request on the workers, as a stream of token events.

Disaggregated:

    Prefill(prompt) on a prefill worker  ->  first token + KV handle
        the first token goes to the client at once (TTFT does not wait for the handoff)
    Decode(prompt, first token, handle) on a decode worker  ->  one event per step
        (the decode worker pulls the KV from the prefill worker itself)

Colocated (no prefill worker up, or the routing policy keeps the prompt local):
Decode(prompt) alone, and the decode worker prefills it.

A request outlives its workers. When its decode worker is lost mid-stream (the
stream breaks: killed, or draining and letting it go; or no token comes within the
worker's stall timeout and the worker then fails a probe: frozen, or its engine
thread stuck), the request moves: a new attempt runs on another decode worker with
the prompt plus every token already streamed as its prompt (prefilled again on a
prefill worker or there), the limits counted down and, for a seeded request, the
generator's draws skipped (WorkRequest.continued). The client's stream goes on
with the next token, none lost or repeated. A prefill worker lost while it
prefills is given up the same way, and the prompt runs colocated. Moved work
carries its `attempt` (> 0), and no worker refuses it for its admission bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc

from baton.runtime import latency, tracing
from baton.runtime.settings import DEFAULT_GATEWAY_MESSAGES_PER_S
from baton.runtime.tasks import BackgroundTasks
from baton.wire.records import DecodeRequest, PrefillResult, ReleaseKv, TokenEvent, WorkRequest
from engine.sampling_params import length_limit
from gateway.affinity import PromptBlocks
from gateway.errors import RequestError
from gateway.prepare import PreparedRequest
from gateway.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0
# A request moves at most this many times: a request that takes down every worker it
# lands on (a query of death) must not take down the whole fleet.
DEFAULT_MAX_MIGRATIONS = 3
# Codes a decode stream ends with when its worker, not the request, failed: the
# connection broke (or the worker refused it, being down), or the worker, shutting
# down, let the request go.
_WORKER_LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class PrefillSkipped(enum.Enum):
    """Why a prompt runs colocated after all."""

    LOST = "lost"  # its prefill worker died or stalled: moved work, which no worker refuses
    REFUSED = "refused"  # its prefill worker's queue is full: new work, which the decode worker may refuse too


class WorkerLost(Exception):
    """The worker running a request died, stalled or let it go: the request moves."""

    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(f"{worker.role} worker {worker.address} lost: {reason}")
        self.worker = worker
        self.reason = reason


class Dispatcher:
    """Routes each request to its workers and streams back what they generate, moving
    it to other workers when one is lost."""

    def __init__(self, pool: WorkerPool, max_migrations: int = DEFAULT_MAX_MIGRATIONS,
                 on_migration: Callable[[], None] = lambda: None,
                 max_messages_per_s: float = DEFAULT_GATEWAY_MESSAGES_PER_S) -> None:
        self.pool = pool
        self.max_migrations = max_migrations
        self.on_migration = on_migration  # each move (for the metrics)
        self.max_messages_per_s = max_messages_per_s  # relayed, all streams together
        self._background = BackgroundTasks()

    async def run(self, prepared: PreparedRequest,
                  time_remaining: Callable[[], float | None]) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they are produced; `time_remaining()` is the caller's
        deadline, passed on to each worker call. Closing the stream aborts the request
        on its workers."""
        work = attempt = prepared.work()
        generated: list[int] = []  # streamed so far, over all attempts
        lost: list[str] = []  # the decode workers this request was lost on
        while True:
            try:
                # aclosing: a stream closed early closes each level now, innermost last, so the
                # calls end (and the workers are detached) in order, not when collected.
                async with contextlib.aclosing(self._attempt(attempt, prepared.span, time_remaining,
                                                             frozenset(lost))) as events:
                    async for event in events:
                        generated.extend(event.token_ids)
                        # A request that moved keeps its first attempt's moments only (latency.py).
                        yield replace(event, moments={}) if lost and event.moments else event
                return
            except RequestError as error:  # a worker's refusal names fields of its request
                raise error.for_client(prepared.prompt_field) from None
            except WorkerLost as error:
                lost.append(error.worker.address)
                if len(lost) > self.max_migrations:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"the request lost {len(lost)} decode workers; giving up "
                                       f"(last: {error})") from None
                num_prompt = len(work.prompt_token_ids)  # lost as the last token came:
                if num_prompt + len(generated) >= length_limit(num_prompt, work.params.max_tokens,
                                                               prepared.max_model_len):
                    yield TokenEvent([], [], "length")
                    return
                attempt = work.continued(generated, f"{work.request_id}~{len(lost)}")
                self.on_migration()
                logger.warning("request %s: %s after %d tokens; moving it (attempt %s)", work.request_id,
                               error, len(generated), attempt.request_id)
                if tracing.recording(prepared.span):
                    prepared.span.add_event("baton.migrate", {
                        "baton.worker.address": error.worker.address, "baton.migrate.reason": error.reason,
                        "baton.migrate.num_generated_tokens": len(generated),
                    })

    async def _attempt(self, work: WorkRequest, span, time_remaining: Callable[[], float | None],
                       avoid: frozenset[str]) -> AsyncIterator[TokenEvent]:
        """One attempt at the request on a decode worker not in `avoid` (and a prefill
        worker); raises WorkerLost when the decode worker is lost."""
        num_prompt = len(work.prompt_token_ids)
        prompt = PromptBlocks(work.prompt_token_ids)  # for prefix affinity
        decode = self.pool.pick_decode(num_prompt + 1, avoid, prompt=prompt)
        if decode is None:
            await self.pool.refresh_decode()
            decode = self.pool.pick_decode(num_prompt + 1, avoid, prompt=prompt)
        if decode is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               "no other decode worker is serving; the request's worker was lost" if avoid
                               else "no decode worker is serving")
        prefill = self.pool.pick_prefill(num_prompt, decode, prompt=prompt)
        # Attached: a worker retired meanwhile (gone from DNS) keeps its client until then.
        with contextlib.ExitStack() as attached:
            for worker in (decode, prefill):
                if worker is not None:
                    attached.enter_context(worker.attached.held())
            generated: list[int] = []
            async with contextlib.aclosing(self._attempt_on(decode, prefill, work, span, time_remaining)) as events:
                async for event in events:
                    generated.extend(event.token_ids)
                    yield event
            # The decode worker caches the blocks of its output too (all but the last token
            # has KV): a chat's next turn starts with them.
            decode.routed(prompt.extended(generated[:-1]))

    async def _attempt_on(self, decode: Worker, prefill: Worker | None, work: WorkRequest, span,
                          time_remaining: Callable[[], float | None]) -> AsyncIterator[TokenEvent]:
        trace_metadata = tracing.metadata(span)
        if tracing.recording(span):
            tracing.set_route(span, decode.address, prefill.address if prefill is not None else None)
        first, request = None, DecodeRequest(work)
        if prefill is not None:
            first, request = await self._prefill_first(decode, prefill, work, span, time_remaining, trace_metadata)
        if first is not None and first.finish_reason is not None:
            yield first  # the first token ended it: nothing is held
            return
        holder = prefill if request.kv_handle is not None else None
        async with contextlib.aclosing(self._decode(decode, request, holder, time_remaining,
                                                    trace_metadata)) as events:
            if first is not None:
                # The Decode call starts now, as the first token goes out: the first token
                # does not wait for the handoff, nor the handoff for the client.
                decoded = asyncio.ensure_future(anext(events))
                try:
                    yield first
                except BaseException:  # closed at the first token (client gone, stop string)
                    decoded.cancel()  # the Decode call ends, if it began
                    with contextlib.suppress(BaseException):
                        await decoded
                    self._release_later(prefill, work, trace_metadata)  # idempotent: _decode's may come too
                    raise
                try:
                    yield await decoded
                except StopAsyncIteration:
                    return
            async for event in events:
                yield event

    async def _prefill_first(self, decode: Worker, prefill: Worker, work: WorkRequest, span,
                             time_remaining: Callable[[], float | None],
                             trace_metadata) -> tuple[TokenEvent | None, DecodeRequest]:
        """Prefill on `prefill`: its first token, and the Decode call that goes on from it;
        no token, and a Decode call that prefills too, if the prefill worker was lost or refused."""
        try:
            result = await self._prefill(prefill, decode, work, time_remaining, trace_metadata)
        except asyncio.CancelledError:
            # The worker may have held the KV just as the call was cancelled, and its
            # answer is lost: drop the lease now, not at expiry.
            self._release_later(prefill, work, trace_metadata)
            raise
        if isinstance(result, PrefillSkipped):
            if tracing.recording(span):
                tracing.set_route(span, decode.address, None)
            attempt = work.attempt + 1 if result is PrefillSkipped.LOST else work.attempt
            return None, DecodeRequest(replace(work, attempt=attempt))
        first = TokenEvent(
            [result.first_token_id],
            [result.first_logprob] if result.first_logprob is not None else [],
            result.finish_reason,
            stop_token_id=result.first_token_id if result.finish_reason == "stop" else None,
            num_cached_tokens=result.num_cached_tokens,
            num_host_cached_tokens=result.num_host_cached_tokens,
            prompt_logprobs=result.prompt_logprobs,
            moments=result.moments,
        )
        return first, DecodeRequest(work, result.first_token_id, result.kv_handle)

    async def _prefill(self, worker: Worker, decode: Worker, work: WorkRequest,
                       time_remaining: Callable[[], float | None],
                       trace_metadata) -> PrefillResult | PrefillSkipped:
        """Prefill on `worker`; PrefillSkipped if it is unreachable or lost meanwhile, or
        refuses the request (the caller then runs colocated)."""
        done_calling = worker.in_flight.take()
        sent = time.time_ns()
        call = asyncio.ensure_future(worker.client.prefill(work, timeout=time_remaining(), metadata=trace_metadata))
        try:
            if not await self._until_done_or_lost(worker, call):
                call.cancel()  # reaches the worker if it comes back: it then frees the request
                logger.warning("prefill worker %s lost; running %s colocated", worker.address, work.request_id)
                self.pool.prefill_moved(worker, decode, len(work.prompt_token_ids))
                return PrefillSkipped.LOST
            result = call.result()
            return replace(result, moments={**result.moments, latency.PREFILL_SENT: sent})
        except grpc.aio.AioRpcError as error:
            if error.code() in (*_WORKER_LOST_CODES, grpc.StatusCode.RESOURCE_EXHAUSTED):
                # Lost, or its queue is full (then the decode worker refuses it in turn if
                # its own is full too).
                is_lost = error.code() in _WORKER_LOST_CODES
                if is_lost:
                    logger.warning("prefill worker %s %s; running %s colocated", worker.address,
                                   error.code().name, work.request_id)
                    self.pool.mark_down(worker)
                self.pool.prefill_moved(worker, decode, len(work.prompt_token_ids))
                return PrefillSkipped.LOST if is_lost else PrefillSkipped.REFUSED
            raise RequestError.from_worker(error, "prefill failed") from None
        except ValueError as error:  # a KV handle no cache could have: a worker of another release
            self._release_later(worker, work, trace_metadata)
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"prefill worker {worker.address} sent an unusable KV handle: {error}") from None
        finally:
            done_calling()
            if not call.done():
                call.cancel()

    async def _until_done_or_lost(self, worker: Worker, pending: asyncio.Future,
                                  lost: asyncio.Future | None = None) -> bool:
        """Wait for `pending`, a call on `worker`; False if the worker is lost first: it is
        marked down (a failed poll, another call's failure), or `pending` has waited a
        stall timeout and the worker then fails a probe. A worker that answers the probe
        is alive (the call may be queued there) and the wait goes on. `lost`: a wait on
        worker.lost that the caller keeps across its waits (else one is made for this one)."""
        own_lost = lost is None
        if own_lost:
            lost = asyncio.ensure_future(worker.lost.wait())
        try:
            while True:
                done, _ = await asyncio.wait((pending, lost), timeout=worker.stall_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if pending in done:
                    return True
                if lost in done or not await self.pool.probe(worker):
                    return pending.done()
        finally:
            if own_lost:
                lost.cancel()

    async def _decode(self, worker: Worker, request: DecodeRequest, holder: Worker | None,
                      time_remaining: Callable[[], float | None], trace_metadata) -> AsyncIterator[TokenEvent]:
        """Stream the decode worker's events; `holder` is the prefill worker holding the
        request's KV, if it was handed off. WorkerLost if the decode worker is lost."""
        # Colocated, the call carries the prompt to the worker that prefills it.
        sent = {latency.PREFILL_SENT: time.time_ns()} if request.kv_handle is None else {}
        # The messages this gateway relays are shared among the decode workers it routes to.
        num_routable = sum(w.routable for w in self.pool.decode)
        request = replace(request, max_messages_per_s=self.max_messages_per_s / max(1, num_routable))
        reader = EventReader(worker.client.decode(request, timeout=time_remaining(), metadata=trace_metadata))
        done_calling = worker.in_flight.take()
        lost = asyncio.ensure_future(worker.lost.wait())
        got_event = False
        try:
            while True:
                if not reader.ready() and not await self._until_done_or_lost(worker, reader.wait(), lost):
                    raise WorkerLost(worker, f"stalled: no token and no answer within {worker.stall_timeout_s:.1f} s")
                event = reader.take()
                if event is None:
                    return
                if not got_event and sent:
                    event = replace(event, moments={**event.moments, **sent})
                got_event = True
                yield event
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code in _WORKER_LOST_CODES:
                self.pool.mark_down(worker)
                raise WorkerLost(worker, f"{code.name}: {error.details()}") from None
            raise RequestError.from_worker(error, "decode failed") from None
        finally:
            lost.cancel()
            done_calling()
            await reader.aclose()  # the client went away or a stop string matched: abort on the worker
            if holder is not None and not got_event:
                # The decode side may never have pulled the KV: drop the lease now, not at expiry.
                self._release_later(holder, request.request, trace_metadata)

    def _release_later(self, prefill: Worker, work: WorkRequest, trace_metadata) -> None:
        """Drop the KV `prefill` holds for a request that will not pull it, in the background
        (best effort: the lease expires anyway); its kv_token proves the KV is ours."""
        self._background.spawn(self._release(prefill, work, trace_metadata, prefill.attached.take()))

    async def _release(self, prefill: Worker, work: WorkRequest, trace_metadata, detach: Callable[[], None]) -> None:
        try:
            await prefill.client.release_kv(ReleaseKv(work.request_id, work.kv_token), timeout=RELEASE_TIMEOUT_S,
                                            metadata=trace_metadata)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # UsageError: the pool closed its client
            pass
        finally:
            detach()


class EventReader:
    """A worker's event stream, read ahead in a task of its own. What arrives while its
    consumer is busy (a client slower than the worker, or a gateway behind its load) is
    taken at once as one event (TokenEvent.merged), so a client slower than its worker
    gets fewer, larger messages. Waiting for the next event makes no task of its own
    (the loop it replaced made two a message). A gateway behind its whole load seldom
    finds two events waiting: the decode workers' message bound is what gathers those."""

    def __init__(self, events: AsyncIterator[TokenEvent]) -> None:
        self._events = events
        self._buffer: list[TokenEvent] = []
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for event in self._events:
                self._buffer.append(event)
                self._wake()
        except Exception as error:  # the call's: raised to the consumer after the events before it
            self._error = error
        finally:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def ready(self) -> bool:
        """Whether `take` answers now: events arrived, or the stream ended."""
        return bool(self._buffer) or self._ended

    def wait(self) -> asyncio.Future:
        """A future done once `ready`."""
        self._waiter = asyncio.get_running_loop().create_future()
        if self.ready():
            self._waiter.set_result(None)
        return self._waiter

    def take(self) -> TokenEvent | None:
        """The events arrived since the last take, as one; None once the stream ended
        (raising its error, if it failed)."""
        if self._buffer:
            events, self._buffer = self._buffer, []
            return TokenEvent.merged(events)
        if self._error is not None:
            raise self._error
        return None

    async def aclose(self) -> None:
        """Stop reading (a call still running is cancelled: aborted on the worker)."""
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        await self._events.aclose()
