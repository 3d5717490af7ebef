"""Records survive the wire: a WorkRequest through the Prefill and Decode messages, and
what WorkRequest.continued carries on."""

from __future__ import annotations

from baton.wire import convert
from baton.wire.records import DecodeRequest, WorkRequest
from engine.sampling_params import SamplingParams


def _work(**fields) -> WorkRequest:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, min_tokens=3, seed=5)
    return WorkRequest("r~2", [5, 6, 7, 8], params, priority=-1, num_generated_tokens=2, **fields)


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
