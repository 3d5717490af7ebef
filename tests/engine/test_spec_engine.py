"""Speculative decoding inside the engine (engine/spec_decode/speculator.py,
engine/scheduler/speculative.py): with n-gram proposals on, greedy tokens equal
transformers' (chunked prompts, preemption by recompute and by swap, prefix caching,
overlap asked for), seeded sampling gives the same tokens as without speculation, unseeded
sampling keeps the model's distribution (chi-square), stops inside the accepted proposals
end the request there, logprobs and min_tokens are those of plain decoding, and no KV
block outlives its request."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.request import Request
from engine.spec_decode.speculator import best_num_proposals, expected_tokens
from tests.engine.test_parity import SMOLLM2_CHATS, TINY_CONFIGS
from tests.support.tiny_models import hf_greedy, make_tiny_model


def copying_prompts(vocab_size: int, num_prompts: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase a few times, with noise between: the tiny
    models' greedy output falls into loops, and proposals from the prompt and the output
    are accepted in part."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):
        phrase = torch.randint(3, vocab_size, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(3, vocab_size, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        prompts.append(phrase * int(torch.randint(1, 4, (1,), generator=g)) + noise + phrase)
    return prompts


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Request]:
    """Run every prompt to its end, checking the scheduler's and the KV cache's invariants
    after each step; then every block is back in the pool."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.kv_manager.num_used_blocks == 0
    return requests


def count_step_kinds(engine: LLMEngine) -> dict[str, int]:
    """Counts, as the engine steps, of its steps left in flight (overlapped) and of those that
    checked proposals (which run plain: their rows' last tokens are read first)."""
    kinds = {"overlapped": 0, "checked": 0}
    launch = engine._launch

    def counting_launch(plan):
        launched = launch(plan)
        kinds["checked"] += bool(launched.scheduled.spec_token_ids)
        return launched

    step = engine.step

    def counting_step():
        out = step()
        kinds["overlapped"] += engine.overlap.step is not None
        return out

    engine._launch, engine.step = counting_launch, counting_step
    return kinds


def spec_stats(engine: LLMEngine):
    stats = engine.speculator.stats()
    assert stats.num_accepted > 0, "no proposal was accepted: the test checks nothing"
    assert stats.num_accepted < stats.num_proposed, "no proposal was rejected: the test checks half"
    return stats


@pytest.mark.parametrize("name", ["llama-gqa-hd32-untied-bias", "qwen2-gqa-hd32-qkv-bias"])
@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_greedy_parity_with_speculation_under_chunking_and_preemption(name, preemption_mode, tmp_path):
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS[name]
    hf_model, model_dir = make_tiny_model(tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float64,
                                          **extra)
    prompts = copying_prompts(hf_model.config.vocab_size, 16, seed=len(name))
    max_tokens = [int(n) for n in torch.randint(6, 40, (len(prompts),), generator=torch.Generator().manual_seed(1))]
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model_dir, dtype="float64", block_size=4, max_num_batched_tokens=24, max_num_seqs=16,
              num_kv_blocks=40, num_swap_blocks=8, preemption_mode=preemption_mode, admission_reserve_steps=0,
              overlap_scheduling=True,  # the steps that check nothing overlap; those that check run plain
              speculative="ngram", num_speculative_tokens=5, prompt_lookup_min=1, adaptive=False)
    engine = llm.engine
    assert engine.overlap.enabled
    kinds = count_step_kinds(engine)
    requests = run_checked(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                             for n in max_tokens])
    assert kinds["overlapped"] > 0 and kinds["checked"] > 0, kinds
    for prompt, request, want in zip(prompts, requests, expected):
        assert request.output_token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert request.finish_reason == "length"
    spec_stats(engine)
    metrics = llm.get_metrics()
    kind = "num_preemptions_swap" if preemption_mode == "swap" else "num_preemptions_recompute"
    assert getattr(metrics, kind) > 0, "the pool should force preemption"


def test_the_prefix_cache_holds_accepted_tokens_only(tmp_path):
    # The outputs' blocks enter the prefix cache as computed: accepted proposals, never a
    # rejected one's slot. Prompts that continue the outputs reuse them, and go on alike.
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    prompts = copying_prompts(hf_model.config.vocab_size, 12, seed=11)
    expected = [hf_greedy(hf_model, p, 32) for p in prompts]
    llm = LLM(model_dir, dtype="float64", block_size=4, speculative="ngram", prompt_lookup_min=1, adaptive=False)
    first = run_checked(llm.engine, prompts, [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)] * 12)
    assert [r.output_token_ids for r in first] == expected
    longer = [p + want[:13] for p, want in zip(prompts, expected)]
    again = run_checked(llm.engine, longer, [SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)] * 12)
    assert [r.output_token_ids for r in again] == [want[13:] for want in expected]
    assert sum(r.num_cached_tokens for r in again) >= sum(len(p) + 13 - 4 for p in prompts) - 3 * len(prompts)
    spec_stats(llm.engine)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tmp_path):
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    prompts = copying_prompts(hf_model.config.vocab_size, 12, seed=3)
    shapes = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_p=0.8),
              dict(temperature=1.2, min_p=0.1), dict(temperature=0.8, logit_bias={7: 2.0})]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=100 + i, **shapes[i % len(shapes)])
              for i in range(len(prompts))]
    runs = []
    for spec in (None, "ngram", "ngram"):
        llm = LLM(model_dir, dtype="float64", block_size=4, max_num_seqs=8, speculative=spec, prompt_lookup_min=1,
                  adaptive=False)
        runs.append([r.output_token_ids for r in run_checked(llm.engine, prompts, params)])
        if spec is not None:
            spec_stats(llm.engine)
    plain, speculative, again = runs
    assert speculative == plain
    assert again == speculative


def chi_square_critical(degrees: int, z: float = 3.09) -> float:
    """The chi-square value a correct sampler exceeds with probability ~0.001 (z: the
    normal quantile), by the Wilson-Hilferty approximation."""
    h = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - h + z * math.sqrt(h)) ** 3


@torch.no_grad()
def exact_sequence_probs(hf_model, prompt: list[int], length: int, temperature: float, top_k: int) -> dict:
    """The probability of every `length`-token continuation under the model sampled with
    `temperature` and `top_k`, by enumeration."""
    probs = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in probs.items():
            logits = hf_model(torch.tensor([prompt + list(prefix)])).logits[0, -1] / temperature
            kth = logits.topk(top_k).values[-1]
            step = torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
            for token in torch.nonzero(step).flatten().tolist():
                grown[prefix + (token,)] = p * float(step[token])
        probs = grown
    return probs


@pytest.mark.parametrize("temperature,top_k,method", [(1.3, 8, "ngram"), (1.0, 4, "ngram"), (1.0, 4, "draft")])
def test_unseeded_sampling_keeps_the_models_distribution(temperature, top_k, method, tmp_path):
    # A vocabulary of 8 and a prompt that is the model's own greedy output: after almost
    # any first token the prompt lookup proposes two, and they are accepted about as often
    # as rejected.
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64, vocab_size=8, seed=2)
    prompt = [3, *hf_greedy(hf_model, [3], 14)]
    length, trials = 3, 4000
    probs = exact_sequence_probs(hf_model, prompt, length, temperature, top_k)
    # The draft: the model itself, greedy, whose proposals a sampled row accepts only in part.
    draft = dict(draft_model=model_dir) if method == "draft" else dict(prompt_lookup_min=1)
    llm = LLM(model_dir, dtype="float64", block_size=4, max_num_seqs=512, max_num_batched_tokens=4096, seed=7,
              enable_prefix_caching=False, speculative=method, num_speculative_tokens=3, adaptive=False, **draft)
    # One token more than counted: a row proposes no further than its max_tokens, and its
    # first decode step should check proposals for both the second and the third token.
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=length + 1, ignore_eos=True)
    requests = run_checked(llm.engine, [prompt] * trials, [params] * trials)
    counts: dict[tuple, int] = {}
    for request in requests:
        key = tuple(request.output_token_ids[:length])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(probs)
    stats = spec_stats(llm.engine)
    assert stats.accepted_by_position[1] > 0, "second proposals were never accepted"
    # Cells expected fewer than 5 times are pooled into one.
    chi2, degrees, pooled_expected, pooled_seen = 0.0, -1, 0.0, 0
    for key, p in probs.items():
        expected = p * trials
        if expected < 5:
            pooled_expected += expected
            pooled_seen += counts.get(key, 0)
            continue
        chi2 += (counts.get(key, 0) - expected) ** 2 / expected
        degrees += 1
    if pooled_expected > 0:
        chi2 += (pooled_seen - pooled_expected) ** 2 / pooled_expected
        degrees += 1
    assert degrees >= 10
    assert chi2 < chi_square_critical(degrees), (chi2, degrees)


def test_stops_inside_the_accepted_proposals_end_the_request_there(tmp_path):
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    prompts = copying_prompts(hf_model.config.vocab_size, 10, seed=5)
    greedy = [hf_greedy(hf_model, p, 40) for p in prompts]
    # A stop token taken from the middle of each output; and max_tokens cut at odd places.
    stops = [out[len(out) // 2 + i % 5] for i, out in enumerate(greedy)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
              for stop in stops]
    params += [SamplingParams(temperature=0.0, max_tokens=7 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(model_dir, dtype="float64", block_size=4, speculative="ngram", prompt_lookup_min=1,
              num_speculative_tokens=6, adaptive=False)
    requests = run_checked(llm.engine, prompts * 2, params)
    for i, (request, out, stop) in enumerate(zip(requests, greedy, stops)):
        want = out[:out.index(stop) + 1]
        assert request.output_token_ids == want and request.finish_reason == "stop", i
        assert request.stop_reason == stop
    for i, (request, out) in enumerate(zip(requests[len(prompts):], greedy)):
        assert request.output_token_ids == out[:7 + 3 * i] and request.finish_reason == "length", i
    spec_stats(llm.engine)


def test_logprobs_and_min_tokens_are_those_of_plain_decoding(tmp_path):
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    prompts = copying_prompts(hf_model.config.vocab_size, 8, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, min_tokens=6 if i % 2 else 0,
                             stop_token_ids=[p[-1]]) for i, p in enumerate(prompts)]
    runs = []
    for spec in (None, "ngram"):
        llm = LLM(model_dir, dtype="float64", block_size=4, speculative=spec, prompt_lookup_min=1, adaptive=False)
        runs.append(run_checked(llm.engine, prompts, params))
    spec_stats(llm.engine)
    for plain, speculative in zip(*runs):
        assert speculative.output_token_ids == plain.output_token_ids
        assert speculative.finish_reason == plain.finish_reason
        assert len(speculative.logprobs) == len(speculative.output_token_ids)
        for mine, theirs in zip(speculative.logprobs, plain.logprobs):
            assert mine.token_id == theirs.token_id
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-9)
            assert [t for t, _ in mine.top_logprobs] == [t for t, _ in theirs.top_logprobs]


@pytest.mark.parametrize("draft", ["target", "small"])
def test_a_draft_models_proposals_give_transformers_tokens(draft, tmp_path):
    """Draft models: the target itself (every greedy proposal accepted) and a smaller random
    model (few accepted); either way greedy tokens are transformers', under chunking and
    preemption, and seeded ones those of plain decoding; the draft's cache is empty after."""
    hf_model, model_dir = make_tiny_model(tmp_path / "target", dtype=torch.float64)
    draft_dir = model_dir if draft == "target" else make_tiny_model(
        tmp_path / "draft", dtype=torch.float64, hidden_size=32, num_layers=1, seed=5)[1]
    prompts = copying_prompts(hf_model.config.vocab_size, 10, seed=8)
    expected = [hf_greedy(hf_model, p, 24) for p in prompts]
    seeded = [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=50 + i) for i in range(10)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 10
    kwargs = dict(dtype="float64", block_size=4, max_num_batched_tokens=24, num_kv_blocks=28, num_swap_blocks=8,
                  admission_reserve_steps=0)
    plain = run_checked(LLM(model_dir, **kwargs).engine, prompts, seeded)
    llm = LLM(model_dir, speculative="draft", draft_model=draft_dir, adaptive=False, **kwargs)
    engine = llm.engine
    assert [r.output_token_ids for r in run_checked(engine, prompts, greedy)] == expected
    stats = engine.speculator.stats()
    assert stats.num_proposed > 0
    if draft == "target":  # its greedy drafts are the target's greedy tokens
        assert stats.num_accepted == stats.num_proposed
    assert [r.output_token_ids for r in run_checked(engine, prompts, seeded)] == [r.output_token_ids for r in plain]
    assert llm.get_metrics().num_preemptions_swap + llm.get_metrics().num_preemptions_recompute > 0
    assert engine.speculator.draft.kv.num_used_blocks == 0 and not engine.speculator.draft.shadows


def test_a_draft_model_must_share_the_targets_vocabulary(tmp_path):
    _, model_dir = make_tiny_model(tmp_path / "target", dtype=torch.float64)
    _, other = make_tiny_model(tmp_path / "draft", dtype=torch.float64, vocab_size=96)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model_dir, dtype="float64", speculative="draft", draft_model=other)
    with pytest.raises(ValueError, match="draft model"):
        LLM(model_dir, dtype="float64", speculative="draft")


def test_rows_whose_sampling_reads_their_history_do_not_speculate(tmp_path):
    _, model_dir = make_tiny_model(tmp_path, dtype=torch.float64)
    prompt = [5, 6, 7, 8] * 4
    llm = LLM(model_dir, dtype="float64", block_size=4, speculative="ngram", prompt_lookup_min=1, adaptive=False)
    for params in (SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.5),
                   SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=False)):
        run_checked(llm.engine, [prompt], [params])
        assert llm.engine.speculator.stats().num_checks == 0, params
    run_checked(llm.engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=12)])
    assert llm.engine.speculator.stats().num_checks > 0


def test_the_off_switch_weighs_acceptance_against_the_step_time_model():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    # A step whose extra tokens cost little (a GPU at small batch): speculate with little hope.
    assert best_num_proposals(0.3, 1, step_s=0.010, token_s=0.0002, max_proposals=4) > 0
    # Each extra token costs a tenth of a step: worth it at a high acceptance rate only.
    assert best_num_proposals(0.9, 1, step_s=0.050, token_s=0.005, max_proposals=4) == 4
    assert best_num_proposals(0.05, 1, step_s=0.050, token_s=0.005, max_proposals=4) == 0
    # A large batch makes every extra token cost a row's share of the step.
    assert best_num_proposals(0.6, 32, step_s=0.060, token_s=0.0015, max_proposals=4) == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_greedy_parity_with_speculation_on_a_copying_task(method, smollm2_hf):
    """SmolLM2-135M: n-gram proposals, or SmolLM2-135M's own as a draft model (loaded by name
    from its GGUF, as `--draft-model` loads one), give transformers' greedy tokens."""
    hf_model, tokenizer = smollm2_hf
    from engine.model.loader import load_from_hf_model

    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump!")
    chats = [f"Repeat this text exactly: {text}", *SMOLLM2_CHATS[:3]]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for c in chats]
    expected = [hf_greedy(hf_model, p, 40, stop_at_eos=True) for p in prompts]
    loaded = load_from_hf_model(hf_model, tokenizer, torch.float32, "smollm2-135m")
    llm = LLM("smollm2-135m", dtype="float32", block_size=4, max_num_batched_tokens=32, num_kv_blocks=70,
              num_swap_blocks=16, admission_reserve_steps=0, loaded_model=loaded, speculative=method, adaptive=False,
              draft_model="smollm2-135m" if method == "draft" else None)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    for chat, out, want in zip(chats, outputs, expected):
        assert out.token_ids == want, chat
    # A stop string met inside accepted proposals cuts the text, and the tokens, there.
    stopped = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=40, stop=["five"]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == tokenizer.decode(expected[0]).split("five")[0]
    stats = llm.engine.speculator.stats()
    assert stats.num_accepted > 10 and llm.get_metrics().num_kv_blocks_used == 0
