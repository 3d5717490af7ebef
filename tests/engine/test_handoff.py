"""KV handoff at the engine level: a prefill_only engine holds a prompt's KV, a second
engine receives it into its own blocks and continues. The blocks are copied by hand
here; kvtransfer moves them between processes."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig
from engine.engine import LLMEngine
from engine.request import RequestStatus
from tests.engine.test_engine import make_engine, run
from tests.support.tiny_models import hf_greedy, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-handoff")
    return make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64)


def copy_blocks(src: LLMEngine, src_ids: list[int], dst: LLMEngine, dst_ids: list[int]) -> None:
    assert len(src_ids) == len(dst_ids)
    for (src_k, src_v), (dst_k, dst_v) in zip(src.kv_cache.layers, dst.kv_cache.layers):
        dst_k[dst_ids] = src_k[src_ids]
        dst_v[dst_ids] = src_v[src_ids]


def prefill(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams):
    """Run prefill_only requests until each is held or finished: {id: (first token, block ids)}."""
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=request_id, prefill_only=True)
    results = {}
    while len(results) < len(prompts):
        for out in engine.step().outputs:
            assert out.request_id not in results
            results[out.request_id] = (out.new_token_ids[0], out.kv_block_ids, out.finished)
    return results


def handoff(prefill_engine, decode_engine, prompts, params, fail: set[str] = frozenset(), finals=None):
    """Prefill on one engine, hand every held KV to the other, decode there to the end
    (`finals`: each request's last output on the decode engine goes there)."""
    firsts = prefill(prefill_engine, prompts, params)
    outputs = {}
    for request_id, (first, block_ids, finished) in firsts.items():
        outputs[request_id] = [first]
        if finished:
            continue
        assert prefill_engine.get_request(request_id).status == RequestStatus.HELD
        decode_engine.add_prefilled_request(prompts[request_id], first, params, request_id=request_id)
    held = {rid: ids for rid, (_, ids, finished) in firsts.items() if not finished}
    for _ in range(5000):
        if not decode_engine.has_unfinished_requests():
            break
        step = decode_engine.step()
        for receive in step.kv_receives:
            ok = receive.request_id not in fail
            if ok:  # only the blocks the decode engine's prefix cache does not hold
                reused, sent = receive.num_reused_blocks, held[receive.request_id]
                copy_blocks(prefill_engine, sent[reused:], decode_engine, receive.block_ids[reused:len(sent)])
            assert prefill_engine.release_kv(receive.request_id)
            assert decode_engine.complete_kv_receive(receive.request_id, ok)
        for out in step.outputs:
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished and finals is not None:
                finals[out.request_id] = out
        decode_engine.check_integrity()
        prefill_engine.check_integrity()
    assert not decode_engine.has_unfinished_requests()
    return outputs


def test_handoff_greedy_equals_transformers(tiny):
    hf_model, model_dir = tiny
    prefill_engine = make_engine(model_dir)
    decode_engine = make_engine(model_dir, max_num_batched_tokens=16)
    prompts = {f"r{i}": list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(6)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = handoff(prefill_engine, decode_engine, prompts, params, fail={"r2"})
    for request_id, prompt in prompts.items():
        assert outputs[request_id] == hf_greedy(hf_model, prompt, 12), request_id
    for engine in (prefill_engine, decode_engine):
        stats = engine.get_metrics()
        assert stats.num_kv_blocks_used == 0
        assert stats.num_held == stats.num_receiving == 0
    # The failed receive fell back to prefilling here: the decode engine ran that prompt.
    assert decode_engine.get_metrics().num_tokens_scheduled_total > 6 * 11


def test_handoff_keeps_seeded_sampling(tiny):
    _, model_dir = tiny
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    prompt = list(range(10, 30))
    alone = run_one(make_engine(model_dir), prompt, params)
    split = handoff(make_engine(model_dir), make_engine(model_dir), {"s": prompt}, params)["s"]
    assert split == alone


def run_one(engine: LLMEngine, prompt, params) -> list[int]:
    engine.add_request(prompt, params, request_id="s")
    return run(engine)["s"]


def test_first_token_that_ends_the_request_holds_nothing(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir)
    firsts = prefill(engine, {"one": list(range(5, 12))}, SamplingParams(temperature=0.0, max_tokens=1))
    first, block_ids, finished = firsts["one"]
    assert finished and block_ids is None
    assert engine.get_metrics().num_kv_blocks_used == 0


def test_abort_while_held_or_receiving_frees_blocks(tiny):
    _, model_dir = tiny
    prefill_engine, decode_engine = make_engine(model_dir), make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {"a": list(range(5, 25)), "b": list(range(30, 41))}
    firsts = prefill(prefill_engine, prompts, params)
    assert prefill_engine.get_metrics().num_held == 2
    assert prefill_engine.abort_request("a")
    assert prefill_engine.get_metrics().num_held == 1
    decode_engine.add_prefilled_request(prompts["b"], firsts["b"][0], params, request_id="b")
    assert [r.request_id for r in decode_engine.step().kv_receives] == ["b"]
    assert decode_engine.get_metrics().num_receiving == 1
    assert not decode_engine.has_work()  # nothing to run until the KV arrives
    assert decode_engine.abort_request("b")
    # Its blocks may be being written: they stay taken until the receive ends.
    assert decode_engine.get_metrics().num_kv_blocks_used > 0
    assert not decode_engine.abort_request("b")
    assert not decode_engine.complete_kv_receive("b", True)
    assert prefill_engine.release_kv("b") and not prefill_engine.release_kv("b")
    for engine in (prefill_engine, decode_engine):
        engine.step()  # reports the aborts
        engine.check_integrity()
        assert engine.get_metrics().num_kv_blocks_used == 0
        assert not engine.has_unfinished_requests()


def test_handoff_with_cached_prefixes_on_both_sides(tiny):
    """The prefill engine computes only what its cache lacks; the decode engine receives only
    the blocks its cache lacks (the rest are never copied), and the tokens still equal
    transformers'."""
    hf_model, model_dir = tiny
    prefill_engine = make_engine(model_dir)
    decode_engine = make_engine(model_dir, max_num_batched_tokens=16)
    system = list(range(40, 60))  # five full blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = {"a0": system + [3, 4, 5], "a1": system + [6]}
    second = {"b0": system + [7, 8], "b1": system + [3, 4, 5, 9, 10], "b2": list(system)}
    outputs = handoff(prefill_engine, decode_engine, first, params)
    outputs |= handoff(prefill_engine, decode_engine, second, params)
    for request_id, prompt in (first | second).items():
        assert outputs[request_id] == hf_greedy(hf_model, prompt, 8), request_id
    prefill_stats, decode_stats = prefill_engine.get_metrics(), decode_engine.get_metrics()
    # The second round's prompts found the system prompt (b2: all of it but its last block).
    assert prefill_stats.prefix_cache_hit_tokens >= 20 + 20 + 16
    assert decode_stats.prefix_cache_reused_blocks >= 5 * 3
    assert decode_stats.prefix_cache_received_blocks > decode_stats.prefix_cache_reused_blocks
    for engine in (prefill_engine, decode_engine):
        stats = engine.get_metrics()
        assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_cached > 0
        engine.check_integrity()


def test_a_received_prompt_recomputed_after_a_preemption_reports_no_cached_tokens(tiny):
    """usage.cached_tokens is the prefill worker's count: a decode engine that preempts received
    requests by recompute, and finds their prompts cached at readmission, reports none (the
    gateway takes the count of the worker that prefilled last)."""
    hf_model, model_dir = tiny
    prefill_engine = make_engine(model_dir)
    decode_engine = make_engine(model_dir, cache=CacheConfig(block_size=4, num_kv_blocks=16, num_swap_blocks=0),
                                preemption_mode="recompute", admission_reserve_steps=0)
    prompts = {f"r{i}": [20 + i] * 3 + list(range(40, 49)) for i in range(3)}  # 3 blocks each, growing to 8
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    finals = {}
    outputs = handoff(prefill_engine, decode_engine, prompts, params, finals=finals)
    for request_id, prompt in prompts.items():
        assert outputs[request_id] == hf_greedy(hf_model, prompt, 20), request_id
    assert decode_engine.get_metrics().num_preemptions_recompute > 0
    assert {out.num_cached_tokens for out in finals.values()} == {None}


def test_a_received_prompt_is_admitted_ahead_of_local_prefills_whatever_the_budget(tiny):
    """A decode engine busy prefilling prompts of its own (their chunks take the step's whole
    token budget) admits a handed-off request at once, before the prompts that arrived
    before it: it takes blocks and no compute, and its client already has a token. Its
    output is the same as ever."""
    _, model_dir = tiny
    prefill_engine, decode_engine = make_engine(model_dir), make_engine(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = list(range(40, 52))
    first, block_ids, _ = prefill(prefill_engine, {"moved": prompt}, params)["moved"]
    for i in range(2):  # local prompts of 40 tokens, queued first: local-0's chunks take two steps' budgets
        decode_engine.add_request(list(range(60 + 40 * i, 100 + 40 * i)), params, request_id=f"local-{i}")
    decode_engine.step()
    decode_engine.add_prefilled_request(prompt, first, params, request_id="moved")
    step = decode_engine.step()  # no budget left for local-1: the received one is admitted all the same
    assert [r.request_id for r in step.kv_receives] == ["moved"]
    assert decode_engine.get_request("local-1").status == RequestStatus.WAITING
    assert decode_engine.get_metrics().num_waiting == 1
    [receive] = step.kv_receives
    copy_blocks(prefill_engine, block_ids, decode_engine, receive.block_ids)
    prefill_engine.release_kv("moved")
    assert decode_engine.complete_kv_receive("moved", True)
    outputs = run(decode_engine)
    assert [first, *outputs["moved"]] == hf_greedy(tiny[0], prompt, 6)


@pytest.mark.parametrize("handed_off", [True, False], ids=["serves-handoffs", "colocated"])
def test_decoding_rows_limit_the_prompt_tokens_of_an_engine_that_serves_handoffs(tiny, handed_off):
    """Once a decode engine has received a handed-off request, a step with decoding rows
    takes prompt tokens worth at most max_decode_stretch of its decode step, by its
    step-time model (here set: a 20 ms decode step, 1 ms a prompt token: 20 tokens a step);
    an engine that never received one (colocated) prefills within its token budget alone.
    Its running prompt's next chunk too. The step that samples the handed-off request's
    second token takes no prompt tokens at all. Outputs are the same either way."""
    model, model_dir = tiny
    prefill_engine = make_engine(model_dir)
    decode_engine = make_engine(model_dir, max_num_batched_tokens=64, max_decode_stretch=1.0)
    decode_engine.scheduler.decode_step_s = lambda num_seqs, num_context_tokens: 0.02
    decode_engine.cost_model.prefill_seconds_per_token = 0.001
    decode_engine.cost_model.num_prefill_observations = 1  # as measured
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt, local = list(range(40, 52)), list(range(60, 140))
    if handed_off:
        first, block_ids, _ = prefill(prefill_engine, {"moved": prompt}, params)["moved"]
        decode_engine.add_prefilled_request(prompt, first, params, request_id="moved")
        [receive] = decode_engine.step().kv_receives
        copy_blocks(prefill_engine, block_ids, decode_engine, receive.block_ids)
        prefill_engine.release_kv("moved")
        assert decode_engine.complete_kv_receive("moved", True)
    else:
        decode_engine.add_request(prompt, params, request_id="moved")
        decode_engine.step()  # its prompt, in one chunk: decoding from now on
    decode_engine.add_request(local, params, request_id="local")
    tokens = {"moved": [], "local": []}  # the first of moved's came a step before
    # Admitted with a first chunk, then the next (handed off: after moved's first decode step, alone).
    for computed in ((0, 20, 40) if handed_off else (64 - 1, 80)):
        for out in decode_engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
        assert decode_engine.get_request("local").num_computed_tokens == computed
    for request_id, new_tokens in run(decode_engine).items():
        tokens[request_id] += new_tokens
    assert tokens == {"moved": hf_greedy(model, prompt, 8)[1:], "local": hf_greedy(model, local, 8)}


def test_a_local_prompt_aged_past_a_received_one_goes_first(tiny):
    """Received requests go ahead of local prompts, but not of one whose aged level is
    better (it arrived priority_aging_steps or more before): with no token budget left,
    that local prompt holds the received one back a step (head of line), so a stream of
    handoffs cannot starve it."""
    model, model_dir = tiny
    prefill_engine = make_engine(model_dir)
    decode_engine = make_engine(model_dir, max_num_batched_tokens=16, priority_aging_steps=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = list(range(40, 52))
    first, block_ids, _ = prefill(prefill_engine, {"moved": prompt}, params)["moved"]
    decode_engine.add_request(list(range(60, 120)), params, request_id="local-0")
    decode_engine.step()  # local-0's chunks take the whole budget for three steps
    decode_engine.add_request(list(range(100, 120)), params, request_id="local-1")  # a level better than moved's
    decode_engine.step()
    decode_engine.add_prefilled_request(prompt, first, params, request_id="moved")
    assert not decode_engine.step().kv_receives  # local-1, with no budget, holds it back
    assert decode_engine.get_request("local-1").status == RequestStatus.WAITING
    step = decode_engine.step()  # local-0's last 12 tokens, local-1's first 4, then moved
    assert decode_engine.get_request("local-1").status == RequestStatus.RUNNING
    [receive] = step.kv_receives
    copy_blocks(prefill_engine, block_ids, decode_engine, receive.block_ids)
    prefill_engine.release_kv("moved")
    assert decode_engine.complete_kv_receive("moved", True)
    outputs = run(decode_engine)
    assert [first, *outputs["moved"]] == hf_greedy(model, prompt, 6)
    decode_engine.check_integrity()
