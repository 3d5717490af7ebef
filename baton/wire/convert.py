"""Protobuf messages to records and back: the only module that builds or reads them
(with kv_convert.py for the KV handoff's control and stats_convert.py for stats),
besides the servicers' and clients' handing them to grpc.

Functions come in pairs, `<record>_to_pb` and `<record>_from_pb`. A `_from_pb` that
meets a value the record cannot hold raises FieldError (a ValueError) naming the field
by its path in the message read ("sampling.temperature", "kv_handle.num_blocks"), and
the servicer answers INVALID_ARGUMENT with a google.rpc.BadRequest; a malformed KV
layout raises KvLayoutMismatchError (a ValueError too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from baton.wire.internal.v1 import worker_pb2
from baton.wire.kv_convert import check_kv_token, kv_handle_from_pb, kv_handle_to_pb
from baton.wire.limits import check_sampling
from baton.wire.records import (
    ChatMessage,
    DecodeRequest,
    FieldError,
    GenerateRequest,
    ModelInfo,
    PrefillResult,
    TextDelta,
    TokenEvent,
    WorkRequest,
)
from baton.wire.v1 import generation_pb2 as pb
from engine.outputs import LoadReport, TokenLogprobs
from engine.sampling_params import SamplingParamError, SamplingParams
from engine.structured_output import KINDS as STRUCTURED_KINDS
from engine.structured_output import StructuredOutput, StructuredOutputError

_FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_FINISH_NAMES = {value: name for name, value in _FINISH_REASONS.items()}

# Empty requests, shared (a message is only read by grpc).
GET_STATS = worker_pb2.GetStatsRequest()
GET_MODEL_INFO = pb.GetModelInfoRequest()



# ------------------------------------------------------------------ basics
def finish_reason_to_pb(reason: str | None) -> int:
    """The engine's finish reason ("stop", "length", None) as the wire enum."""
    return _FINISH_REASONS[reason]


def finish_reason_from_pb(value: int) -> str | None:
    return _FINISH_NAMES.get(value)


def sampling_params_from_pb(message: pb.SamplingParams, *, with_stop_strings: bool = True,
                            field: str = "sampling") -> SamplingParams:
    """Engine SamplingParams from the wire; unset optional fields take the defaults.

    Raises FieldError ("`field`.temperature", with the engine's message) on out-of-range
    values, NaN and infinities.
    """
    try:
        return _sampling_params_from_pb(message, with_stop_strings)
    except (SamplingParamError, StructuredOutputError) as error:
        raise FieldError(f"{field}.{error.name}", str(error)) from None


# Every field of SamplingParams but its structured output (a oneof of kinds, and pretty_json)
# is the message's field of the same name, copied by name: a field added to both travels
# with no line here (tests/api/test_wire_records.py holds the two lists together).
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "structured_output")
_PB_PARAM_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name


def _sampling_params_from_pb(message: pb.SamplingParams, with_stop_strings: bool) -> SamplingParams:
    values = {}
    for name in _PARAM_FIELDS:
        descriptor = _PB_PARAM_FIELDS[name]
        if descriptor.has_presence:  # optional: unset takes the default
            if message.HasField(name):
                values[name] = getattr(message, name)
        elif descriptor.is_repeated:  # empty takes the default
            if value := getattr(message, name):
                values[name] = dict(value) if descriptor.message_type is not None else list(value)
        else:
            values[name] = getattr(message, name)
    if not with_stop_strings:
        values.pop("stop", None)
    return SamplingParams(**values, structured_output=_structured_output_from_pb(message))


def _structured_output_from_pb(message: pb.SamplingParams) -> StructuredOutput | None:
    kind = message.WhichOneof("structured_output")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    value = tuple(message.choice.choices) if kind == "choice" else getattr(message, kind)
    return StructuredOutput(**{kind: value}, pretty_json=message.pretty_json)


def sampling_params_to_pb(params: SamplingParams, *, with_stop_strings: bool = True) -> pb.SamplingParams:
    """Every field set explicitly (None stays unset), so the other side reads exactly `params`."""
    message = pb.SamplingParams()
    for name in _PARAM_FIELDS:
        value = getattr(params, name)
        if value is None or (name == "stop" and not with_stop_strings):
            continue
        descriptor = _PB_PARAM_FIELDS[name]
        if descriptor.is_repeated and descriptor.message_type is not None:  # a map: (key, value) pairs
            getattr(message, name).update(value)
        elif descriptor.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    structured = params.structured_output
    if structured is not None:
        kind = structured.kind
        if kind == "choice":
            message.choice.choices.extend(structured.choice)
        else:
            setattr(message, kind, getattr(structured, kind))
        message.pretty_json = structured.pretty_json
    return message


def logprobs_to_pb(entries: Sequence[TokenLogprobs] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top_logprobs],
        )
        for entry in entries or ()
    ]


def logprobs_from_pb(messages: Iterable[pb.TokenLogprob]) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top_logprobs))
        for m in messages
    ]


# ------------------------------------------------------------------ public API
def generate_request_from_pb(message: pb.GenerateRequest) -> GenerateRequest:
    """A client's request, read; FieldError if its sampling is out of range."""
    kind = message.WhichOneof("prompt")
    prompt: str | tuple = ()
    if kind == "text":
        prompt = message.text
    elif kind == "token_ids":
        prompt = tuple(message.token_ids.ids)
    elif kind == "messages":
        prompt = tuple(ChatMessage(m.role, m.content) for m in message.messages.messages)
    params = sampling_params_from_pb(message.sampling)
    return GenerateRequest(message.request_id, kind, prompt, params, message.priority)


def generate_request_to_pb(request: GenerateRequest) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        request_id=request.request_id, sampling=sampling_params_to_pb(request.params), priority=request.priority
    )
    if request.prompt_kind == "text":
        message.text = request.prompt
    elif request.prompt_kind == "token_ids":
        message.token_ids.ids.extend(request.prompt)
    elif request.prompt_kind == "messages":
        message.messages.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in request.prompt)
    return message


def text_delta_to_pb(delta: TextDelta) -> pb.GenerateStreamResponse:
    message = pb.GenerateStreamResponse(
        request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text,
        logprobs=logprobs_to_pb(delta.logprobs), finish_reason=finish_reason_to_pb(delta.finish_reason),
        index=delta.index, prompt_logprobs=logprobs_to_pb(delta.prompt_logprobs),
    )
    _set_stop_reason(message, delta)
    if delta.has_usage:
        message.usage.CopyFrom(pb.Usage(prompt_tokens=delta.num_prompt_tokens,
                                        completion_tokens=delta.num_completion_tokens,
                                        cached_tokens=delta.num_cached_tokens,
                                        host_cached_tokens=delta.num_host_cached_tokens))
    return message


def completion_to_pb(deltas: Sequence[TextDelta]) -> pb.GenerateResponse:
    """A unary Generate answer: a stream's deltas joined, by choice (the stream's last
    delta has the usage)."""
    last = deltas[-1]
    choices = [_choice_to_pb(index, [d for d in deltas if d.index == index])
               for index in sorted({delta.index for delta in deltas})]
    first = choices[0]
    message = pb.GenerateResponse(
        request_id=last.request_id, text=first.text, token_ids=first.token_ids, logprobs=first.logprobs,
        finish_reason=first.finish_reason,
        prompt_logprobs=logprobs_to_pb(next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)),
        usage=pb.Usage(prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_completion_tokens,
                       cached_tokens=last.num_cached_tokens, host_cached_tokens=last.num_host_cached_tokens),
    )
    stop_reason = first.WhichOneof("stop_reason")
    if stop_reason is not None:
        setattr(message, stop_reason, getattr(first, stop_reason))
    if len(choices) > 1:
        message.choices.extend(choices)
    return message


def _choice_to_pb(index: int, deltas: Sequence[TextDelta]) -> pb.Choice:
    """One choice's deltas joined (its last one finished it)."""
    choice = pb.Choice(
        index=index,
        text="".join(delta.text for delta in deltas),
        token_ids=[t for delta in deltas for t in delta.token_ids],
        logprobs=logprobs_to_pb([entry for delta in deltas for entry in delta.logprobs]),
        finish_reason=finish_reason_to_pb(deltas[-1].finish_reason),
    )
    _set_stop_reason(choice, deltas[-1])
    return choice


def _set_stop_reason(message, delta: TextDelta) -> None:
    if delta.stop_string is not None:
        message.stop_string = delta.stop_string
    elif delta.stop_token_id is not None:
        message.stop_token_id = delta.stop_token_id


def text_delta_from_pb(message: pb.GenerateStreamResponse | pb.GenerateResponse) -> TextDelta:
    """A stream message, or a whole unary answer as one delta."""
    which = message.WhichOneof("stop_reason")
    return TextDelta(
        request_id=message.request_id,
        token_ids=list(message.token_ids),
        text=message.text,
        logprobs=logprobs_from_pb(message.logprobs),
        finish_reason=finish_reason_from_pb(message.finish_reason),
        stop_string=message.stop_string if which == "stop_string" else None,
        stop_token_id=message.stop_token_id if which == "stop_token_id" else None,
        num_prompt_tokens=message.usage.prompt_tokens,
        num_completion_tokens=message.usage.completion_tokens,
        num_cached_tokens=message.usage.cached_tokens,
        num_host_cached_tokens=message.usage.host_cached_tokens,
        index=message.index if isinstance(message, pb.GenerateStreamResponse) else 0,
        prompt_logprobs=logprobs_from_pb(message.prompt_logprobs) or None,
    )


def model_info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    load = info.load
    return pb.ModelInfo(model=info.model, max_context_length=info.max_context_length, vocab_size=info.vocab_size,
                        eos_token_ids=list(info.eos_token_ids), has_chat_template=info.has_chat_template,
                        load=None if load is None else pb.ModelLoad(
                            format=load.format, source=load.source, files=load.num_files, tensors=load.num_tensors,
                            bytes=load.num_bytes, seconds=load.seconds, bytes_per_second=load.bytes_per_second))


def model_info_from_pb(message: pb.ModelInfo) -> ModelInfo:
    load = message.load
    return ModelInfo(message.model, message.max_context_length, message.vocab_size, tuple(message.eos_token_ids),
                     message.has_chat_template,
                     LoadReport(load.format, load.source, load.files, load.tensors, load.bytes, load.seconds)
                     if message.HasField("load") else None)


# ------------------------------------------------------- gateway to workers
def work_request_to_pb(work: WorkRequest) -> worker_pb2.WorkRequest:
    return worker_pb2.WorkRequest(
        request_id=work.request_id,
        prompt_token_ids=work.prompt_token_ids,
        sampling=sampling_params_to_pb(work.params, with_stop_strings=False),
        priority=work.priority,
        num_generated_tokens=work.num_generated_tokens,
        attempt=work.attempt,
    )


def work_request_from_pb(message: worker_pb2.WorkRequest, kv_token: str = "") -> WorkRequest:
    """FieldError ("request.sampling.top_p") if its sampling is out of range or past the
    request limits (the gateway's, checked again here: a caller of a worker's port need
    not be a gateway), or it claims more generated tokens than its prompt has."""
    if message.num_generated_tokens >= max(len(message.prompt_token_ids), 1):
        raise FieldError("request.num_generated_tokens",
                         f"{message.num_generated_tokens} generated tokens need a longer prompt than "
                         f"{len(message.prompt_token_ids)} tokens")
    params = sampling_params_from_pb(message.sampling, with_stop_strings=False, field="request.sampling")
    check_sampling(params, "request.sampling")
    return WorkRequest(
        request_id=message.request_id,
        prompt_token_ids=list(message.prompt_token_ids),
        params=params,
        priority=message.priority,
        num_generated_tokens=message.num_generated_tokens,
        kv_token=kv_token,
        attempt=message.attempt,
    )


# A request's attributes as the engine names them (InvalidRequestError.name), by their
# paths in a Prefill's or a Decode's request message.
_WORK_REQUEST_FIELDS = {
    "request_id": "request.request_id",
    "prompt_token_ids": "request.prompt_token_ids",
    **{f"sampling_params.{name}": f"request.sampling.{name}" for name in (*_PARAM_FIELDS, "structured_output",
                                                                        *STRUCTURED_KINDS)},
    "first_token_id": "first_token_id",
}


def work_request_field(name: str, index: int | None = None) -> str | None:
    """The path in a PrefillRequest or DecodeRequest of the request attribute the engine
    calls `name` ("prompt_token_ids", index 5: "request.prompt_token_ids[5]"); None for
    an attribute with no field of its own."""
    path = _WORK_REQUEST_FIELDS.get(name)
    return path if path is None or index is None else f"{path}[{index}]"


def prefill_request_to_pb(work: WorkRequest) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request=work_request_to_pb(work), kv_token=work.kv_token)


def prefill_request_from_pb(message: worker_pb2.PrefillRequest) -> WorkRequest:
    """The request to prefill, with the token that will own its KV; FieldError if either is malformed."""
    check_kv_token(message.kv_token, "kv_token")
    return work_request_from_pb(message.request, message.kv_token)


def prefill_result_to_pb(result: PrefillResult) -> worker_pb2.PrefillResponse:
    message = worker_pb2.PrefillResponse(
        first_token_id=result.first_token_id, finish_reason=finish_reason_to_pb(result.finish_reason),
        num_cached_tokens=result.num_cached_tokens, num_host_cached_tokens=result.num_host_cached_tokens,
        prompt_logprobs=logprobs_to_pb(result.prompt_logprobs),
        moments_ns=result.moments,
    )
    if result.first_logprob is not None:
        message.first_logprob.CopyFrom(logprobs_to_pb([result.first_logprob])[0])
    if result.kv_handle is not None:
        message.kv_handle.CopyFrom(kv_handle_to_pb(result.kv_handle))
    return message


def prefill_result_from_pb(message: worker_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        first_token_id=message.first_token_id,
        first_logprob=logprobs_from_pb([message.first_logprob])[0] if message.HasField("first_logprob") else None,
        finish_reason=finish_reason_from_pb(message.finish_reason),
        kv_handle=kv_handle_from_pb(message.kv_handle) if message.HasField("kv_handle") else None,
        num_cached_tokens=message.num_cached_tokens,
        num_host_cached_tokens=message.num_host_cached_tokens,
        prompt_logprobs=logprobs_from_pb(message.prompt_logprobs) or None,
        moments=dict(message.moments_ns),
    )


def decode_request_to_pb(request: DecodeRequest) -> worker_pb2.DecodeRequest:
    message = worker_pb2.DecodeRequest(request=work_request_to_pb(request.request))
    if request.kv_handle is not None:
        message.kv_handle.CopyFrom(kv_handle_to_pb(request.kv_handle))
    if request.first_token_id is not None:
        message.first_token_id = request.first_token_id
    if request.max_messages_per_s is not None:
        message.max_messages_per_s = request.max_messages_per_s
    return message


def decode_request_from_pb(message: worker_pb2.DecodeRequest) -> DecodeRequest:
    """FieldError if the request is inconsistent (a handle without its first token or its
    token, for another request, or covering other than the whole prompt in as many
    blocks as it takes); KvLayoutMismatchError for a malformed layout."""
    work = work_request_from_pb(message.request)
    rate = None
    if message.HasField("max_messages_per_s"):
        rate = message.max_messages_per_s
        if not 0 < rate < math.inf:
            raise FieldError("max_messages_per_s", f"max_messages_per_s must be > 0 and finite, got {rate}")
    if not message.HasField("kv_handle"):
        return DecodeRequest(work, max_messages_per_s=rate)
    if not message.HasField("first_token_id"):
        raise FieldError("first_token_id", "a KV handle needs first_token_id")
    handle = kv_handle_from_pb(message.kv_handle)
    num_prompt = len(work.prompt_token_ids)
    if handle.request_id != work.request_id:
        raise FieldError("kv_handle.request_id", "the KV handle is another request's")
    if handle.num_tokens != num_prompt:
        raise FieldError("kv_handle.num_tokens", f"KV handle covers {handle.num_tokens} tokens; "
                                                 f"the prompt has {num_prompt}")
    if handle.num_blocks != -(-num_prompt // handle.layout.block_size):
        raise FieldError("kv_handle.num_blocks", f"{handle.num_blocks} blocks cannot hold a prompt of "
                                                 f"{num_prompt} tokens in blocks of {handle.layout.block_size}")
    if not handle.prefill_address:
        raise FieldError("kv_handle.prefill_address", "the KV handle has no prefill address")
    if handle.prefill_endpoint is None:
        raise FieldError("kv_handle.prefill_endpoint", "the KV handle does not say where its KV lives")
    check_kv_token(handle.kv_token, "kv_handle.kv_token")
    return DecodeRequest(work, message.first_token_id, handle, rate)


def token_event_to_pb(event: TokenEvent) -> worker_pb2.DecodeEvent:
    message = worker_pb2.DecodeEvent(
        token_ids=event.token_ids,
        logprobs=logprobs_to_pb(event.logprobs),
        finish_reason=finish_reason_to_pb(event.finish_reason),
        prompt_logprobs=logprobs_to_pb(event.prompt_logprobs),
        moments_ns=event.moments,
    )
    if event.stop_token_id is not None:
        message.stop_token_id = event.stop_token_id
    if event.num_cached_tokens is not None:
        message.num_cached_tokens = event.num_cached_tokens
        message.num_host_cached_tokens = event.num_host_cached_tokens
    return message


def token_event_from_pb(message: worker_pb2.DecodeEvent) -> TokenEvent:
    return TokenEvent(
        token_ids=list(message.token_ids),
        logprobs=logprobs_from_pb(message.logprobs),
        finish_reason=finish_reason_from_pb(message.finish_reason),
        stop_token_id=message.stop_token_id if message.HasField("stop_token_id") else None,
        num_cached_tokens=message.num_cached_tokens if message.HasField("num_cached_tokens") else None,
        num_host_cached_tokens=message.num_host_cached_tokens,
        prompt_logprobs=logprobs_from_pb(message.prompt_logprobs) or None,
        moments=dict(message.moments_ns),
    )
