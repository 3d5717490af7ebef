"""Records survive the wire: a WorkRequest through the Prefill and Decode messages, and
what WorkRequest.continued carries on, every sampling parameter."""

from __future__ import annotations

from dataclasses import fields, replace

from baton.wire import convert
from baton.wire.records import DecodeRequest, WorkRequest
from baton.wire.v1 import generation_pb2 as pb
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from gateway.http import protocol as api


def _work(**extra) -> WorkRequest:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, min_tokens=3, seed=5)
    return WorkRequest("r~2", [5, 6, 7, 8], params, priority=-1, num_generated_tokens=2, **extra)


def test_a_work_request_round_trips_through_the_prefill_and_decode_messages():
    work = _work(kv_token="a" * 32, attempt=2)
    assert convert.prefill_request_from_pb(convert.prefill_request_to_pb(work)) == work
    decoded = convert.decode_request_from_pb(convert.decode_request_to_pb(DecodeRequest(work))).request
    assert decoded.attempt == 2
    assert decoded == WorkRequest(work.request_id, work.prompt_token_ids, work.params, work.priority,
                                  work.num_generated_tokens, attempt=2)  # a Decode carries no kv_token


def test_new_work_is_attempt_zero_and_each_move_counts_one():
    work = _work(kv_token="t")
    assert work.attempt == 0 and convert.work_request_to_pb(work).attempt == 0
    moved = work.continued([100, 101], "r~3")
    assert moved.attempt == 1 and moved.continued([102], "r~4").attempt == 2
    # The generated tokens so far are kept counting: the earlier attempt's and this move's.
    assert moved.num_generated_tokens == 4 and moved.prompt_token_ids == [5, 6, 7, 8, 100, 101]
    assert moved.kv_token == "t"


def test_a_move_asks_for_prompt_logprobs_again_only_if_none_came():
    work = WorkRequest("r", [5, 6, 7], SamplingParams(max_tokens=9, prompt_logprobs=2), 0)
    assert work.continued([], "r~1").params.prompt_logprobs == 2  # lost before its first token
    assert work.continued([11], "r~1").params.prompt_logprobs is None  # they came with it


# Every SamplingParams field at a value other than its default.
_EVERY_PARAM = SamplingParams(
    temperature=0.5, top_p=0.8, top_k=7, min_p=0.1, seed=-3, repetition_penalty=1.2, max_tokens=40, min_tokens=2,
    stop=("END", "STOP"), stop_token_ids=(9, 4), ignore_eos=True, logprobs=3, include_stop_str_in_output=True,
    skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={5: 1.5, 2: -3.0},
    allowed_token_ids=(1, 2, 3), bad_words=("no",), structured_output=StructuredOutput(regex="[ab]+"),
    n=3, prompt_logprobs=0,
)


def test_every_sampling_param_crosses_the_wire_as_it_was():
    """Copied by name (convert.py): a field the message lacks, or one left unset, fails here."""
    defaults = SamplingParams()
    assert [f.name for f in fields(SamplingParams) if getattr(_EVERY_PARAM, f.name) == getattr(defaults, f.name)] == []
    assert convert.sampling_params_from_pb(convert.sampling_params_to_pb(_EVERY_PARAM)) == _EVERY_PARAM
    without_stop = convert.sampling_params_to_pb(_EVERY_PARAM, with_stop_strings=False)
    assert convert.sampling_params_from_pb(without_stop) == replace(_EVERY_PARAM, stop=None)
    assert convert.sampling_params_from_pb(pb.SamplingParams()) == defaults


def test_the_wire_and_the_http_bodies_name_every_sampling_param():
    """The message's fields are SamplingParams' (the structured output a oneof of its kinds);
    both OpenAI bodies carry each field by its own name but those read apart."""
    names = {f.name for f in fields(SamplingParams)}
    structured = {f.name for f in pb.SamplingParams.DESCRIPTOR.oneofs_by_name["structured_output"].fields}
    assert set(pb.SamplingParams.DESCRIPTOR.fields_by_name) == names - {"structured_output"} | structured | {
        "pretty_json"}
    for body in (api.CompletionRequest, api.ChatCompletionRequest):
        assert names - {"logprobs", "structured_output"} <= set(body.model_fields), body
    assert {"logprobs", "top_logprobs", "max_completion_tokens"} <= set(api.ChatCompletionRequest.model_fields)


def test_an_engine_refusal_of_any_sampling_param_names_its_wire_field():
    """The engine names a request's attribute (InvalidRequestError.name); the worker answers
    with the field's path in its request message, for every sampling field."""
    for name in [f.name for f in fields(SamplingParams)] + ["regex", "json_schema"]:
        assert convert.work_request_field(f"sampling_params.{name}") == f"request.sampling.{name}"
    assert convert.work_request_field("sampling_params.logit_bias", 7) == "request.sampling.logit_bias[7]"


def test_an_http_body_stop_string_alone_is_a_list_of_one():
    """OpenAI's `stop` is a string or a list: both are read by name into SamplingParams."""
    from gateway.http import translate

    for stop in ("END", ["END"]):
        body = api.CompletionRequest(prompt="hi", stop=stop, max_tokens=3)
        assert translate.sampling(body, 3, None).stop == ("END",)
