"""Handed-off requests landing in blocks the engine set aside (engine/kv/landing.py): at the
engine level, the blocks copied by hand as in test_handoff.py; with an AsyncEngine, the
order of the pull and the add; the decode worker's whole path is served in test_serving.py
and test_latency.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig
from engine.async_engine import AsyncEngine
from engine.request import RequestStatus
from tests.engine.test_engine import make_engine, run
from tests.engine.test_handoff import copy_blocks, prefill
from tests.support.tiny_models import hf_greedy, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-landing")
    return make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64)


def busy_engine(model_dir, zone_tokens: int = 64, **scheduler_kwargs):
    """A decode engine with its landing zone open and a request of its own decoding, stepped
    once: blocks and places are set aside after each schedule."""
    engine = make_engine(model_dir, **scheduler_kwargs)
    engine.scheduler.landing.open(zone_tokens)
    engine.add_request(list(range(40, 50)), GREEDY, request_id="busy")
    engine.step()
    return engine


def test_a_landed_request_decodes_in_the_step_after_its_kv_arrived(tiny):
    hf_model, model_dir = tiny
    prefill_engine, decode_engine = make_engine(model_dir), busy_engine(model_dir)
    prompt = list(range(3, 21))  # 18 tokens: 5 blocks of 4
    first, held_ids, _ = prefill(prefill_engine, {"h": prompt}, GREEDY)["h"]

    landing = decode_engine.scheduler.landing.claim(len(prompt))
    assert landing is not None and len(landing.block_ids) == len(held_ids) == 5
    # The pull fills the blocks before the engine has seen the request (the step runs meanwhile).
    copy_blocks(prefill_engine, held_ids, decode_engine, landing.block_ids)
    request = decode_engine.add_prefilled_request(prompt, first, GREEDY, request_id="h", landing=landing)
    assert request.status == RequestStatus.RECEIVING and request.landing == landing.ticket
    assert decode_engine.kv_manager.get_block_ids("h") == landing.block_ids
    assert decode_engine.complete_kv_receive("h", True, landing=landing.ticket)
    decode_engine.check_integrity()

    step = decode_engine.step()  # the very next step decodes it: no admission, no kv_receives
    assert not step.kv_receives
    outputs = {"h": [first]}
    for out in step.outputs:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(outputs["h"]) == 2
    for request_id, tokens in run(decode_engine).items():
        outputs.setdefault(request_id, []).extend(tokens)
    assert outputs["h"] == hf_greedy(hf_model, prompt, 8)
    assert prefill_engine.release_kv("h")
    decode_engine.check_integrity()
    stats = decode_engine.get_metrics()
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert stats.prefix_cache_received_blocks == 5 and stats.num_kv_landed == 1


def test_a_refused_landing_is_fenced_until_released_and_touches_no_other_request(tiny):
    _, model_dir = tiny
    engine = busy_engine(model_dir)
    prompt = list(range(3, 15))
    engine.add_prefilled_request(prompt, 7, GREEDY, request_id="d")  # queued: receives at a schedule
    engine.step()
    assert engine.get_request("d").status == RequestStatus.RECEIVING

    for request_id, first_token in (("d", 7), ("bad", engine.vocab_size + 3)):  # a duplicate id, a bad token
        landing = engine.scheduler.landing.claim(len(prompt))
        assert landing is not None
        with pytest.raises(ValueError):
            engine.add_prefilled_request(prompt, first_token, GREEDY, request_id=request_id, landing=landing)
        assert engine.get_metrics().num_kv_blocks_fenced == len(landing.block_ids)
        # Its pull's completion reaches no request: not the other "d", which still waits for its own.
        assert not engine.complete_kv_receive(request_id, True, landing=landing.ticket)
        assert engine.get_request("d").status == RequestStatus.RECEIVING
        assert engine.release_fence(landing.ticket) == len(landing.block_ids)
        engine.check_integrity()
    assert engine.complete_kv_receive("d", False)  # the queued one's pull failed: it prefills here
    run(engine)
    engine.check_integrity()
    assert engine.get_metrics().num_kv_blocks_used == 0


def test_nothing_is_set_aside_while_requests_wait_for_blocks_or_places(tiny):
    _, model_dir = tiny
    engine = busy_engine(model_dir, cache=CacheConfig(block_size=4, num_kv_blocks=32, num_swap_blocks=0))
    landing = engine.scheduler.landing.claim(4 * 16)  # a whole zone of 64 tokens
    assert landing is not None
    engine.scheduler.landing.refuse(landing)  # (no add follows: given back)
    engine.release_fence(landing.ticket)
    engine.step()
    assert engine.scheduler.landing.claim(4 * 17) is None  # more than the zone

    # Blocks short: a prompt of 120 tokens (30 blocks of the 32) waits while the busy one holds 3.
    # At the default priority it goes after a handoff arriving now (as in admission): one lands;
    # at a better one (or aged as long) it goes first, and none does.
    for priority, lands in ((0, True), (-1, False)):
        engine.add_request(list(range(1, 121)), SamplingParams(max_tokens=1), request_id="long", priority=priority)
        engine.step()
        assert engine.scheduler.policy.is_kv_short
        landing = engine.scheduler.landing.claim(4)
        assert (landing is not None) == lands
        if landing is not None:
            engine.scheduler.landing.refuse(landing)  # (no add follows: given back)
            engine.release_fence(landing.ticket)
        engine.abort_request("long")
        engine.step()
    assert engine.scheduler.landing.claim(4) is not None

    # Places short: max_num_seqs running.
    full = busy_engine(model_dir, max_num_seqs=1)
    assert full.scheduler.landing.claim(4) is None
    full.check_integrity()


def test_the_pull_starts_before_the_add_runs_and_completes_behind_it(tiny):
    hf_model, model_dir = tiny
    prefill_engine, decode_engine = make_engine(model_dir), busy_engine(model_dir)
    prompt = list(range(3, 21))
    first, held_ids, _ = prefill(prefill_engine, {"h": prompt}, GREEDY)["h"]
    seen = []

    async def main():
        def on_kv_receive(receive):
            # Called as the add is queued, before it runs: the engine has not seen "h" yet.
            seen.append((receive.ticket, decode_engine.get_request("h")))
            copy_blocks(prefill_engine, held_ids, decode_engine, receive.block_ids)
            asyncio.get_running_loop().create_task(engine.call(
                lambda llm: llm.complete_kv_receive("h", True, landing=receive.ticket)))

        engine = AsyncEngine(decode_engine, on_kv_receive=on_kv_receive)
        engine.start()
        try:
            stream = await engine.add_prefilled_request("h", prompt, first, GREEDY, land=True)
            tokens = [first]
            async for out in stream:
                tokens.extend(out.new_token_ids)
            return tokens
        finally:
            await engine.stop()

    tokens = asyncio.run(main())
    (ticket, request_then), = seen
    assert ticket is not None and request_then is None
    assert tokens == hf_greedy(hf_model, prompt, 8)
    decode_engine.check_integrity()


def test_a_handoffs_first_decode_step_takes_no_prompt_tokens_but_never_two_steps_running(tiny):
    """The step that samples a handed-off request's second token takes no prompt chunk; a
    step after such a step takes its stretch's worth whatever (a stream of handoffs cannot
    starve the engine's own prompts). Here: a 20 ms decode step, 1 ms a prompt token."""
    _, model_dir = tiny
    engine = make_engine(model_dir, max_decode_stretch=1.0)
    scheduler = engine.scheduler
    scheduler.serves_handoffs = True
    scheduler.decode_step_s = lambda num_seqs, num_context_tokens: 0.02
    engine.cost_model.prefill_seconds_per_token = 0.001
    engine.cost_model.num_prefill_observations = 1  # as measured
    engine.add_request(list(range(40, 50)), GREEDY, request_id="decoding")
    engine.step()
    engine.add_request(list(range(60, 140)), GREEDY, request_id="local")  # waiting: a prompt to limit
    assert scheduler.prefill_limit() == 20
    local, landed = scheduler.requests["local"], scheduler.requests["decoding"]
    computed = []
    for _ in range(4):
        landed.kv_ready_time, landed.first_decode_time = 1.0, None  # as if its KV had just arrived
        engine.step()
        computed.append(local.num_computed_tokens)
    assert computed == [0, 20, 20, 40]
    engine.check_integrity()


def test_landings_leave_the_blocks_and_places_admitted_prompts_need(tiny):
    """A prompt prefilled in chunks keeps the blocks its next chunks take, and a claim not
    yet added keeps its place: handoffs landing after every step never preempt it, and a
    waiting request is not admitted past max_num_seqs beside a claim."""
    _, model_dir = tiny
    engine = busy_engine(model_dir)
    engine.add_request([1 + i % 150 for i in range(160)], GREEDY, request_id="long")  # 40 of 64 blocks, 32-token chunks
    landed = 0
    for step in range(6):
        engine.step()
        landing = engine.scheduler.landing.claim(64)
        if landing is not None:  # its KV is left as it is: only the blocks are watched here
            engine.add_prefilled_request(list(range(70, 134)), 5, GREEDY, request_id=f"h{step}", landing=landing)
            assert engine.complete_kv_receive(f"h{step}", True, landing=landing.ticket)
            landed += 1
        engine.check_integrity()
    run(engine)
    stats = engine.get_metrics()
    assert landed >= 1 and stats.num_kv_landed == landed
    assert stats.num_preemptions_recompute == stats.num_preemptions_swap == 0

    full = busy_engine(model_dir, max_num_seqs=2)  # "busy" runs: one place left
    landing = full.scheduler.landing.claim(8)
    assert landing is not None
    full.add_request(list(range(20, 30)), GREEDY, request_id="local")
    full.step()  # its add not run yet: the claim holds the last place
    assert full.get_request("local").status == RequestStatus.WAITING
    full.add_prefilled_request(list(range(3, 11)), 5, GREEDY, request_id="h", landing=landing)
    full.check_integrity()
