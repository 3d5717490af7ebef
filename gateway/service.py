"""The public baton.v1.Generation service: read the request, prepare it (prepare.py),
run it on the workers (dispatch.py), and turn its tokens into text.

Stop strings and detokenization happen here, the only place that owns the text:
the workers stop on tokens and lengths, and a stop string that matches ends the
client's stream and aborts the request on its workers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from baton.runtime import latency, logs, tracing
from baton.runtime.metrics import GatewayMetrics
from baton.runtime.settings import DEFAULT_GATEWAY_MESSAGES_PER_S
from baton.wire import convert, status
from baton.wire.records import GenerateRequest, ModelInfo, TextDelta
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.detokenizer import IncrementalDetokenizer
from gateway.admission import GatewayAdmission
from gateway.choices import merged_choices
from gateway.dispatch import DEFAULT_MAX_MIGRATIONS, Dispatcher
from gateway.errors import RequestError
from gateway.prepare import PreparedRequest, RequestPreparer
from gateway.workers import WorkerPool

logger = logging.getLogger(__name__)
# A request id a client (or a service mesh's proxy) sends as a header: the request's id
# when its body names none, and sent back.
REQUEST_ID_HEADER = "x-request-id"
_MAX_REQUEST_ID = 128


def header_request_id(carrier) -> str:
    """The x-request-id among a call's (key, value) pairs: printable ASCII, no spaces, at
    most _MAX_REQUEST_ID characters ("": none, or one that is not)."""
    value = next((v for k, v in carrier or () if k.lower() == REQUEST_ID_HEADER), "")
    if isinstance(value, bytes) or not 0 < len(value) <= _MAX_REQUEST_ID:
        return ""
    return value if value.isascii() and value.isprintable() and " " not in value else ""

# gen_ai.operation.name by prompt kind.
_OPERATIONS = {"messages": "chat", "text": "text_completion", "token_ids": "text_completion"}
_STARTING = "gateway is starting: no worker is serving yet"
# A request aborted this close to its deadline ended by it: the client's own timer
# fires first, and its cancel reaches us before our copy of the deadline passes.
DEADLINE_SLACK_S = 0.25


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """baton.v1.Generation over a pool of prefill and decode workers."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics | None = None, *,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, admission: GatewayAdmission | None = None,
                 max_messages_per_s: float = DEFAULT_GATEWAY_MESSAGES_PER_S) -> None:
        self.dispatcher = Dispatcher(pool, max_migrations, self._count_migration, max_messages_per_s)
        self.admission = admission or GatewayAdmission(pool)
        self.metrics = metrics  # None: not recorded
        self.latency = latency.RecentLatency()  # the latest requests' phases, for `baton status`
        # Set by `load` (the gateway listens before its workers are up).
        self.preparer: RequestPreparer | None = None
        self._in_flight: set[str] = set()
        # Tokenizing (and chat templates) run here, off the event loop: a long prompt
        # must not stall every other call. One thread: a fast tokenizer object is not
        # safe to use from several threads at once.
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.draining = False  # SIGTERM: new requests are refused

    async def drain(self) -> None:
        """SIGTERM: return once no request is in flight (new calls are refused by then;
        the caller bounds the wait)."""
        self.draining = True
        while self._in_flight:
            await asyncio.sleep(0.05)

    @property
    def metrics(self) -> GatewayMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: GatewayMetrics | None) -> None:
        """Set here or once the model is known (gateway/server.py); its in-flight gauge reads admission's count."""
        self._metrics = metrics
        if metrics is not None:
            metrics.watch_in_flight(self.admission.in_flight)

    def check_room(self, num_seqs: int, field: str) -> None:
        """RequestError unless `num_seqs` more sequences (an HTTP batch's, all its prompts'
        choices) could be admitted now: a batch is refused whole, before any of it runs.
        `field`: what asked for them, named if they could never fit."""
        try:
            self.admission.check_room(num_seqs, field)
        except RequestError as error:
            if self.metrics is not None and error.reason is not None:
                self.metrics.refuse(error.reason)
            raise

    def _count_migration(self) -> None:
        if self.metrics is not None:
            self.metrics.migrations.inc()

    def load(self, tokenizer, info: ModelInfo) -> None:
        self.preparer = RequestPreparer(tokenizer, info)

    @property
    def info(self) -> ModelInfo | None:
        return self.preparer.info if self.preparer is not None else None

    # ------------------------------------------------------------------- RPCs
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _STARTING)
        return convert.model_info_to_pb(self.info)

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for delta in self._serve_grpc(request, context, "GenerateStream"):
            yield convert.text_delta_to_pb(delta)

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        deltas = [delta async for delta in self._serve_grpc(request, context, "Generate")]
        return convert.completion_to_pb(deltas)

    async def _serve_grpc(self, message: pb.GenerateRequest, context, method: str) -> AsyncIterator[TextDelta]:
        """`generate` for a gRPC call: a RequestError ends the call with its status."""
        if self.metrics is not None:
            self.metrics.received("grpc")
        request_id = header_request_id(context.invocation_metadata())
        if request_id:  # a mesh's id comes back to it, as Envoy's and vLLM's do
            await context.send_initial_metadata(((REQUEST_ID_HEADER, request_id),))
        try:
            async for delta in self.generate(lambda: convert.generate_request_from_pb(message),
                                             context.time_remaining, context.invocation_metadata(),
                                             "baton.v1.Generation", method, front="grpc"):
                yield delta
        except RequestError as error:
            await context.abort(error.code, error.details,
                                trailing_metadata=status.error_trailers(error.code, error.details,
                                                                        error.error_details))

    async def generate(self, read: Callable[[], GenerateRequest], time_remaining: Callable[[], float | None],
                       carrier, service: str, method: str, *, front: str) -> AsyncIterator[TextDelta]:
        """One request, start to end, whichever front end it came by (gRPC, or the OpenAI
        HTTP API: gateway/http): its span, validation, admission, the stream. `read()`
        gives the request (a ValueError, or a FieldError naming the field, is
        INVALID_ARGUMENT); `time_remaining()`, seconds to its deadline (None: none, its
        SLO); `carrier`, the (key, value) pairs a traceparent may come in. Raises
        RequestError with the status the request ends with."""
        span = self._start_span(carrier, service, method, front)
        prepared = stream = None
        failure: RequestError | None = None
        try:
            prepared = await self._prepare(read, span, time_remaining(), front, header_request_id(carrier))
            stream = self._text_stream(prepared, time_remaining)
            async for delta in stream:
                yield delta
        except RequestError as error:
            failure = error
            if self.metrics is not None and (error.reason is not None or
                                             error.code == grpc.StatusCode.RESOURCE_EXHAUSTED):
                self.metrics.refuse(error.reason or "worker")
            raise
        except (asyncio.CancelledError, GeneratorExit):
            failure = RequestError(grpc.StatusCode.CANCELLED, "the client cancelled")
            raise
        except Exception as error:
            failure = RequestError(grpc.StatusCode.UNKNOWN, repr(error))  # what grpc tells the client
            raise
        finally:
            try:
                if stream is not None:
                    await stream.aclose()  # its workers' calls end now, not when it is collected
            finally:
                if prepared is not None:
                    logger.debug("request %s ended: %s", prepared.request_id,
                                 "ok" if failure is None else failure.code.name)
                    self._in_flight.discard(prepared.request_id)
                    self.admission.release(prepared.request_id, prepared.outcome)
                    self._record_deadline(prepared)
                self._end_span(span, failure)

    async def _tokenized(self, preparer: RequestPreparer, request: GenerateRequest, request_id: str, span,
                         queue: Callable[[int], float | None]) -> tuple[PreparedRequest, float | None]:
        """The request prepared, and `queue(its prompt tokens)`: admission's forecast first
        token (RequestError if it refuses). A prompt of token ids is queued first (refused
        now if it must be) and, with nothing to tokenize, checked here, not two hops away on
        the tokenizer thread, whose hops and hold on the GIL slow the loop taking new calls."""
        if request.prompt_kind == "token_ids":
            forecast = queue(len(request.prompt))
            return preparer.prepare(request, request_id, span), forecast
        prepared = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_executor, preparer.prepare, request, request_id, span)
        return prepared, queue(len(prepared.prompt_token_ids))

    async def _prepare(self, read: Callable[[], GenerateRequest], span, time_remaining: float | None,
                       front: str, header_id: str) -> PreparedRequest:
        """Read, validate, admit and tokenize; raises RequestError. The request is then in
        flight. `time_remaining`: seconds to the call's deadline (None: none), its SLO;
        `front`: the front end it came by; `header_id`: its x-request-id ("": none), its
        id unless the request names one."""
        arrival = time.monotonic()
        deadline = None if time_remaining is None else arrival + time_remaining
        preparer = self.preparer
        if preparer is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, _STARTING)
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down: try another")
        try:
            request = read()
        except ValueError as error:
            raise RequestError.invalid(error) from None
        request_id = self._request_id(request.request_id, header_id)
        logs.bind_request(request_id, span)  # this call's log lines name it (baton/runtime/logs.py)
        if request_id in self._in_flight:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        # Before tokenizing: an overloaded gateway refuses at once. Its n choices count as n.
        self.admission.admit(request_id, front, request.params.n)
        self._in_flight.add(request_id)  # now, so that a twin arriving while this one tokenizes is refused
        try:
            prepared, forecast = await self._tokenized(preparer, request, request_id, span, functools.partial(
                self.admission.queue_tokens, request_id, params=request.params, priority=request.priority,
                deadline=deadline, arrival=arrival, max_context=preparer.info.max_context_length,
                num_seqs=request.params.n))
            prepared.arrival, prepared.deadline = arrival, deadline
            if forecast is not None and self.metrics is not None:
                self.metrics.forecast_ttft.observe(forecast)
        except BaseException:
            self._in_flight.discard(request_id)
            self.admission.release(request_id)
            raise
        if request.request_id or header_id:  # the client's own id: other gateways' clients may use it too
            prepared.worker_request_id = f"{request_id}@{self._prefix}"
        if tracing.recording(span):
            tracing.set_request(span, self.info.model, prepared.params, _OPERATIONS[request.prompt_kind],
                                request_id, len(prepared.prompt_token_ids), prepared.priority)
        return prepared

    def _request_id(self, named: str, header_id: str) -> str:
        """A request's id: the one it names, else its x-request-id (made unique while another
        with it is here: a mesh retrying a request still running), else a new one."""
        if named:
            return named
        ours = f"{self._prefix}-{next(self._ids)}"
        if not header_id:
            return ours
        return header_id if header_id not in self._in_flight else f"{header_id}-{ours}"

    def _record_deadline(self, prepared: PreparedRequest) -> None:
        if self.metrics is None or prepared.deadline is None:
            return
        if prepared.outcome == "deadline":
            self.metrics.deadline_misses.inc()
        elif prepared.outcome in ("stop", "length"):
            self.metrics.within_deadline.inc()

    # ----------------------------------------------------------------- tracing
    @staticmethod
    def _start_span(carrier, service: str, method: str, front: str):
        """The request's `generate` span: a child of the caller's span when its call
        carried a traceparent (gRPC metadata or an HTTP header), else a new trace's root
        (None: tracing off)."""
        if not tracing.enabled():
            return None
        system = {"grpc": {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
                  "http": {"http.request.method": "POST", "http.route": method}}[front]
        return tracing.start_span("generate", tracing.extract(carrier), tracing.SERVER, system)

    @staticmethod
    def _end_span(span, failure: RequestError | None) -> None:
        if failure is None:
            tracing.end_span(span)
        else:
            tracing.end_span(span, failure.code, failure.details)

    # ------------------------------------------------------------------- text
    def _text_stream(self, prepared: PreparedRequest,
                     time_remaining: Callable[[], float | None]) -> AsyncIterator[TextDelta]:
        """The request's text deltas: its one choice's, or its n choices' (gateway/choices.py)."""
        if prepared.params.n == 1:
            return self._choice_stream(prepared, time_remaining)
        return merged_choices(prepared, lambda choice, index: self._choice_stream(choice, time_remaining, index))

    async def _choice_stream(self, prepared: PreparedRequest, time_remaining: Callable[[], float | None],
                             index: int = 0) -> AsyncIterator[TextDelta]:
        """Token events turned into text deltas (valid UTF-8, stop strings applied) of one
        choice, `index`."""
        choice = _ChoiceText(prepared, self.preparer.tokenizer, index)
        outcome = "error"  # until it finishes or is cancelled
        events = self.dispatcher.run(prepared, time_remaining)
        try:
            async for event in events:
                if not choice.num_output:
                    self.admission.started(prepared.request_id)  # its prompt is no longer queued
                if index == 0:  # the output-length model learns one choice's length, not n summed
                    self.admission.generated(prepared.request_id, len(event.token_ids))
                shed = self.admission.shed_error(prepared.request_id)
                if shed is not None:  # the deployment fell behind: this one ends so that the rest finish in time
                    raise shed
                delta = choice.delta(event)
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason
                    yield delta
                    return  # a stop string ends it here: closing `events` aborts the workers
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "abort"
            raise
        except RequestError as error:
            if error.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                outcome = "abort"
            raise
        finally:
            # Ended by its deadline (gRPC cancels the call then, or the client, whose clock
            # runs a little ahead, cancels it first): admission failed it.
            at_deadline = prepared.deadline is not None and time.monotonic() >= prepared.deadline - DEADLINE_SLACK_S
            prepared.outcome = "deadline" if outcome == "abort" and at_deadline else outcome
            await events.aclose()
            self._record(choice, outcome)

    def _record(self, choice: _ChoiceText, outcome: str) -> None:
        """A choice's end in the metrics and on the request's span: its latency, phase by phase."""
        prepared = choice.prepared
        phases = choice.phases()
        times = choice.token_times
        if len(times) > 1:
            self.latency.add(times[0] - prepared.arrival, times[1] - prepared.arrival, phases)
        if self.metrics is not None:
            self.metrics.record_request(
                arrival=prepared.arrival, token_times=choice.token_times, finished_at=time.monotonic(),
                num_prompt_tokens=len(prepared.prompt_token_ids), finish_reason=outcome, phases=phases,
            )
        if tracing.recording(prepared.span):
            tracing.set_response(prepared.span, self.info.model, outcome, choice.num_output,
                                 choice.token_times[0] - prepared.arrival if choice.token_times else None)
            tracing.set_phases(prepared.span, phases, choice.token_times[1] - prepared.arrival
                               if len(choice.token_times) > 1 else None)


class _ChoiceText:
    """One choice's text and counts as its token events arrive."""

    def __init__(self, prepared: PreparedRequest, tokenizer, index: int) -> None:
        self.prepared = prepared
        self.index = index
        params = prepared.params
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prepared.prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self.num_output = 0
        self.num_cached = 0  # as the worker that prefilled the prompt (last) reported it
        self.num_host_cached = 0  # of them, those its host tier held
        self.token_times: list[float] = []
        self.moments: dict[str, int] = {}  # the workers' and the dispatch's (baton/runtime/latency.py)

    def phases(self) -> dict[str, float]:
        """Where its time went, by phase (baton/runtime/latency.py), as far as it got."""
        times = self.token_times
        moments = latency.stamp(dict(self.moments), **{latency.ARRIVAL: self.prepared.arrival})
        latency.stamp(moments, **{latency.FIRST_TOKEN_OUT: times[0] if times else None,
                                  latency.SECOND_TOKEN_OUT: times[1] if len(times) > 1 else None})
        return latency.phases(moments)

    def delta(self, event) -> TextDelta:
        """The event's text delta, with a finish_reason where the event or a stop string ends the choice."""
        prepared = self.prepared
        self.num_output += len(event.token_ids)
        if event.num_cached_tokens is not None:
            self.num_cached, self.num_host_cached = event.num_cached_tokens, event.num_host_cached_tokens
        self.token_times.extend([time.monotonic()] * len(event.token_ids))
        self.moments.update(event.moments)
        text, finish_reason, stop_string = "", event.finish_reason, None
        if self.detokenizer is not None:
            text = self.detokenizer.append(event.token_ids)
            if self.detokenizer.stop_matched is not None:
                finish_reason, stop_string = "stop", self.detokenizer.stop_matched
            elif finish_reason is not None:
                text += self.detokenizer.flush()
        if finish_reason is None:
            return TextDelta(prepared.request_id, event.token_ids, text, event.logprobs, index=self.index,
                             prompt_logprobs=event.prompt_logprobs)
        return TextDelta(
            prepared.request_id, event.token_ids, text, event.logprobs, finish_reason, stop_string=stop_string,
            stop_token_id=event.stop_token_id if stop_string is None else None,
            num_prompt_tokens=len(prepared.prompt_token_ids), num_completion_tokens=self.num_output,
            num_cached_tokens=self.num_cached, num_host_cached_tokens=self.num_host_cached, index=self.index,
            prompt_logprobs=event.prompt_logprobs,
        )
