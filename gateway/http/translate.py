"""OpenAI requests as the gateway's records, its text deltas as OpenAI's answers, and its
errors in OpenAI's shape.

A request is read into the same GenerateRequest a gRPC call is (convert.py's), so the
checks, admission and the stream behind it are the same; only names differ. A field at
fault is named as the client sent it: gRPC's `sampling.max_tokens` is `max_tokens`,
`token_ids.ids[3]` and `text` are `prompt`, `messages.messages[2].role` is
`messages[2].role` (PARAMS).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields

import grpc

from baton.wire.records import ChatMessage, GenerateRequest, TextDelta, TokenLogprobs
from engine.sampling_params import SamplingParamError, SamplingParams
from engine.structured_output import StructuredOutput, StructuredOutputError
from gateway.errors import RequestError
from gateway.http import protocol as api

_DEFAULTS = SamplingParams()

# What a client asks for that Baton does not serve yet: refused, never ignored. Each
# holds when the field asks for something (n=1 or a zero penalty asks for nothing).
UNSUPPORTED = {
    "best_of": lambda v: v is not None and v != 1,
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
}

# gRPC field paths (the gateway's checks name them so) as the OpenAI request's.
_PARAMS = [
    (re.compile(r"^token_ids\.ids(\[\d+\])?$"), "prompt"),
    (re.compile(r"^text$"), "prompt"),
    (re.compile(r"^messages\.messages"), "messages"),
    (re.compile(r"^sampling\.(json_schema|json_object)"), "response_format"),
    (re.compile(r"^sampling\.(regex|choice|grammar)"), r"structured_outputs.\1"),
    (re.compile(r"^sampling\."), ""),
]

# gRPC codes as HTTP statuses and OpenAI error types.
_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def param_name(field: str, *, chat: bool) -> str:
    """A gRPC field path as the OpenAI request names it."""
    for pattern, replacement in _PARAMS:
        if pattern.search(field):
            field = pattern.sub(replacement, field, count=1)
            break
    if field == "logprobs" and chat:
        return "top_logprobs"
    return field


def error_body(error: RequestError, *, chat: bool) -> tuple[int, api.ErrorResponse, dict[str, str]]:
    """A RequestError as (HTTP status, OpenAI error body, headers): Retry-After with a retry hint."""
    status, kind = _STATUSES.get(error.code, (500, "server_error"))
    violations = error.error_details.field_violations
    param = param_name(violations[0][0], chat=chat) if violations else None
    message = error.details
    for field, _ in violations:  # the message names the field as the client sent it too
        message = message.replace(field, param_name(field, chat=chat))
    headers = {}
    if error.error_details.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.error_details.retry_after_s)))
    body = api.ErrorResponse(error=api.ErrorInfo(message=message, type=kind, param=param,
                                                 code=error.code.name.lower()))
    return status, body, headers


def invalid(param: str, message: str) -> RequestError:
    """A bad request whose param is already the client's name for it."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field=param)


def check_supported(body: api.CompletionRequest | api.ChatCompletionRequest) -> None:
    for name, asks in UNSUPPORTED.items():
        if name in type(body).model_fields and asks(getattr(body, name)):
            raise invalid(name, f"{name} is not supported yet")


# SamplingParams' fields that an OpenAI body (protocol.py) carries under their own names;
# the others are read apart (max_tokens and logprobs have other names in a chat body). A
# stop string alone, as OpenAI allows, SamplingParams takes as it takes a list.
_PARAMS_BY_NAME = tuple(f.name for f in fields(SamplingParams)
                        if f.name not in ("max_tokens", "logprobs", "structured_output"))


def sampling(body: api.CompletionRequest | api.ChatCompletionRequest, max_tokens: int | None,
             logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams; a bad value names its field."""
    chosen = {name: getattr(body, name) for name in _PARAMS_BY_NAME}
    chosen.update(max_tokens=max_tokens, logprobs=logprobs)
    try:
        return SamplingParams(**{k: v for k, v in chosen.items() if v is not None},
                              structured_output=structured_output(body))
    except SamplingParamError as error:
        name = "top_logprobs" if error.name == "logprobs" and isinstance(body, api.ChatCompletionRequest) \
            else error.name
        raise invalid(name, str(error)) from None


def structured_output(body: api.CompletionRequest | api.ChatCompletionRequest) -> StructuredOutput | None:
    """The output's constraint: OpenAI's response_format, vLLM's structured_outputs, or its
    older guided_json / guided_regex / guided_choice / guided_grammar; at most one."""
    asked = []
    response_format = body.response_format
    if response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise invalid("response_format", "response_format.json_schema.schema must be a JSON schema object")
            asked.append(("response_format", {"json_schema": json.dumps(schema)}))
        elif kind != "text":
            raise invalid("response_format", f"response_format type {str(kind)[:32]!r} is not one of text, "
                          "json_object, json_schema")
    vllm = dict(body.structured_outputs or {})
    pretty = bool(vllm.pop("pretty_json", False) or body.pretty_json)
    older = {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice,
             "grammar": body.guided_grammar}
    vllm.update({name: value for name, value in older.items() if value is not None})
    for name, value in vllm.items():
        if value in (None, False):
            continue
        if name == "json":
            asked.append(("structured_outputs.json", {"json_schema": value if isinstance(value, str)
                                                      else json.dumps(value)}))
        elif name in ("regex", "choice", "grammar", "json_object"):
            asked.append((f"structured_outputs.{name}", {name: value}))
        else:
            raise invalid(f"structured_outputs.{name}", f"unknown structured output {name[:32]!r}")
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(asked[1][0], f"ask for one structured output, not {', '.join(name for name, _ in asked)}")
    param, fields = asked[0]
    try:
        return StructuredOutput(**fields, pretty_json=pretty)
    except StructuredOutputError as error:
        raise invalid(param, str(error)) from None


def completion_requests(body: api.CompletionRequest) -> list[GenerateRequest]:
    """One GenerateRequest per prompt of a completion request (a list of prompts: a batch)."""
    check_supported(body)
    params = sampling(body, body.max_tokens if body.max_tokens is not None else _DEFAULTS.max_tokens,
                      body.logprobs)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [("text", prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [("token_ids", tuple(prompt))]
    elif prompt:
        prompts = [("text", p) if isinstance(p, str) else ("token_ids", tuple(p)) for p in prompt]
    else:
        raise invalid("prompt", "the prompt is empty")
    base = body.request_id or ""
    return [GenerateRequest(f"{base}-{i}" if base and len(prompts) > 1 else base, kind, text, params,
                            body.priority or 0) for i, (kind, text) in enumerate(prompts)]


def chat_request(body: api.ChatCompletionRequest, max_model_len: int) -> GenerateRequest:
    """A chat request's GenerateRequest: its messages' text (a list of parts: the text
    parts joined by newlines; any other part refused). Without max_tokens it may run to
    the model's context, as OpenAI's chat does."""
    check_supported(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    params = sampling(body, max_tokens if max_tokens is not None else max_model_len, logprobs)
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{index}].content[{part_index}].type",
                                  f"content parts of type {part.type!r} are not supported: send text")
                texts.append(part.text)
            content = "\n".join(texts)
        messages.append(ChatMessage(message.role, content or ""))
    return GenerateRequest(body.request_id or "", "messages", tuple(messages), params, body.priority or 0)


# ------------------------------------------------------------------ answers
class TokenText:
    """Token ids as the strings logprobs show (`token_id:<id>` without a tokenizer, as vLLM)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def chat_logprobs(entries: list[TokenLogprobs], text: TokenText) -> api.ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return api.ChatLogprobs(content=[
        api.TokenLogprob(**entry(e.token_id, e.logprob),
                         top_logprobs=[api.TopLogprob(**entry(t, lp)) for t, lp in e.top_logprobs])
        for e in entries])


def completion_logprobs(entries: list[TokenLogprobs], text: TokenText, offset: int) -> api.CompletionLogprobs:
    """`entries` in the legacy completions shape, their text starting at `offset`."""
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return api.CompletionLogprobs(
        tokens=tokens, token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{text(t): lp for t, lp in e.top_logprobs} for e in entries], text_offset=offsets)


def prompt_logprobs(deltas: list[TextDelta], text: TokenText) -> list[dict | None] | None:
    """The prompt logprobs the deltas carry, as vLLM writes them: None for the first prompt
    token, then per token {id: {logprob, rank, decoded_token}} for it and its alternatives."""
    entries = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for entry in entries:
        ranked = {token_id: rank for rank, (token_id, _) in enumerate(entry.top_logprobs, 1)}
        alternatives = {str(t): {"logprob": lp, "rank": ranked[t], "decoded_token": text(t)}
                        for t, lp in entry.top_logprobs}
        alternatives[str(entry.token_id)] = {"logprob": entry.logprob, "rank": ranked.get(entry.token_id),
                                             "decoded_token": text(entry.token_id)}
        out.append(alternatives)
    return out


def usage(deltas: list[TextDelta]) -> api.Usage:
    """The usage of finished requests (their streams' last deltas, which carry it): the
    prompt tokens of each, once however many choices it had."""
    deltas = [d for d in deltas if d.has_usage]
    prompt = sum(d.num_prompt_tokens for d in deltas)
    completion = sum(d.num_completion_tokens for d in deltas)
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=api.PromptTokensDetails(
                         cached_tokens=sum(d.num_cached_tokens for d in deltas),
                         host_cached_tokens=sum(d.num_host_cached_tokens for d in deltas)))
