"""The gateway's bad-input table: malformed and abusive public requests, each with the
status it gets and the field its google.rpc.BadRequest names (None: none). Read by the
gRPC suite (test_bad_input.py) and the OpenAI one (test_openai_api.py)."""

from __future__ import annotations

import json

import grpc

from baton.wire.limits import MAX_REQUEST_BYTES
from baton.wire.v1 import generation_pb2 as pb
from tests.serving.test_serving import VOCAB_SIZE

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
NAN, INF = float("nan"), float("inf")


def text(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


def chat(*roles: str, content: str = "hi") -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role=role, content=content) for role in roles]))


def with_fields(request: pb.GenerateRequest, **fields) -> pb.GenerateRequest:
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def garbage_with_bad_utf8() -> bytes:
    """A GenerateRequest whose text (field 2) is not UTF-8."""
    payload = b"caf\xc3\x28 \xff"
    return bytes([2 << 3 | 2, len(payload)]) + payload


CASES = {
    # The prompt.
    "no prompt": (pb.GenerateRequest(), INVALID, "prompt"),
    "empty text": (pb.GenerateRequest(text=""), INVALID, "text"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), INVALID, "token_ids.ids"),
    "token id past the vocabulary": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, VOCAB_SIZE + 3])), INVALID,
                                     "token_ids.ids[1]"),
    "token id 2^32-1": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1])), INVALID, "token_ids.ids[0]"),
    "token ids over the context": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 600)), OUT_OF_RANGE,
                                   "token_ids.ids"),
    "text far over the context": (pb.GenerateRequest(text="x" * 20_000), OUT_OF_RANGE, "text"),
    "text tokens over the context": (pb.GenerateRequest(text="hello " * 600), OUT_OF_RANGE, "text"),
    "chat far over the context": (chat("user", content="x" * 20_000), OUT_OF_RANGE, "messages.messages"),
    "no messages": (pb.GenerateRequest(messages=pb.ChatMessages()), INVALID, "messages.messages"),
    "too many messages": (chat(*["user"] * 1025), INVALID, "messages.messages"),
    "unknown role": (chat("robot"), INVALID, "messages.messages[0].role"),
    "empty role": (chat("system", "user", ""), INVALID, "messages.messages[2].role"),
    "role in capitals": (chat("user", "User"), INVALID, "messages.messages[1].role"),
    "role with a special token": (chat("user<|im_end|>"), INVALID, "messages.messages[0].role"),
    # Sampling: NaN, infinities and out-of-range values.
    "negative temperature": (text(temperature=-1), INVALID, "sampling.temperature"),
    "NaN temperature": (text(temperature=NAN), INVALID, "sampling.temperature"),
    "infinite temperature": (text(temperature=INF), INVALID, "sampling.temperature"),
    "top_p 0": (text(top_p=0), INVALID, "sampling.top_p"),
    "top_p 1.5": (text(top_p=1.5), INVALID, "sampling.top_p"),
    "NaN top_p": (text(top_p=NAN), INVALID, "sampling.top_p"),
    "top_k -2": (text(top_k=-2), INVALID, "sampling.top_k"),
    "negative min_p": (text(min_p=-0.1), INVALID, "sampling.min_p"),
    "min_p 2": (text(min_p=2), INVALID, "sampling.min_p"),
    "NaN min_p": (text(min_p=NAN), INVALID, "sampling.min_p"),
    "repetition_penalty 0": (text(repetition_penalty=0), INVALID, "sampling.repetition_penalty"),
    "-inf repetition_penalty": (text(repetition_penalty=-INF), INVALID, "sampling.repetition_penalty"),
    "NaN repetition_penalty": (text(repetition_penalty=NAN), INVALID, "sampling.repetition_penalty"),
    "max_tokens 0": (text(max_tokens=0), INVALID, "sampling.max_tokens"),
    "min_tokens over max_tokens": (text(max_tokens=5, min_tokens=10), INVALID, "sampling.min_tokens"),
    "logprobs 21": (text(logprobs=21), INVALID, "sampling.logprobs"),
    "logprobs 2^32-1": (text(logprobs=2**32 - 1), INVALID, "sampling.logprobs"),
    "17 stop strings": (text(stop=[f"s{i}" for i in range(17)]), INVALID, "sampling.stop"),
    "a 300-character stop string": (text(stop=["ok", "x" * 300]), INVALID, "sampling.stop[1]"),
    "an empty stop string": (text(stop=[""]), INVALID, "sampling.stop"),
    "257 stop token ids": (text(stop_token_ids=list(range(3, 260))), INVALID, "sampling.stop_token_ids"),
    "stop token id past the vocabulary": (text(stop_token_ids=[5, VOCAB_SIZE]), INVALID,
                                          "sampling.stop_token_ids[1]"),
    "NaN presence_penalty": (text(presence_penalty=NAN), INVALID, "sampling.presence_penalty"),
    "frequency_penalty 3": (text(frequency_penalty=3), INVALID, "sampling.frequency_penalty"),
    "301 logit biases": (text(logit_bias={i: 1.0 for i in range(3, 304)}), INVALID, "sampling.logit_bias"),
    "a logit bias of 101": (text(logit_bias={5: 101.0}), INVALID, "sampling.logit_bias"),
    "a NaN logit bias": (text(logit_bias={5: NAN}), INVALID, "sampling.logit_bias"),
    "a logit bias id past the vocabulary": (text(logit_bias={5: 1.0, VOCAB_SIZE + 2: 1.0}), INVALID,
                                            f"sampling.logit_bias[{VOCAB_SIZE + 2}]"),
    "an allowed token id past the vocabulary": (text(allowed_token_ids=[4, VOCAB_SIZE]), INVALID,
                                                "sampling.allowed_token_ids[1]"),
    "65 bad words": (text(bad_words=[f"w{i}" for i in range(65)]), INVALID, "sampling.bad_words"),
    "a 300-character bad word": (text(bad_words=["ok", "x" * 300]), INVALID, "sampling.bad_words[1]"),
    "an empty bad word": (text(bad_words=[""]), INVALID, "sampling.bad_words"),
    # Structured output: malformed, over the size limit, or past llguidance's limits.
    "a json_schema that is no JSON": (text(json_schema="{not json"), INVALID, "sampling.json_schema"),
    "a 1 MB json_schema": (text(json_schema=json.dumps({"type": "object", "description": "x" * 2**20})), INVALID,
                           "sampling.json_schema"),
    "a json_schema of an unknown type": (text(json_schema='{"type": "strin"}'), INVALID, "sampling.json_schema"),
    "a regex that explodes": (text(regex="(.{0,100}){0,100}"), INVALID, "sampling.regex"),
    "a grammar that does not parse": (text(grammar="root ::= ("), INVALID, "sampling.grammar"),
    "no choices": (text(choice=pb.Choices()), INVALID, "sampling.choice"),
    # Ids and priorities.
    "a 300-character request id": (with_fields(text(), request_id="r" * 300), INVALID, "request_id"),
    "a request id with a newline": (with_fields(text(), request_id="a\nb"), INVALID, "request_id"),
    "priority 2^31-1": (with_fields(text(), priority=2**31 - 1), INVALID, "priority"),
    "priority -2^31": (with_fields(text(), priority=-(2**31)), INVALID, "priority"),
    # Bytes that are no GenerateRequest (grpc itself answered UNKNOWN).
    "garbage bytes": (b"\xff\xfe\xfd\xfc garbage", INVALID, None),
    "truncated message": (pb.GenerateRequest(text="hello").SerializeToString()[:-2], INVALID, None),
    "text that is not UTF-8": (garbage_with_bad_utf8(), INVALID, None),
    # Over the public port's message limit: grpc refuses it before it is read.
    "a message over the size limit": (pb.GenerateRequest(text="x" * (MAX_REQUEST_BYTES + 1)),
                                      grpc.StatusCode.RESOURCE_EXHAUSTED, None),
}
