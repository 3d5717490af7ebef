"""The prefix cache's host tier (engine/kv/host_tier.py) on the engine with a real model:
prefixes the device cache evicted come back from host memory, the tokens stay those of
transformers and of caching off, swap preemption shares the host pool, and every block is
free or evictable at the end. The scheduler-level property test (tests/kv/test_prefix_cache.py)
follows every copy through a shadow of the cache."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.request import Request
from tests.support.tiny_models import hf_greedy, make_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_checked(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return [request.output_token_ids for request in run_requests(engine, prompts, max_tokens)]


def run_requests(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Run the prompts together to their ends, checking the pools after each step; then no
    device block is held and every host block is free or cached."""
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts, max_tokens)]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    kv = engine.kv_manager
    assert kv.num_used_blocks == 0 and kv.swap_pool.num_free == kv.swap_pool.num_blocks
    return requests


def chat_turns(vocab_size: int, num_users: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A system prompt shared by every user, and each user's first message."""
    g = random.Random(seed)
    system = [g.randrange(3, vocab_size) for _ in range(40)]
    return system, [[g.randrange(3, vocab_size) for _ in range(g.randrange(4, 12))] for _ in range(num_users)]


def test_prefixes_the_device_evicted_come_back_from_the_host_tier(tmp_path):
    """Six users, two turns each, one at a time, through a device cache that holds about
    one conversation: the second turns find their history in the host tier (and the first
    turns the system prompt), and every token is transformers'."""
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    system, firsts = chat_turns(hf_model.config.vocab_size, 6, seed=1)
    kwargs = dict(dtype="float64", block_size=4, num_kv_blocks=24, num_swap_blocks=0)
    engines = {"tier": LLM(model_dir, num_offload_blocks=160, **kwargs).engine, "device": LLM(model_dir, **kwargs).engine}
    histories = {name: [system + first for first in firsts] for name in engines}
    host_cached = 0  # the requests' own count: what their usage reports
    for turn in range(2):
        for user in range(len(firsts)):
            outputs = {}
            for name, engine in engines.items():
                prompt = histories[name][user]
                [request] = run_requests(engine, [prompt], [10])
                outputs[name] = request.output_token_ids
                histories[name][user] = prompt + outputs[name] + [5 + turn, 6 + user, 7]
                assert 0 <= request.num_host_cached_tokens <= request.num_cached_tokens
                host_cached += request.num_host_cached_tokens if name == "tier" else 0
            assert outputs["tier"] == outputs["device"] == hf_greedy(hf_model, prompt, 10)
    tier, device = (engines[name].kv_manager.prefix_stats for name in ("tier", "device"))
    # The device alone keeps the hot system prompt; the histories come back from the host.
    assert tier.num_host_hit_tokens >= 80 and tier.num_hit_tokens >= device.num_hit_tokens + 80
    assert host_cached == tier.num_host_hit_tokens  # one admission each
    metrics = engines["tier"].get_metrics()  # as the worker exports them (WorkerStats, /metrics, baton status)
    assert metrics.prefix_cache_host_hit_tokens == tier.num_host_hit_tokens
    assert metrics.kv_offload_reloaded_bytes == tier.num_host_hit_tokens // 4 * engines["tier"].kv_layout.bytes_per_block
    assert metrics.num_kv_offload_blocks_total == 160 and 0 < metrics.num_kv_offload_blocks_cached
    assert metrics.kv_offload_reload_seconds > 0  # the reloads' copies, timed
    assert metrics.kv_offload_written_blocks == metrics.num_kv_offload_blocks_cached  # nothing evicted: 160 hold all
    assert engines["device"].get_metrics().num_kv_offload_blocks_total == 0


def test_swap_preemption_takes_the_host_tiers_room_when_it_needs_it(tmp_path):
    """A host pool shared by swapped requests and the tier: a batch that must swap finds the
    tier's blocks evictable and swaps anyway; the tokens are transformers'."""
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    system, firsts = chat_turns(hf_model.config.vocab_size, 8, seed=2)
    prompts = [system + first for first in firsts]
    llm = LLM(model_dir, dtype="float64", block_size=4, num_kv_blocks=40, num_swap_blocks=4, num_offload_blocks=60,
              max_num_batched_tokens=32, preemption_mode="swap", admission_reserve_steps=0)
    run_checked(llm.engine, [p[::-1] for p in prompts], [12] * len(prompts))  # fill the tier with other blocks
    assert llm.engine.kv_manager.swap_pool.num_cached > 30
    outputs = run_checked(llm.engine, prompts, [24] * len(prompts))
    assert outputs == [hf_greedy(hf_model, p, 24) for p in prompts]
    metrics = llm.get_metrics()
    assert metrics.num_preemptions_swap > 0 and metrics.num_kv_offload_evicted > 0


@pytest.fixture(scope="module")
def tiny_float64_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), dtype=torch.float64)


# Per example of the property test: (the host tier's blocks, the prompt tokens found there).
host_hits: list[tuple[int, int]] = []

turns = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 12)), min_size=10, max_size=24)  # (new tokens, max_tokens)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(turns=turns, seed=st.integers(0, 2**16), num_kv_blocks=st.integers(30, 40),
       num_offload_blocks=st.sampled_from([8, 40, 200]), batch=st.integers(1, 3))
def test_random_chats_give_the_tokens_of_caching_off(tiny_float64_model, turns, seed, num_kv_blocks,
                                                    num_offload_blocks, batch):
    """Six chats of up to 100 tokens (blocks of 4) take turns, each round in a random order,
    a few turns at a time, through a device cache too small for them: the same tokens as
    with prefix caching off, every check passing after every step."""
    hf_model, model_dir = tiny_float64_model
    system, firsts = chat_turns(hf_model.config.vocab_size, 6, seed=seed)
    kwargs = dict(dtype="float64", block_size=4, num_kv_blocks=num_kv_blocks, num_swap_blocks=2,
                  max_num_batched_tokens=16, admission_reserve_steps=0)
    tiered = LLM(model_dir, num_offload_blocks=num_offload_blocks, **kwargs).engine
    plain = LLM(model_dir, enable_prefix_caching=False, **kwargs).engine
    histories = [system + first for first in firsts]
    order = random.Random(seed)
    users = [user for _ in range(-(-len(turns) // 6)) for user in order.sample(range(6), 6)]
    for start in range(0, len(turns), batch):
        group = list(dict.fromkeys(users[start:min(start + batch, len(turns))]))  # one turn a chat at a time
        max_tokens = [turns[start + i][1] for i in range(len(group))]
        got = run_checked(tiered, [histories[user] for user in group], max_tokens)
        assert got == run_checked(plain, [histories[user] for user in group], max_tokens)
        for i, (user, output) in enumerate(zip(group, got)):
            history = histories[user] + output + [3 + (user * 7 + k) % 50 for k in range(turns[start + i][0])]
            histories[user] = history if len(history) <= 100 else system + firsts[user]  # a new chat
    host_hits.append((num_offload_blocks, tiered.kv_manager.prefix_stats.num_host_hit_tokens))


def test_the_random_chats_reach_the_host_tier(tiny_float64_model):
    """The property above is worth something only if the chats come back to evicted prefixes
    (a host tier of 8 blocks keeps only the latest few: those cases prove little, and count not)."""
    host_hits.clear()
    test_random_chats_give_the_tokens_of_caching_off(tiny_float64_model)
    roomy = [hit for num_blocks, hit in host_hits if num_blocks >= 40]
    assert sum(hit > 0 for hit in roomy) >= len(roomy) // 2, host_hits
