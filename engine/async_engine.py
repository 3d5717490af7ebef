"""AsyncEngine: an LLMEngine on a thread of its own, bridged to an asyncio event loop.

The gRPC workers are asyncio servers; a model step takes milliseconds to
seconds and must never run on the event loop. The engine thread owns the
LLMEngine outright (it is not thread-safe): every call into it, from any
coroutine, is a command queued to that thread and run between steps.

    event loop                               engine thread
    ----------                               -------------
    await add_request(...)  --command-->     engine.add_request
    RequestStream.get()     <--outputs--     engine.step() (while there is work)
    on_kv_receive(receive)  <--receives--    (admitted requests with remote KV)

Outputs and receives travel back with `loop.call_soon_threadsafe`, in step
order, so a request's outputs never overtake each other. A request that lands
in blocks the engine set aside (engine/kv/landing.py) has its receive given on the
loop as its add is queued, before the engine thread has seen it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from engine.engine import LLMEngine
from engine.kv.landing import Landing
from engine.outputs import KvReceive, RequestOutput, StepOutput
from engine.request import InvalidRequestError
from engine.runner.device import use_device
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The engine thread waits this long for a command when it has nothing to step.
IDLE_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised)."""


class RequestStream:
    """One request's outputs, in order; the last one has `finished` set."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._failure: BaseException | None = None
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The next output: every one the engine put since the last get, as one (a reader
        behind the engine, its client's stream slower than the steps, takes them in one
        message, not one a step); raises EngineDeadError if the engine stopped first."""
        if self._failure is not None:
            raise self._failure
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        outputs = [item]
        while not (outputs[-1].finished or outputs[-1].kv_block_ids is not None or self._queue.empty()):
            following = self._queue.get_nowait()
            if isinstance(following, BaseException):
                self._failure = following  # raised by the next get, after these outputs
                break
            outputs.append(following)
        item = RequestOutput.merged(outputs)
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


class AsyncEngine:
    """Runs `engine` on a dedicated thread; coroutines talk to it through commands.

    `on_kv_receive` is called on the event loop for each request admitted with
    remote KV (see LLMEngine.add_prefilled_request); the caller fills its
    blocks and then calls `complete_kv_receive`. `on_last_output` is called on
    the event loop with each request's last output on this engine (the one
    carrying `timings`: finished, or held for a handoff), whether or not anyone
    still reads its stream, so a cancelled request is accounted for too.
    `on_failure` is called on the event loop if the engine thread dies of an
    error (a step raised): every stream has failed by then, and the engine
    takes no more commands.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        on_kv_receive: Callable[[KvReceive], None] | None = None,
        on_last_output: Callable[[RequestOutput], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_kv_receive = on_kv_receive
        self._on_last_output = on_last_output
        self._on_failure = on_failure
        # (fn, future) pairs; None ends the thread.
        self._commands: queue.SimpleQueue[tuple[Callable, asyncio.Future] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self.num_steps = 0
        # time.monotonic() when the engine thread last came round its loop (after a step,
        # or an idle wait of at most IDLE_WAIT_S): a stale one means a step or a command
        # is stuck. Written by the engine thread, read anywhere.
        self.heartbeat = time.monotonic()

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._on_kv_receive is not None:  # a pull starts as its step is scheduled, not after it ran
            self.engine.on_kv_receives = self._receives_scheduled
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything still running, then end the engine thread."""
        if self._thread is None:
            return
        if self.is_alive:
            await self.call(_abort_all)
        self._stopping = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._fail_streams(EngineDeadError("engine stopped"))

    @property
    def num_streams(self) -> int:
        """Requests whose outputs someone still reads (a held request's stream has ended)."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ----------------------------------------------------------------- commands
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; return its result or raise its error."""
        return await self._submit(fn)

    def _submit(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Queue `fn` now (commands run in the order queued); the future of its result."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        loop = self._loop
        assert loop is not None
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put((fn, future))
        return future

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        prefill_only: bool = False,
        trace: bool = False,
        num_generated_tokens: int = 0,
    ) -> RequestStream:
        """Queue a request; raises ValueError on bad input (nothing is then queued), an
        InvalidRequestError naming the attribute at fault for a request the engine could never run.
        `deadline` (time.monotonic() seconds) orders the queues: see LLMEngine.add_request."""
        await self._prepare(params)
        return await self._add(
            request_id,
            lambda engine: engine.add_request(
                list(prompt_token_ids),
                params,
                request_id=request_id,
                priority=priority,
                deadline=deadline,
                prefill_only=prefill_only,
                trace=trace,
                num_generated_tokens=num_generated_tokens,
            ),
        )

    async def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        trace: bool = False,
        num_generated_tokens: int = 0,
        land: bool = False,
    ) -> RequestStream:
        """Queue a request whose prompt KV will be received (see LLMEngine.add_prefilled_request).
        With `land`, it takes blocks the engine set aside if there are enough (engine/kv/landing.py):
        `on_kv_receive` gets them at once, before the add runs, so its KV is pulled while the
        engine finishes its step."""
        await self._prepare(params)
        landing = None
        if land and self._on_kv_receive is not None and request_id not in self._streams:
            landing = self.engine.scheduler.landing.claim(len(prompt_token_ids))
        return await self._add(
            request_id,
            lambda engine: engine.add_prefilled_request(
                list(prompt_token_ids),
                first_token_id,
                params,
                request_id=request_id,
                priority=priority,
                deadline=deadline,
                trace=trace,
                num_generated_tokens=num_generated_tokens,
                landing=landing,
            ),
            landing,
        )

    async def _prepare(self, params: SamplingParams) -> None:
        """Compile a structured output's grammar on a worker thread (cached: usually at once),
        neither on the event loop nor in the engine's step; InvalidRequestError if it cannot be."""
        spec = params.structured_output
        grammars = self.engine.grammars
        if spec is None or grammars is None:
            return  # no constraint, or no tokenizer: the engine refuses it when added
        try:
            await asyncio.to_thread(grammars.prepare, spec)
        except StructuredOutputError as error:
            raise InvalidRequestError(f"sampling_params.{error.name}", str(error)) from None

    async def _add(self, request_id: str, add: Callable[[LLMEngine], Any],
                   landing: Landing | None = None) -> RequestStream:
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        # Registered before the command runs: the first output may follow it immediately.
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            added = self._submit(add)
            if landing is not None:  # its pull starts now; the pull's completion is queued behind the add
                self._on_kv_receive(KvReceive(request_id, landing.block_ids, ticket=landing.ticket))
            await added
        except asyncio.CancelledError:
            # The caller went away (a cancelled call), but its command is queued or has
            # run: the request would live on with nobody to read or free it. Its abort,
            # queued behind the add (commands run in order), ends it either way.
            self._streams.pop(request_id, None)
            self._abort_later(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def _abort_later(self, request_id: str) -> None:
        """Queue an abort of `request_id` without waiting for it (for callers being cancelled)."""
        if self.is_alive:
            assert self._loop is not None
            self._commands.put((lambda engine: engine.abort_request(request_id), self._loop.create_future()))

    async def abort(self, request_id: str) -> bool:
        """End a request in any state and free its blocks; its stream ends with finish 'abort'."""
        if not self.is_alive:
            return False
        return await self.call(lambda engine: engine.abort_request(request_id))

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        commands = self._commands
        try:
            use_device(engine.device)  # before any step or command: this thread starts on cuda:0
            while not self._stopping:
                self.heartbeat = time.monotonic()
                if not engine.has_work():
                    # Nothing to step: sleep until a command arrives.
                    try:
                        command = commands.get(timeout=IDLE_WAIT_S)
                    except queue.Empty:
                        continue
                    if command is None:
                        return
                    self._execute(command)
                while True:  # every queued command runs before the next step
                    try:
                        command = commands.get_nowait()
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    self._execute(command)
                if engine.has_work():
                    step = engine.step()
                    self.num_steps += 1
                    if step.outputs or step.kv_receives:
                        self._loop.call_soon_threadsafe(self._deliver, step)
        except BaseException as error:  # the step is broken: fail every request, stay down
            logger.exception("engine thread failed")
            self._error = error
            self._loop.call_soon_threadsafe(self._fail, error)
        finally:
            # Commands queued after the loop ended would never run; fail their callers.
            error = EngineDeadError("engine stopped")
            while True:
                try:
                    command = commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None:
                    self._loop.call_soon_threadsafe(_set_exception, command[1], error)

    def _execute(self, command: tuple[Callable, asyncio.Future]) -> None:
        fn, future = command
        try:
            result = fn(self.engine)
        except Exception as error:  # the caller's error (e.g. ValueError on bad input)
            self._loop.call_soon_threadsafe(_set_exception, future, error)
        else:
            self._loop.call_soon_threadsafe(_set_result, future, result)

    # ---------------------------------------------------------------- on loop
    def _deliver(self, step: StepOutput) -> None:
        streams = self._streams
        on_last_output = self._on_last_output
        for output in step.outputs:
            if on_last_output is not None and output.timings is not None:
                try:
                    on_last_output(output)
                except Exception:  # an observer's bug must not cost the other requests their outputs
                    logger.exception("on_last_output failed for %s", output.request_id)
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            # A held request's output (its KV kept for a handoff) is its stream's last:
            # `release_kv` later ends it without another, and its id may then be reused.
            if output.finished or output.kv_block_ids is not None:
                del streams[output.request_id]
            stream._put(output)
        if self._on_kv_receive is not None:
            for receive in step.kv_receives:
                self._on_kv_receive(receive)

    def _receives_scheduled(self, receives: list[KvReceive]) -> None:
        """On the engine thread: requests a step just admitted with remote KV."""
        self._loop.call_soon_threadsafe(self._deliver_receives, receives)

    def _deliver_receives(self, receives: list[KvReceive]) -> None:
        for receive in receives:
            self._on_kv_receive(receive)

    def _fail(self, error: BaseException) -> None:
        self._fail_streams(EngineDeadError(repr(error)))
        if self._on_failure is not None:
            self._on_failure(error)

    def _fail_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(error)


def _abort_all(engine: LLMEngine) -> None:
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
