"""The step-level and offline APIs over a tiny real model: sampling, abort, stops, metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig, engine_config
from engine.engine import LLMEngine
from engine.request import InvalidRequestError, PromptTooLongError
from tests.support.tiny_models import hf_greedy, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64)


def make_engine(model_dir: str, **scheduler_kwargs) -> LLMEngine:
    cache = scheduler_kwargs.pop("cache", CacheConfig(block_size=4, num_kv_blocks=64, num_swap_blocks=32))
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype=torch.float64,
            cache=cache,
            scheduler=SchedulerConfig(**{"max_num_batched_tokens": 32, **scheduler_kwargs}),
        )
    )


def run(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def test_seeded_sampling_identical_alone_and_in_busy_batch(tiny):
    _, model_dir = tiny
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = list(range(5, 25))

    alone = make_engine(model_dir)
    alone.add_request(prompt, params, request_id="seeded")
    want = run(alone)["seeded"]

    busy = make_engine(model_dir, max_num_seqs=12)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        noise = torch.randint(3, 150, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        busy.add_request(noise, SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True), request_id=f"u{i}")
    busy.step()  # the seeded request joins a batch already mid-flight, at a different row
    busy.add_request(prompt, params, request_id="seeded")
    for i in range(3):
        busy.add_request([7 + i] * 9, SamplingParams(temperature=0.7, seed=i, max_tokens=12, ignore_eos=True))
    got = run(busy)["seeded"]
    assert got == want
    assert len(set(got)) > 3  # really sampled, not greedy-like


@pytest.mark.parametrize("prefilled", [False, True])
def test_a_continued_request_goes_on_with_the_stream_it_had(tiny, prefilled):
    """A request moved off a lost worker after k tokens: prompt + those k tokens, the
    limits counted down and num_generated_tokens=k give the rest of the same stream, for
    seeded sampling (the generator skips k draws) and greedy alike; also when the moved
    request is prefilled elsewhere and handed over with its next token."""
    _, model_dir = tiny
    prompt = list(range(5, 25))
    for params in (SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=16, min_tokens=10,
                                  ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=16)):
        undisturbed = make_engine(model_dir)
        undisturbed.add_request(prompt, params, request_id="r")
        want = run(undisturbed)["r"]
        k = 6
        rest = replace(params, max_tokens=params.max_tokens - k, min_tokens=max(0, params.min_tokens - k))
        moved = make_engine(model_dir)
        if prefilled:  # the next token was sampled by a prefill engine (draw k+1), then handed over
            moved.add_prefilled_request(prompt + want[:k], want[k], rest, request_id="r2",
                                        num_generated_tokens=k)
            request = moved.get_request("r2")
            moved.scheduler.schedule()  # admitted, RECEIVING; no KV arrives: it prefills here
            moved.complete_kv_receive("r2", False)
            got = [want[k], *run(moved)["r2"]]
        else:
            moved.add_request(prompt + want[:k], rest, request_id="r2", num_generated_tokens=k)
            got = run(moved)["r2"]
        assert want[:k] + got == want, params
        if prefilled:
            assert request.num_prompt_tokens == len(prompt) + k


def test_step_api_streams_tokens_and_reports_finish(tiny):
    hf_model, model_dir = tiny
    engine = make_engine(model_dir)
    prompt = [9, 8, 7, 6, 5]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), request_id="a")
    finals = []
    streamed: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            streamed += out.new_token_ids
            if out.finished:
                finals.append(out)
    assert streamed == hf_greedy(hf_model, prompt, 6)
    assert len(finals) == 1 and finals[0].finish_reason == "length" and finals[0].num_output_tokens == 6


def test_abort_in_any_state_frees_blocks(tiny):
    _, model_dir = tiny
    engine = make_engine(
        model_dir,
        max_num_batched_tokens=8,
        max_num_seqs=3,
        cache=CacheConfig(block_size=4, num_kv_blocks=12, num_swap_blocks=8),
        preemption_mode="swap",
        admission_reserve_steps=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(5):
        engine.add_request(list(range(3, 3 + 10 + i)), params, request_id=f"r{i}")
    states_seen = set()
    for _ in range(40):
        engine.step()
        states_seen |= {r.status.name for r in engine.scheduler.requests.values()}
        if {"WAITING", "RUNNING", "SWAPPED"} <= states_seen:
            break
    for request_id in sorted(engine.scheduler.requests):
        assert engine.abort_request(request_id)
        engine.check_integrity()
    finals = [o for o in engine.step().outputs if o.finished]
    assert {o.finish_reason for o in finals} == {"abort"}
    stats = engine.get_metrics()
    assert stats.num_kv_blocks_used == 0 and stats.num_swap_blocks_used == 0
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("r0")  # already gone


def test_stop_token_ids_min_tokens_and_max_tokens(tiny):
    hf_model, model_dir = tiny
    engine = make_engine(model_dir)
    prompt = [11, 12, 13, 14]
    greedy = hf_greedy(hf_model, prompt, 10)
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]), request_id="stop")
    engine.add_request(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id], min_tokens=first + 2),
        request_id="min",
    )
    tokens: dict[str, list[int]] = {}
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                last[out.request_id] = out
    assert tokens["stop"] == greedy[: first + 1]  # the stop token is kept, generation ends there
    assert stop_id not in tokens["min"][: first + 2]
    # The last output says which token stopped it (the request itself is gone by then).
    assert (last["stop"].finish_reason, last["stop"].stop_reason) == ("stop", stop_id)
    assert engine.get_request("stop") is None
    if last["min"].finish_reason == "length":
        assert last["min"].stop_reason is None


def test_logprobs_returned_per_token(tiny):
    _, model_dir = tiny
    llm = LLM(model_dir, dtype="float64", block_size=4, num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0][0] == token_id  # greedy: sampled = top-1
        assert entry.logprob <= 0


def test_generate_accepts_single_prompt_and_per_prompt_params(tiny):
    hf_model, model_dir = tiny
    llm = LLM(model_dir, dtype="float64", block_size=4, num_kv_blocks=64)
    single = llm.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(single) == 1 and single[0].token_ids == hf_greedy(hf_model, [4, 5, 6], 3)
    many = llm.generate(
        [[4, 5, 6], [7, 8]],
        [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)],
    )
    assert [len(o.token_ids) for o in many] == [2, 4]
    with pytest.raises(ValueError):
        llm.generate([[4, 5], [6]], [SamplingParams()])
    with pytest.raises(ValueError):
        llm.generate([[4, 10_000]], SamplingParams())  # token id outside the vocabulary
    with pytest.raises(ValueError):
        llm.generate("text", SamplingParams())  # this tiny model has no tokenizer


def test_a_request_that_could_never_run_is_refused_naming_its_attribute(tiny):
    """The refusal names the request attribute at fault (the workers answer with its field),
    and a prompt that reaches the context is told apart; nothing refused is queued."""
    _, model_dir = tiny
    engine = make_engine(model_dir)  # a 512-token context; 64 blocks of 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request([5, 6], params, request_id="taken")
    cases = {
        "prompt at the context": (lambda: engine.add_request([5] * 512, params),
                                  PromptTooLongError, "prompt_token_ids", None),
        "prompt over the cache": (lambda: engine.add_request([5] * 257, replace(params, max_tokens=1)),
                                  InvalidRequestError, "prompt_token_ids", None),
        "peak KV over the cache": (lambda: engine.add_request([5] * 200, replace(params, max_tokens=100)),
                                   InvalidRequestError, "sampling_params.max_tokens", None),
        "token past the vocabulary": (lambda: engine.add_request([5, 10_000, 6], params),
                                      InvalidRequestError, "prompt_token_ids", 1),
        "empty prompt": (lambda: engine.add_request([], params), InvalidRequestError, "prompt_token_ids", None),
        "first token past the vocabulary": (lambda: engine.add_prefilled_request([5, 6], 10_000, params),
                                            InvalidRequestError, "first_token_id", None),
        "duplicate id": (lambda: engine.add_request([7], params, request_id="taken"),
                         InvalidRequestError, "request_id", None),
    }
    for case, (add, error_type, name, index) in cases.items():
        with pytest.raises(InvalidRequestError) as refused:
            add()
        assert (type(refused.value), refused.value.name, refused.value.index) == (error_type, name, index), case
    # Just under both limits: admitted.
    engine.add_request([5] * 256, replace(params, max_tokens=1), request_id="whole-cache")
    engine.add_request([5] * 200, replace(params, max_tokens=57), request_id="peak-fits")
    assert sorted(engine.scheduler.requests) == ["peak-fits", "taken", "whole-cache"]
    run(engine)
    assert engine.kv_manager.num_used_blocks == 0


def test_priority_requests_get_served_first(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request([5, 6], params, request_id="low", priority=3)
    engine.add_request([5, 6], params, request_id="high", priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step().outputs if o.finished]
    assert order == ["high", "low"]


def test_metrics_readable_any_time(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir, max_num_seqs=2)
    for i in range(4):
        engine.add_request([5 + i] * 6, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    before = engine.get_metrics()
    assert before.num_waiting == 4 and before.num_running == 0
    engine.step()
    mid = engine.get_metrics()
    assert mid.num_running == 2 and mid.num_waiting == 2 and mid.num_kv_blocks_used > 0
    assert mid.num_tokens_last_step == 12
    run(engine)
    end = engine.get_metrics()
    assert end.num_finished == 4 and end.num_kv_blocks_used == 0 and len(end.queue_times) == 4


def test_kv_pool_sized_from_memory_budget(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir, cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20, num_swap_blocks=0))
    bytes_per_block = engine.kv_layout.bytes_per_block
    # 2 layers x (K, V) x 4 slots x 2 KV heads x 16 dims x 8 bytes (float64)
    assert bytes_per_block == 2 * 2 * 4 * 2 * 16 * 8
    assert engine.kv_manager.pool.num_blocks == (1 << 20) // bytes_per_block
    assert engine.kv_cache.layers[0][0].shape == ((1 << 20) // bytes_per_block, 4, 2, 16)


def test_engine_config_routes_flat_keywords_and_keeps_dataclass_defaults():
    config = engine_config(
        "some-model", block_size=8, max_num_seqs=3, scheduler_policy="static", dtype="float64", seed=5
    )
    assert config.model == "some-model" and config.dtype == torch.float64 and config.seed == 5
    assert config.cache == CacheConfig(block_size=8)
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, policy="static")
    assert engine_config() == EngineConfig() and EngineConfig().model == DEFAULT_MODEL
    with pytest.raises(TypeError, match="num_threads"):
        engine_config(num_threads=2)  # process state: engine.envs.configure_process
    with pytest.raises(TypeError, match="twice"):
        engine_config(policy="static", scheduler_policy="static")
