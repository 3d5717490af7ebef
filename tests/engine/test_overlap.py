"""Overlapped scheduling (LLMEngine.step with overlap_scheduling) against the plain loop, on CPU.

The overlapped loop schedules and launches step N+1 before it reads step N's
tokens; a decode whose input is still on the device takes it there. On CPU
nothing runs concurrently, but the order of work is the GPU's, so what it can
get wrong shows here: every request's tokens, no token after a request's end
(its last step may run once more: that token reaches no one), and the KV
accounting, i.e. after every step each request holds only blocks its tokens
need, the scheduler's integrity holds, and every block is back at the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv.manager import cdiv
from engine.request import PENDING_TOKEN
from engine.sampling_params import SamplingParams
from tests.support.tiny_models import make_tiny_model

NUM_BLOCKS = 24
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-overlap"), "llama", 4, 2, 16, True, dtype=torch.float64)[1]


def make_engine(model_dir: str, overlap: bool, **scheduler_kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir,
        dtype=torch.float64,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, num_swap_blocks=8),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 24, "max_num_seqs": 6, **scheduler_kwargs}),
        overlap_scheduling=overlap,
    ))


@dataclass(frozen=True)
class Arrival:
    request_id: str
    step: int  # added before this step
    prompt: list[int]
    params: SamplingParams
    abort_step: int | None  # aborted before this step, if still running


@dataclass
class Finished:
    tokens: list[int]
    finish_reason: str | None


def drive(engine: LLMEngine, arrivals: list[Arrival], with_aborts: bool = True) -> dict[str, Finished]:
    """Run the plan step by step, checking the KV accounting after every step."""
    results: dict[str, Finished] = {a.request_id: Finished([], None) for a in arrivals}
    kv = engine.kv_manager
    step = 0
    while step < 400:
        for arrival in arrivals:
            if arrival.step == step:
                engine.add_request(arrival.prompt, arrival.params, request_id=arrival.request_id)
            if with_aborts and arrival.abort_step == step and results[arrival.request_id].finish_reason is None:
                engine.abort_request(arrival.request_id)
        if step > max(a.step for a in arrivals) and not engine.has_unfinished_requests():
            break
        for output in engine.step().outputs:
            result = results[output.request_id]
            assert result.finish_reason is None, f"{output.request_id}: output after its last"
            assert PENDING_TOKEN not in output.new_token_ids
            result.tokens.extend(output.new_token_ids)
            assert output.num_output_tokens == len(result.tokens), "counted a token not yet reported"
            if output.finished:
                result.finish_reason = output.finish_reason
        engine.check_integrity()
        for request in engine.scheduler.requests.values():
            if kv.has_blocks(request.request_id):
                held = len(kv.get_block_ids(request.request_id))
                assert held <= cdiv(request.num_tokens, BLOCK_SIZE), f"{request} holds {held} blocks"
        step += 1
    assert not engine.has_unfinished_requests(), "the plan did not finish"
    assert kv.num_free_blocks == NUM_BLOCKS and kv.num_used_blocks == 0
    for request_id, result in results.items():
        assert result.finish_reason is not None, f"{request_id} never finished"
    return results


plans = st.lists(
    st.tuples(
        st.integers(0, 12),  # arrival step
        st.integers(1, 30),  # prompt length
        st.integers(1, 16),  # max_tokens
        st.integers(0, 3),  # min_tokens
        st.sampled_from(["greedy", "seeded"]),
        st.one_of(st.none(), st.integers(1, 20)),  # abort this many steps after arrival
        st.booleans(),  # a stop token that the request is likely to sample
    ),
    min_size=1,
    max_size=8,
)


def build_arrivals(plan, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = []
    for index, (arrival, length, max_tokens, min_tokens, kind, abort_after, stops) in enumerate(plan):
        prompt = [rng.randrange(3, 160) for _ in range(length)]
        params = SamplingParams(
            temperature=0.0 if kind == "greedy" else 0.9,
            top_p=1.0 if kind == "greedy" else 0.9,
            seed=None if kind == "greedy" else 1000 + index,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            # Tiny random models repeat themselves: a quarter of the vocab stops soon.
            stop_token_ids=list(range(3, 43)) if stops else [],
            ignore_eos=True,
        )
        abort_step = None if abort_after is None else arrival + abort_after
        arrivals.append(Arrival(f"r{index}", arrival, prompt, params, abort_step))
    return arrivals


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans, seed=st.integers(0, 2**16), preemption=st.sampled_from(["recompute", "swap"]))
def test_overlapped_loop_gives_the_plain_loops_tokens(tiny, plan, seed, preemption):
    arrivals = build_arrivals(plan, seed)
    reference = drive(make_engine(tiny, overlap=False, preemption_mode=preemption), arrivals, with_aborts=False)
    plain = drive(make_engine(tiny, overlap=False, preemption_mode=preemption), arrivals)
    overlapped = drive(make_engine(tiny, overlap=True, preemption_mode=preemption), arrivals)
    for arrival in arrivals:
        want = reference[arrival.request_id]
        for run in (plain, overlapped):
            got = run[arrival.request_id]
            if got.finish_reason == "abort":
                # Aborted: whatever it streamed first is the start of its unaborted stream.
                assert got.tokens == want.tokens[: len(got.tokens)]
            else:
                assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), arrival


def test_a_stop_token_ends_the_stream_without_the_step_after(tiny):
    """The overlapped loop runs a stopped request once more; that token is never reported."""
    engine = make_engine(tiny, overlap=True)
    reference = make_engine(tiny, overlap=False)
    prompt = list(range(10, 30))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free_run = drive(reference, [Arrival("r", 0, prompt, greedy, None)])["r"].tokens
    stop_at = free_run[5]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    result = drive(engine, [Arrival("r", 0, prompt, params, None)])["r"]
    assert result.tokens == free_run[: free_run.index(stop_at) + 1]
    assert result.finish_reason == "stop"


def test_prefill_only_and_received_requests_in_the_overlapped_loop(tiny):
    """A prefill_only request is held with its blocks after its first token, and a request
    whose prompt KV comes from elsewhere decodes from its first token; both as in the plain loop."""
    outputs = {}
    for overlap in (False, True):
        engine = make_engine(tiny, overlap=overlap)
        prompt = list(range(20, 33))
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8), request_id="held",
                           prefill_only=True)
        held = None
        for _ in range(10):
            for output in engine.step().outputs:
                if output.kv_block_ids is not None:
                    held = output
            if held is not None:
                break
        assert held is not None and len(held.new_token_ids) == 1 and not held.finished
        assert engine.release_kv("held")
        engine.add_prefilled_request(prompt, held.new_token_ids[0], SamplingParams(temperature=0.0, max_tokens=8),
                                     request_id="received")
        step = engine.step()
        assert [r.request_id for r in step.kv_receives] == ["received"]
        assert engine.complete_kv_receive("received", ok=False)  # never arrives: prefills here
        tokens = []
        while engine.has_unfinished_requests():
            for output in engine.step().outputs:
                tokens.extend(output.new_token_ids)
        engine.check_integrity()
        assert engine.kv_manager.num_free_blocks == NUM_BLOCKS
        outputs[overlap] = (held.new_token_ids, tokens)
    assert outputs[True] == outputs[False]


def test_blocks_a_step_in_flight_may_write_go_back_once_it_has_ended(tiny):
    """A request ended while its next step is in flight (aborted here; a stop token alike)
    holds no blocks any more, but they stay out of the pool until that step has ended: a
    KV transfer from another process given them could be overwritten by its last write."""
    engine = make_engine(tiny, overlap=True)
    engine.add_request(list(range(5, 13)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       request_id="a")
    engine.step()
    engine.step()  # a step of "a" is in flight
    num_blocks = len(engine.kv_manager.get_block_ids("a"))
    assert engine.overlap.step is not None and num_blocks > 0
    assert engine.abort_request("a")
    assert not engine.kv_manager.has_blocks("a")
    assert engine.get_metrics().num_kv_blocks_used == num_blocks
    engine.check_integrity()
    engine.step()  # the step in flight ends
    assert engine.get_metrics().num_kv_blocks_used == 0
    engine.check_integrity()
