"""A client's request made ready to run: checked against the model, tokenized.

Every problem is a RequestError with a status the client can act on: INVALID_ARGUMENT
with the reason for anything wrong with the request itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import grpc
import jinja2

from baton.runtime import tracing
from baton.wire.records import GenerateRequest, ModelInfo, WorkRequest
from engine.sampling_params import SamplingParams
from gateway.errors import RequestError

MAX_REQUEST_ID_LENGTH = 256
# Characters of prompt text (or of all chat contents) per token of the model's context
# that the gateway will tokenize at most: far past any real tokenizer's average, so no
# prompt that could fit is refused, while a prompt far too long for the context is
# refused before it costs seconds of tokenizing.
MAX_CHARS_PER_TOKEN = 32
CHAT_ROLES = ("system", "user", "assistant")
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request. `params` keeps the stop strings, which only the
    gateway applies; the workers get the rest (`work()`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float = field(default_factory=time.monotonic)  # for the latency metrics
    span: object | None = None  # its `generate` span (None: tracing off)
    # The id the workers know it by (None: request_id): unique among every gateway's
    # requests, where a client's own id need only be unique among its gateway's.
    worker_request_id: str | None = None

    def work(self) -> WorkRequest:
        return WorkRequest(self.worker_request_id or self.request_id, self.prompt_token_ids,
                           replace(self.params, stop=None), self.priority)


class RequestPreparer:
    """Checks requests against the served model and tokenizes them with its tokenizer
    (None: the model has none, and only token ids are accepted)."""

    def __init__(self, tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def prepare(self, request: GenerateRequest, request_id: str, span=None) -> PreparedRequest:
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise RequestError(_INVALID, f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
        prompt_token_ids = self._traced_tokenize(request, span)
        self._check_tokens(prompt_token_ids, request.params)
        return PreparedRequest(request_id, prompt_token_ids, request.params, request.priority, span=span)

    def _check_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestError(_INVALID, "the prompt is empty")
        vocab_size = self.info.vocab_size
        bad = [t for t in prompt_token_ids if t >= vocab_size]
        if bad:
            raise RequestError(_INVALID, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        max_len = self.info.max_context_length
        if len(prompt_token_ids) >= max_len:
            raise RequestError(
                _INVALID, f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is {max_len - 1}"
            )
        if any(t >= vocab_size for t in params.stop_token_ids or ()):
            raise RequestError(_INVALID, "stop_token_ids must lie in the vocabulary")
        if params.stop and self.tokenizer is None:
            raise RequestError(_INVALID, "stop strings need a model with a tokenizer")

    def _check_length(self, num_chars: int, max_chars: int, what: str) -> None:
        if num_chars > max_chars:
            raise RequestError(
                _INVALID,
                f"{what} has {num_chars} characters; a prompt of the model's context "
                f"({self.info.max_context_length} tokens) has at most {max_chars}",
            )

    def _traced_tokenize(self, request: GenerateRequest, parent) -> list[int]:
        span = tracing.start_span("tokenize", parent, attributes={"baton.prompt.kind": request.prompt_kind or ""})
        try:
            token_ids = self._tokenize(request)
        except RequestError as error:
            tracing.end_span(span, error.code, error.details)
            raise
        except Exception as error:
            tracing.end_span(span, grpc.StatusCode.UNKNOWN, repr(error))
            raise
        if span is not None:
            span.set_attribute("baton.prompt.tokens", len(token_ids))
            span.end()
        return token_ids

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        kind = request.prompt_kind
        if kind is None:
            raise RequestError(_INVALID, "set one of text, token_ids or messages")
        if kind == "token_ids":
            return list(request.prompt)
        if self.tokenizer is None:
            raise RequestError(_INVALID, "this model has no tokenizer: send token_ids")
        max_chars = self.info.max_context_length * MAX_CHARS_PER_TOKEN
        if kind == "text":
            self._check_length(len(request.prompt), max_chars, "text")
            return self.tokenizer.encode(request.prompt) if request.prompt else []
        messages = [{"role": m.role, "content": m.content} for m in request.prompt]
        if not messages:
            raise RequestError(_INVALID, "messages is empty")
        self._check_length(sum(len(m["content"]) for m in messages), max_chars, "the messages' contents")
        for message in messages:
            if message["role"] not in CHAT_ROLES:
                raise RequestError(_INVALID, f"unknown chat role {message['role']!r}; use {', '.join(CHAT_ROLES)}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(_INVALID, "this model has no chat template: send text or token_ids")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateSyntaxError as error:  # the model's template is broken, not the request
            raise RequestError(grpc.StatusCode.INTERNAL, f"the model's chat template does not compile: {error}")
        except jinja2.TemplateError as error:  # raise_exception(...) in the template, or a missing field
            raise RequestError(_INVALID, f"the chat template rejects these messages: {error}") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)
