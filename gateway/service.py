"""The public baton.v1.Generation service: validate, tokenize, route, stream text.

One request, disaggregated:

    Prefill(prompt) on a prefill worker  ->  first token + KV handle
        the first token is streamed to the client at once
    Decode(prompt, first token, handle) on a decode worker  ->  one event per step
        (the decode worker pulls the KV from the prefill worker itself)

Colocated (no prefill worker up): Decode(prompt) alone; the decode worker prefills.
Stop strings and detokenization happen here, the only place that owns the text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import jinja2

from baton.runtime import tracing
from baton.wire.convert import sampling_params_from_pb
from baton.wire.internal.v1 import worker_pb2
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from baton.runtime.metrics import GatewayMetrics
from gateway.workers import Worker, WorkerPool

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
# gen_ai.operation.name by prompt kind.
_OPERATIONS = {"messages": "chat", "text": "text_completion", "token_ids": "text_completion"}

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LENGTH = 256
CHAT_ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request fails with this gRPC status (raised before or while it runs)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(slots=True)
class TokenEvent:
    """New tokens of a request from a worker; `finish_reason` set on the last."""

    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    stop_token_id: int | None = None


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams  # forwarded to workers, stop strings removed
    priority: int
    arrival: float = field(default_factory=time.monotonic)  # for the latency metrics
    span: object | None = None  # its `generate` span (None: tracing off)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """baton.v1.Generation over a pool of prefill and decode workers."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics  # None: not recorded
        # Set by `load` (the gateway listens before its workers are up).
        self.tokenizer = None
        self.info: pb.ModelInfo | None = None
        self._in_flight: set[str] = set()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._background: set[asyncio.Task] = set()
        # Counters.
        self.num_colocated = 0
        self.num_disaggregated = 0

    def load(self, tokenizer, info: pb.ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    # ------------------------------------------------------------------- RPCs
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is starting: no worker is serving yet")
        return self.info

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for message in self._serve(request, context, "GenerateStream"):
            yield message

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        text = []
        async for message in self._serve(request, context, "Generate"):
            response.request_id = message.request_id
            text.append(message.text)
            response.token_ids.extend(message.token_ids)
            response.logprobs.extend(message.logprobs)
            if message.finish_reason:
                response.finish_reason = message.finish_reason
                response.usage.CopyFrom(message.usage)
                which = message.WhichOneof("stop_reason")
                if which is not None:
                    setattr(response, which, getattr(message, which))
        response.text = "".join(text)
        return response

    async def _serve(self, request: pb.GenerateRequest, context, method: str) -> AsyncIterator[pb.GenerateStreamResponse]:
        """One request, start to end: its span, validation, the stream; a RequestError
        ends the call with its status."""
        span = self._start_span(context, method)
        prepared = stream = None
        failure: RequestError | None = None
        try:
            prepared = self._prepare(request, span)
            stream = self._text_stream(prepared, context)
            async for message in stream:
                yield message
        except RequestError as error:
            failure = error
            await context.abort(error.code, error.details)
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
                    self._in_flight.discard(prepared.request_id)
                self._end_span(span, failure)

    # ----------------------------------------------------------------- tracing
    def _start_span(self, context, method: str):
        """The request's `generate` span: a child of the caller's span when its call
        carried a traceparent, else a new trace's root (None: tracing off)."""
        if not tracing.enabled():
            return None
        return tracing.start_span(
            "generate",
            tracing.extract(context.invocation_metadata()),
            tracing.SERVER,
            {"rpc.system": "grpc", "rpc.service": "baton.v1.Generation", "rpc.method": method},
        )

    @staticmethod
    def _end_span(span, failure: RequestError | None) -> None:
        if span is None:
            return
        if failure is None:
            tracing.end_span(span)
        else:
            tracing.end_span(span, failure.code, failure.details)

    # ------------------------------------------------------------- validation
    def _prepare(self, request: pb.GenerateRequest, span=None) -> PreparedRequest:
        """Validate and tokenize; raises RequestError. The request is then in flight."""
        if self.info is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "gateway is starting: no worker is serving yet")
        prepared = self._validate(request, span)
        prepared.span = span
        if tracing.recording(span):
            span.set_attributes({
                **tracing.request_attributes(
                    self.info.model, prepared.params, operation=_OPERATIONS[request.WhichOneof("prompt")]
                ),
                "gen_ai.response.id": prepared.request_id,
                "gen_ai.usage.input_tokens": len(prepared.prompt_token_ids),
                "baton.request_id": prepared.request_id,
                "baton.priority": prepared.priority,
            })
        self._in_flight.add(prepared.request_id)
        return prepared

    def _validate(self, request: pb.GenerateRequest, span=None) -> PreparedRequest:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        request_id = request.request_id or f"{self._prefix}-{next(self._ids)}"
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise RequestError(invalid, f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
        if request_id in self._in_flight:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        prompt_token_ids = self._traced_tokenize(request, span)
        if not prompt_token_ids:
            raise RequestError(invalid, "the prompt is empty")
        vocab_size = self.info.vocab_size
        bad = [t for t in prompt_token_ids if t >= vocab_size]
        if bad:
            raise RequestError(invalid, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        max_len = self.info.max_context_length
        if len(prompt_token_ids) >= max_len:
            raise RequestError(
                invalid, f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is {max_len - 1}"
            )
        try:
            params = sampling_params_from_pb(request.sampling)
        except ValueError as error:
            raise RequestError(invalid, f"sampling: {error}") from None
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise RequestError(invalid, "stop_token_ids must lie in the vocabulary")
        if params.stop and self.tokenizer is None:
            raise RequestError(invalid, "stop strings need a model with a tokenizer")
        sampling = pb.SamplingParams()
        sampling.CopyFrom(request.sampling)
        del sampling.stop[:]
        return PreparedRequest(request_id, prompt_token_ids, params, sampling, request.priority)

    def _traced_tokenize(self, request: pb.GenerateRequest, parent) -> list[int]:
        span = tracing.start_span("tokenize", parent, attributes={"baton.prompt.kind": request.WhichOneof("prompt") or ""})
        try:
            token_ids = self._tokenize(request)
        except RequestError as error:
            self._end_span(span, error)
            raise
        except Exception as error:  # a chat template that rejects the messages, say
            self._end_span(span, RequestError(grpc.StatusCode.UNKNOWN, repr(error)))
            raise
        if span is not None:
            span.set_attribute("baton.prompt.tokens", len(token_ids))
            span.end()
        return token_ids

    def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        which = request.WhichOneof("prompt")
        if which is None:
            raise RequestError(invalid, "set one of text, token_ids or messages")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if self.tokenizer is None:
            raise RequestError(invalid, "this model has no tokenizer: send token_ids")
        if which == "text":
            return self.tokenizer.encode(request.text) if request.text else []
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise RequestError(invalid, "messages is empty")
        for message in messages:
            if message["role"] not in CHAT_ROLES:
                raise RequestError(invalid, f"unknown chat role {message['role']!r}; use {', '.join(CHAT_ROLES)}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(invalid, "this model has no chat template: send text or token_ids")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateSyntaxError as error:  # the model's template is broken, not the request
            raise RequestError(grpc.StatusCode.INTERNAL, f"the model's chat template does not compile: {error}")
        except jinja2.TemplateError as error:  # raise_exception(...) in the template, or a missing field
            raise RequestError(invalid, f"the chat template rejects these messages: {error}") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    # ------------------------------------------------------------------- text
    async def _text_stream(self, prepared: PreparedRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Token events turned into text deltas (valid UTF-8, stop strings applied)."""
        params = prepared.params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prepared.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        num_output = 0
        token_times: list[float] = []
        outcome = "error"  # until it finishes or is cancelled
        events = self._token_events(prepared, context)
        try:
            async for event in events:
                num_output += len(event.token_ids)
                token_times.extend([time.monotonic()] * len(event.token_ids))
                message = pb.GenerateStreamResponse(
                    request_id=prepared.request_id, token_ids=event.token_ids, logprobs=event.logprobs
                )
                finish_reason = event.finish_reason
                if detokenizer is not None:
                    message.text = detokenizer.append(event.token_ids)
                    if detokenizer.stop_matched is not None:
                        finish_reason = pb.FINISH_REASON_STOP
                        message.stop_string = detokenizer.stop_matched
                    elif finish_reason:
                        message.text += detokenizer.flush()
                if finish_reason:
                    message.finish_reason = finish_reason
                    if event.stop_token_id is not None and not message.HasField("stop_string"):
                        message.stop_token_id = event.stop_token_id
                    message.usage.CopyFrom(
                        pb.Usage(prompt_tokens=len(prepared.prompt_token_ids), completion_tokens=num_output)
                    )
                    outcome = _FINISH_NAMES.get(finish_reason, "error")
                    yield message
                    return  # a stop string ends it here: closing `events` aborts the workers
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "abort"
            raise
        except RequestError as error:
            if error.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                outcome = "abort"
            raise
        finally:
            await events.aclose()
            if self.metrics is not None:
                self.metrics.record_request(
                    arrival=prepared.arrival, token_times=token_times, finished_at=time.monotonic(),
                    num_prompt_tokens=len(prepared.prompt_token_ids), finish_reason=outcome,
                )
            span = prepared.span
            if tracing.recording(span):
                span.set_attributes({
                    "gen_ai.response.model": self.info.model,
                    "gen_ai.response.finish_reasons": [outcome],
                    "gen_ai.usage.output_tokens": num_output,
                })
                if token_times:
                    span.set_attribute("baton.time_to_first_token_s", token_times[0] - prepared.arrival)

    # ----------------------------------------------------------------- routing
    async def _token_events(self, prepared: PreparedRequest, context) -> AsyncIterator[TokenEvent]:
        """Run the request on the workers; yields its tokens as they are produced."""
        work = worker_pb2.WorkRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=prepared.sampling,
            priority=prepared.priority,
        )
        num_prompt = len(prepared.prompt_token_ids)
        decode = self.pool.pick_decode(num_prompt + 1)
        if decode is None:
            await self.pool.refresh_decode()
            decode = self.pool.pick_decode(num_prompt + 1)
        if decode is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker is serving")
        prefill = self.pool.pick_prefill(num_prompt, decode)
        decode_request = worker_pb2.DecodeRequest(request=work)
        handle: worker_pb2.KvHandle | None = None
        span = prepared.span
        trace_metadata = tracing.metadata(span)
        if tracing.recording(span):
            span.set_attributes({
                "baton.route": "disaggregated" if prefill is not None else "colocated",
                "baton.decode_worker": decode.address,
            })
            if prefill is not None:
                span.set_attribute("baton.prefill_worker", prefill.address)
        if prefill is not None:
            response = await self._prefill(prefill, decode, work, context, trace_metadata)
            if response is None and tracing.recording(span):
                span.set_attribute("baton.route", "colocated")  # the prefill worker was unreachable
            if response is not None:
                self.num_disaggregated += 1
                first = TokenEvent(
                    [response.first_token_id],
                    [response.first_logprob] if response.HasField("first_logprob") else [],
                    response.finish_reason,
                )
                if response.finish_reason:
                    if response.finish_reason == pb.FINISH_REASON_STOP:
                        first.stop_token_id = response.first_token_id
                    yield first
                    return
                handle = response.kv_handle
                decode_request.first_token_id = response.first_token_id
                decode_request.kv_handle.CopyFrom(handle)
                # TTFT does not wait for the handoff: the first token goes out now.
                yield first
        if handle is None:
            self.num_colocated += 1
        async for event in self._decode(decode, decode_request, handle, context, trace_metadata):
            yield event

    async def _prefill(
        self, worker: Worker, decode: Worker, work, context, trace_metadata=None
    ) -> worker_pb2.PrefillResponse | None:
        """Prefill on `worker`; None if it is unreachable (the caller then runs colocated)."""
        call = worker.stub.Prefill(
            worker_pb2.PrefillRequest(request=work), timeout=context.time_remaining(), metadata=trace_metadata
        )
        worker.num_in_flight += 1
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                logger.warning("prefill worker %s unavailable; running %s colocated", worker.address,
                               work.request_id)
                self.pool.mark_down(worker)
                self.pool.prefill_moved(worker, decode, len(work.prompt_token_ids))
                return None
            raise RequestError(error.code(), error.details() or "prefill failed") from None
        finally:
            worker.num_in_flight -= 1
            if not call.done():  # cancelled while waiting: abort it on the worker
                call.cancel()

    async def _decode(self, worker: Worker, request, handle, context, trace_metadata=None) -> AsyncIterator[TokenEvent]:
        call = worker.stub.Decode(request, timeout=context.time_remaining(), metadata=trace_metadata)
        worker.num_in_flight += 1
        got_event = False
        try:
            async for event in call:
                got_event = True
                yield TokenEvent(
                    list(event.token_ids),
                    list(event.logprobs),
                    event.finish_reason,
                    event.stop_token_id if event.HasField("stop_token_id") else None,
                )
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(worker)
            raise RequestError(code, error.details() or "decode failed") from None
        finally:
            worker.num_in_flight -= 1
            if not call.done():
                call.cancel()  # the client went away or a stop string matched: abort on the worker
            if handle is not None and not got_event:
                # The decode side may never have pulled the KV: drop the lease now, not at expiry.
                self._spawn(self._release(handle, trace_metadata))

    async def _release(self, handle: worker_pb2.KvHandle, trace_metadata=None) -> None:
        for worker in self.pool.prefill:
            if worker.address == handle.prefill_address or worker.stats.worker_id == handle.prefill_worker_id:
                try:
                    await worker.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=handle.request_id),
                                                timeout=5, metadata=trace_metadata)
                except grpc.aio.AioRpcError:
                    pass
                return

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
