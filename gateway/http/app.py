"""The OpenAI HTTP API on the gateway: /v1/models, /v1/completions, /v1/chat/completions,
/health and /ready, served by uvicorn on the gateway's own event loop beside its gRPC
server, every request through the same GenerationService.generate a gRPC call takes (so
the same checks, admission, dispatch, tracing and metrics; only the names differ:
translate.py).

Streaming answers are server-sent events as OpenAI sends them (`data: {...}`, then
`data: [DONE]`). A client that goes away mid-request (streaming or not) cancels it, and
the cancellation aborts it on its workers as a gRPC cancel does. A request's deadline is
its `X-Request-Timeout` header (seconds; `inf`, none), which admission then plans by
(504 when it passes). With an API key, every /v1 route needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.wire.limits import MAX_REQUEST_BYTES
from baton.wire.records import GenerateRequest, TextDelta
from gateway.errors import RequestError
from gateway.http import protocol as api
from gateway.http import translate
from gateway.service import REQUEST_ID_HEADER, GenerationService, header_request_id

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"
_CLIENT_CLOSED = 499  # nginx's "client closed request": written to no one


class ClientGone(Exception):
    """The client closed its connection before the answer."""


def create_app(service: GenerationService, *, served_model_name: str | None = None,
               api_key: str | None = None, ready: Callable[[], bool] = lambda: True):
    """The API over `service` (loaded or not: until it is, /ready is 503 and requests 503),
    an ASGI app. `served_model_name`: the id /v1/models shows and requests must name
    (default: the model the workers serve)."""
    # A body over the gRPC port's message limit is refused (413) before it is read
    # (_BodyLimit by its Content-Length, FastAPI's own limit a chunked one). FastAPI's
    # own OpenTelemetry is off: the request's `generate` span (GenerationService) is the
    # gateway's, as for a gRPC call, not a child of a server span and its operation spans.
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None, max_body_size=MAX_REQUEST_BYTES,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    routes = _Routes(service, served_model_name, ready)
    app.get("/health")(routes.health)
    app.get("/ready")(routes.is_ready)
    app.get("/v1/models")(routes.models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    # The key first: a caller without it learns nothing of what else its request gets wrong.
    return _EchoRequestId(_RequireKey(_BodyLimit(app), api_key))


async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body FastAPI could not read into the route's model: 400, naming the first field at fault."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":  # its loc is a position in the text, not a field
        loc = []
    param = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:]) if loc else None
    chat = request.url.path.endswith("/chat/completions")
    message = f"{param or 'the body'}: {first.get('msg')}"
    return _error_response(translate.invalid(param or "body", message), chat=chat)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (413, an unknown route, a wrong method) in OpenAI's shape."""
    body = api.ErrorResponse(error=api.ErrorInfo(message=str(error.detail), type="invalid_request_error",
                                                 code=error.status_code))
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


class _Routes:
    """The API's routes, over one GenerationService."""

    def __init__(self, service: GenerationService, served_model_name: str | None, ready: Callable[[], bool]) -> None:
        self.service = service
        self.served_model_name = served_model_name
        self.ready = ready
        self.ids = itertools.count()
        self.prefix = uuid.uuid4().hex[:12]

    def model_name(self) -> str:
        return self.served_model_name or self.service.info.model

    def refusal(self, request: Request, model: str | None, *, chat: bool) -> JSONResponse | None:
        """The answer to a request refused before it runs: not started, another model."""
        if self.service.info is None:
            return _error_response(RequestError(grpc.StatusCode.UNAVAILABLE,
                                                "gateway is starting: no worker is serving yet"), chat=chat)
        if model is not None and model != self.model_name():
            return _error_response(RequestError(grpc.StatusCode.NOT_FOUND, f"the model {model!r} does not exist: "
                                                f"this server serves {self.model_name()!r}", field="model"),
                                   chat=chat)
        return None

    def received(self) -> None:
        if self.service.metrics is not None:
            self.service.metrics.received("http")

    def call(self, request: Request, path: str, kind: str, *, chat: bool) -> _Call:
        return _Call(self.service, request, path, f"{kind}-{self.prefix}{next(self.ids)}", self.model_name(),
                     chat=chat)

    async def health(self) -> Response:
        return Response(status_code=200)

    async def is_ready(self) -> Response:
        return Response(status_code=200 if self.service.info is not None and self.ready() else 503)

    async def models(self, request: Request):
        refused = self.refusal(request, None, chat=False)
        if refused is not None:
            return refused
        card = api.ModelCard(id=self.model_name(), max_model_len=self.service.info.max_context_length)
        return api.ModelList(data=[card])

    async def completions(self, body: api.CompletionRequest, request: Request):
        self.received()
        refused = self.refusal(request, body.model, chat=False)
        if refused is not None:
            return refused
        try:
            requests = translate.completion_requests(body)
            if len(requests) > 1:  # a batch is admitted whole, or refused whole (and nothing of it runs)
                self.service.check_room(sum(r.params.n for r in requests),
                                        "sampling.n" if requests[0].params.n > 1 else "prompt")
        except RequestError as error:
            return _error_response(error, chat=False)
        call = self.call(request, "/v1/completions", "cmpl", chat=False)
        if body.stream:
            return await call.stream(call.completion_chunks(requests, body.include_usage))
        return await call.answer(call.completion(requests))

    async def chat_completions(self, body: api.ChatCompletionRequest, request: Request):
        self.received()
        refused = self.refusal(request, body.model, chat=True)
        if refused is not None:
            return refused
        try:
            generate = translate.chat_request(body, self.service.info.max_context_length)
        except RequestError as error:
            return _error_response(error, chat=True)
        call = self.call(request, "/v1/chat/completions", "chatcmpl", chat=True)
        if body.stream:
            return await call.stream(call.chat_chunks(generate, body.include_usage))
        return await call.answer(call.chat(generate))


class _RequireKey:
    """The ASGI app in front of the others: with an API key, a /v1 request without it is
    answered 401 in OpenAI's shape before its body is read or checked."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if self.api_key is not None and scope["type"] == "http" and scope["path"].startswith("/v1") and \
                not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
            error = RequestError(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is needed: Authorization: "
                                 "Bearer <key>")
            await _error_response(error, chat=scope["path"].endswith("/chat/completions"))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, given: bytes) -> bool:
        scheme, _, token = given.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                                  self.api_key.encode())


class _BodyLimit:
    """The ASGI app in front of FastAPI's: a request whose Content-Length is over
    MAX_REQUEST_BYTES is answered 413 in OpenAI's shape, unread."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = next((value for key, value in scope["headers"] if key == b"content-length"), b"0")
            if length.isdigit() and int(length) > MAX_REQUEST_BYTES:
                body = api.ErrorResponse(error=api.ErrorInfo(
                    message=f"the request body has {int(length)} bytes; the limit is {MAX_REQUEST_BYTES}",
                    type="invalid_request_error", code=413))
                await JSONResponse(body.model_dump(), status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EchoRequestId:
    """The ASGI app in front of FastAPI's: a request's X-Request-Id (its id when it names
    none: GenerationService) comes back on its response, whatever the route or status."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        request_id = header_request_id((k.decode("latin-1"), v.decode("latin-1"))
                                       for k, v in scope.get("headers", ())) if scope["type"] == "http" else ""
        if not request_id:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _Call:
    """One HTTP request's run through the service."""

    def __init__(self, service: GenerationService, request: Request, route: str, response_id: str, model: str,
                 *, chat: bool) -> None:
        self.service = service
        self.request = request
        self.route = route
        self.id = response_id
        self.model = model
        self.is_chat = chat
        self.created = int(time.time())
        self.text = translate.TokenText(service.preparer.tokenizer if service.preparer is not None else None)
        self.deadline = None  # none, as for a header that is no number, or "inf"
        with contextlib.suppress(TypeError, ValueError):
            seconds = float(request.headers.get(TIMEOUT_HEADER))
            if math.isfinite(seconds):
                self.deadline = time.monotonic() + max(0.0, seconds)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextDelta]:
        def read() -> GenerateRequest:
            return request
        return self.service.generate(read, self.time_remaining, list(self.request.headers.items()), "openai",
                                     self.route, front="http")

    async def _race(self, awaitable: Awaitable):
        """`awaitable`'s result, or ClientGone (and `awaitable` cancelled: its workers
        aborted) if the client goes away first."""
        task = asyncio.ensure_future(awaitable)
        watcher = asyncio.ensure_future(self._disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, watcher):
                if not pending.done():
                    pending.cancel()
        if not task.done() or task.cancelled():
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
        return task.result()

    def _error(self, error: RequestError) -> JSONResponse:
        return _error_response(error, chat=self.is_chat)

    async def answer(self, answer: Awaitable) -> Response:
        """A whole answer, or its error; 499 (to no one) if the client went away."""
        try:
            return await self._race(answer)
        except RequestError as error:
            return self._error(error)
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)

    async def stream(self, events: AsyncIterator[str]) -> Response:
        """Server-sent `events`, once the first is ready (the request admitted, its first
        token out): a refusal before it is a status (429 with Retry-After, 400, ...), not
        an event in a 200 stream. Later errors are an error event, then the stream ends."""
        try:
            first = await self._race(anext(events))
        except RequestError as error:
            await events.aclose()
            return self._error(error)
        except ClientGone:
            await events.aclose()
            return Response(status_code=_CLIENT_CLOSED)

        async def rest() -> AsyncIterator[str]:
            try:
                yield first
                async for event in events:
                    yield event
            finally:
                await events.aclose()  # a client gone mid-stream: its request aborted now

        return StreamingResponse(rest(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _disconnected(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return

    async def _collect(self, request: GenerateRequest) -> list[TextDelta]:
        return [delta async for delta in self.generate(request)]

    # ------------------------------------------------------------ completions
    async def completion(self, requests: list[GenerateRequest]) -> api.CompletionResponse:
        """Prompt i's choice j is choice i * n + j, as OpenAI numbers them. One prompt's
        error ends the others at once: nobody would read them."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(r)) for r in requests]
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None
        results = [task.result() for task in tasks]
        choices = []
        for prompt_index, deltas in enumerate(results):
            params = requests[prompt_index].params
            for index in range(params.n):
                mine = [d for d in deltas if d.index == index]
                logprobs = None
                if params.logprobs is not None:
                    logprobs = translate.completion_logprobs([e for d in mine for e in d.logprobs], self.text, 0)
                choices.append(api.CompletionChoice(index=prompt_index * params.n + index,
                                                    text="".join(d.text for d in mine), logprobs=logprobs,
                                                    finish_reason=mine[-1].finish_reason,
                                                    prompt_logprobs=translate.prompt_logprobs(mine, self.text)))
        return api.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=translate.usage([d for deltas in results for d in deltas]))

    async def completion_chunks(self, requests: list[GenerateRequest], include_usage: bool) -> AsyncIterator[str]:
        lasts: list[TextDelta] = []
        offsets: dict[int, int] = {}  # by choice: the text streamed so far, for logprobs' text_offset

        def chunk(prompt_index: int, delta: TextDelta) -> str:
            params = requests[prompt_index].params
            index = prompt_index * params.n + delta.index
            logprobs = None
            if params.logprobs is not None:
                logprobs = translate.completion_logprobs(delta.logprobs, self.text, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(delta.text)
            choice = api.CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                          finish_reason=delta.finish_reason,
                                          prompt_logprobs=translate.prompt_logprobs([delta], self.text))
            return _event(api.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                                 choices=[choice]))

        started = False
        try:
            async for prompt_index, delta in _interleave([self._indexed(i, r) for i, r in enumerate(requests)]):
                if delta.finish_reason is not None:
                    lasts.append(delta)
                yield chunk(prompt_index, delta)
                started = True
        except RequestError as error:
            if not started:
                raise  # before the stream: a status (stream())
            yield self._error_event(error)
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _event(api.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                                usage=translate.usage(lasts)))
        yield "data: [DONE]\n\n"

    def _error_event(self, error: RequestError) -> str:
        _, body, _ = translate.error_body(error, chat=self.is_chat)
        return _event(body)

    async def _indexed(self, index: int, request: GenerateRequest) -> AsyncIterator[tuple[int, TextDelta]]:
        async for delta in self.generate(request):
            yield index, delta

    # ------------------------------------------------------------------- chat
    async def chat(self, request: GenerateRequest) -> api.ChatCompletionResponse:
        deltas = await self._collect(request)
        choices = []
        for index in range(request.params.n):
            mine = [d for d in deltas if d.index == index]
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = translate.chat_logprobs([e for d in mine for e in d.logprobs], self.text)
            message = api.ChatMessageOut(content="".join(d.text for d in mine))
            choices.append(api.ChatChoice(index=index, message=message, logprobs=logprobs,
                                          finish_reason=mine[-1].finish_reason))
        return api.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=translate.usage(deltas),
                                          prompt_logprobs=translate.prompt_logprobs(deltas, self.text))

    async def chat_chunks(self, request: GenerateRequest, include_usage: bool) -> AsyncIterator[str]:
        def chunk(index: int, delta: api.ChatDelta, finish_reason: str | None = None, logprobs=None) -> str:
            choice = api.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return _event(api.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                                  choices=[choice]))

        started: set[int] = set()  # the choices whose role chunk went out
        lasts: list[TextDelta] = []
        try:
            async for delta in self.generate(request):
                if delta.index not in started:  # each choice's role first, as OpenAI sends it
                    started.add(delta.index)
                    yield chunk(delta.index, api.ChatDelta(role="assistant", content=""))
                logprobs = translate.chat_logprobs(delta.logprobs, self.text) \
                    if request.params.logprobs is not None else None
                if delta.finish_reason is not None:
                    lasts.append(delta)
                yield chunk(delta.index, api.ChatDelta(content=delta.text), delta.finish_reason, logprobs)
        except RequestError as error:
            if not started:
                raise  # before the stream: a status (stream())
            yield self._error_event(error)
            yield "data: [DONE]\n\n"
            return
        if include_usage and lasts:
            yield _event(api.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                                 usage=translate.usage(lasts)))
        yield "data: [DONE]\n\n"


def _first_error(errors: BaseExceptionGroup) -> BaseException:
    """The error a batch ends with: its first RequestError that is not a sibling's
    cancellation, else its first error."""
    flat = list(_leaves(errors))
    return next((e for e in flat if isinstance(e, RequestError) and e.code != grpc.StatusCode.CANCELLED),
                next((e for e in flat if isinstance(e, RequestError)), flat[0]))


def _leaves(errors: BaseExceptionGroup):
    for error in errors.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


def _error_response(error: RequestError, *, chat: bool) -> JSONResponse:
    status, body, headers = translate.error_body(error, chat=chat)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _event(body) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def _interleave(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come; all closed when this ends."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            await queue.put(error)
            return
        await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
