"""A client's request made ready to run: checked against the model and the gateway's
limits (baton/wire/limits.py), tokenized.

Every problem is a RequestError with a status the client can act on: INVALID_ARGUMENT
for anything wrong with the request itself (OUT_OF_RANGE for a prompt longer than the
model's context), naming the field at fault by its path in baton.v1.GenerateRequest.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field, replace

import grpc
import jinja2

from baton.runtime import tracing
from baton.wire.records import FieldError, GenerateRequest, ModelInfo, WorkRequest
from engine.sampling_params import SamplingParams
from gateway.errors import RequestError
from baton.wire.limits import (
    CHAT_ROLES,
    MAX_ABS_PRIORITY,
    MAX_CHARS_PER_TOKEN,
    MAX_NUM_MESSAGES,
    MAX_REQUEST_ID_LENGTH,
    check_sampling,
)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_PROMPT_FIELDS = {"text": "text", "token_ids": "token_ids.ids", "messages": "messages.messages"}


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request. `params` keeps the stop strings, which only the
    gateway applies; the workers get the rest (`work()`). `kv_token` is the secret that
    owns the request's KV on its prefill worker: only a caller that presents it may
    release or pull that KV (the gateway, and the decode worker it hands it to)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    max_model_len: int  # the served model's: the length rule's bound on prompt and output tokens
    arrival: float = field(default_factory=time.monotonic)  # for the latency metrics
    span: object | None = None  # its `generate` span (None: tracing off)
    # The id the workers know it by (None: request_id): unique among every gateway's
    # requests, where a client's own id need only be unique among its gateway's.
    worker_request_id: str | None = None
    kv_token: str = field(default_factory=lambda: secrets.token_hex(16))  # 128 random bits
    prompt_field: str = "token_ids.ids"  # the client's prompt, as a worker's refusal of it names it
    deadline: float | None = None  # its call's deadline, time.monotonic() seconds (None: none)
    outcome: str | None = None  # once it ended: its finish reason, "abort", "deadline" or "error"

    def work(self) -> WorkRequest:
        return WorkRequest(self.worker_request_id or self.request_id, self.prompt_token_ids,
                           replace(self.params, stop=None), self.priority, kv_token=self.kv_token)


class RequestPreparer:
    """Checks requests against the served model and tokenizes them with its tokenizer
    (None: the model has none, and only token ids are accepted)."""

    def __init__(self, tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def prepare(self, request: GenerateRequest, request_id: str, span=None) -> PreparedRequest:
        try:
            _check_request(request, request_id, self.info.vocab_size)
        except FieldError as error:
            raise RequestError.invalid(error) from None
        if request.params.stop and self.tokenizer is None:
            raise RequestError(_INVALID, "stop strings need a model with a tokenizer", field="sampling.stop")
        prompt_token_ids = self._traced_tokenize(request, span)
        self._check_tokens(prompt_token_ids, _PROMPT_FIELDS[request.prompt_kind])
        return PreparedRequest(request_id, prompt_token_ids, request.params, request.priority,
                               self.info.max_context_length, span=span,
                               prompt_field=_PROMPT_FIELDS[request.prompt_kind])

    def _check_tokens(self, prompt_token_ids: list[int], prompt_field: str) -> None:
        if not prompt_token_ids:
            raise RequestError(_INVALID, "the prompt is empty", field=prompt_field)
        vocab_size = self.info.vocab_size
        if max(prompt_token_ids) >= vocab_size:  # max at C speed: a long prompt is checked on the event loop
            index, token_id = next((i, t) for i, t in enumerate(prompt_token_ids) if t >= vocab_size)
            raise RequestError(_INVALID, f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                               field=f"{prompt_field}[{index}]" if prompt_field == "token_ids.ids" else prompt_field)
        max_len = self.info.max_context_length
        if len(prompt_token_ids) >= max_len:
            raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                               f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is {max_len - 1}",
                               field=prompt_field)

    def _check_length(self, num_chars: int, max_chars: int, prompt_field: str) -> None:
        if num_chars > max_chars:
            raise RequestError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{prompt_field} has {num_chars} characters; a prompt of the model's context "
                f"({self.info.max_context_length} tokens) has at most {max_chars}",
                field=prompt_field,
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
        if kind == "token_ids":
            return list(request.prompt)
        if self.tokenizer is None:
            raise RequestError(_INVALID, "this model has no tokenizer: send token_ids", field=kind)
        max_chars = self.info.max_context_length * MAX_CHARS_PER_TOKEN
        if kind == "text":
            self._check_length(len(request.prompt), max_chars, "text")
            return self.tokenizer.encode(request.prompt) if request.prompt else []
        messages = [{"role": m.role, "content": m.content} for m in request.prompt]
        self._check_length(sum(len(m["content"]) for m in messages), max_chars, "messages.messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(_INVALID, "this model has no chat template: send text or token_ids", field="messages")
        return self._encode_chat(messages)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation's token ids, each message's content encoded as text: a special
        token written in a message ("<|im_end|>") stays those characters, not the control
        token, so no message can end its turn and speak as another role. The template is
        rendered with a placeholder for each content; its own parts are encoded as the
        tokenizer does (their special tokens are control tokens), each content with
        special tokens split."""
        marker = secrets.token_hex(8)  # unguessable: no content can contain a placeholder
        placeholders = [{"role": m["role"], "content": f"{marker}{index}{marker}"} for index, m in enumerate(messages)]
        try:
            rendered = self.tokenizer.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateSyntaxError as error:  # the model's template is broken, not the request
            raise RequestError(grpc.StatusCode.INTERNAL, f"the model's chat template does not compile: {error}")
        except Exception as error:  # raise_exception(...) in the template, a missing field, a type error
            raise RequestError(_INVALID, f"the chat template rejects these messages: {error}",
                               field="messages") from None
        encode = self.tokenizer.encode
        token_ids: list[int] = []
        # re.split with a group: template text, content index, template text, ...
        for position, part in enumerate(re.split(f"{marker}(\\d+){marker}", rendered)):
            if position % 2:
                token_ids += encode(messages[int(part)]["content"], add_special_tokens=False,
                                    split_special_tokens=True)
            elif part:
                token_ids += encode(part, add_special_tokens=False)
        return token_ids


def _check_request(request: GenerateRequest, request_id: str, vocab_size: int) -> None:
    """The request limits (baton/wire/limits.py) on what the engine's SamplingParams do not bound;
    FieldError naming the first field at fault."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise FieldError("request_id", f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
    if not request_id.isprintable():
        raise FieldError("request_id", "request_id has non-printable characters")
    if abs(request.priority) > MAX_ABS_PRIORITY:
        raise FieldError("priority", f"priority must lie in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}]")
    kind = request.prompt_kind
    if kind is None:
        raise FieldError("prompt", "set one of text, token_ids or messages")
    if kind == "messages":
        _check_messages(request.prompt)
    _check_sampling(request.params, vocab_size)


def _check_messages(messages) -> None:
    if not messages:
        raise FieldError("messages.messages", "messages is empty")
    if len(messages) > MAX_NUM_MESSAGES:
        raise FieldError("messages.messages", f"more than {MAX_NUM_MESSAGES} messages")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise FieldError(f"messages.messages[{index}].role",
                             f"unknown chat role {message.role[:32]!r}; use {', '.join(CHAT_ROLES)}")


def _check_sampling(params: SamplingParams, vocab_size: int) -> None:
    check_sampling(params)
    for name, token_ids in params.token_id_fields():
        for index, token_id in enumerate(token_ids):
            if token_id >= vocab_size:
                # A map's entries are named by their key, a list's by position.
                where = f"sampling.{name}[{token_id if name == 'logit_bias' else index}]"
                raise FieldError(where, f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
