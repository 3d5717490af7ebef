"""Prompt logprobs equal transformers' log-softmax over the prompt: prefilled in chunks, in
a batch beside other prompts, overlapped or not, a prompt the prefix cache holds (computed
again, not skipped), and after a preemption by recompute (what was computed is kept)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-prompt-logprobs"), vocab_size=160, dtype=torch.float64)


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the log-softmax that predicts prompt token i + 1."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].double()
    return logits.log_softmax(dim=-1)


def check(entries, reference: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(reference[i, prompt[i + 1]].item(), abs=1e-9)
        top = reference[i].topk(k)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()
        assert [lp for _, lp in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-9)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers_in_chunks_and_beside_other_prompts(tiny, overlap):
    model, path = tiny
    llm = LLM(path, dtype="float64", block_size=4, max_num_batched_tokens=16, overlap_scheduling=overlap)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (37, 5, 20, 1)]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, 5)]
    params.append(SamplingParams(max_tokens=2, prompt_logprobs=1))
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        check(out.prompt_logprobs, hf_prompt_logprobs(model, prompt), prompt, p.prompt_logprobs)
    # The same prompt again: the prefix cache holds it, and is not read for it.
    again = llm.generate([prompts[0]], [params[0]])[0]
    assert again.prompt_logprobs == outputs[0].prompt_logprobs and again.num_cached_tokens == 0
    # Asked by no one: none computed, and the cache is read as usual.
    plain = llm.generate([prompts[0]], [SamplingParams(max_tokens=1)])[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_one_token_chunk_of_a_prompt_is_computed_too(tiny, overlap):
    """A step's budget left for one token of a prompt whose logprobs are asked: that token
    is a prefill chunk of one (not a decode row), and its entry is there."""
    model, path = tiny
    llm = LLM(path, dtype="float64", block_size=4, max_num_batched_tokens=16, overlap_scheduling=overlap)
    prompts = [list(range(20, 35)), list(range(50, 59))]  # 15 tokens, then 1 of the second's 9 fit
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=1)]
    outputs = llm.generate(prompts, params)
    check(outputs[1].prompt_logprobs, hf_prompt_logprobs(model, prompts[1]), prompts[1], 1)


def test_prompt_logprobs_survive_a_preemption_by_recompute(tiny):
    model, path = tiny
    llm = LLM(path, dtype="float64", block_size=4, max_num_batched_tokens=24, max_num_seqs=8, num_kv_blocks=30,
              preemption_mode="recompute", admission_reserve_steps=0)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (30, 28, 25, 26)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=3)] * len(prompts)
    outputs = llm.generate(prompts, params)
    assert llm.get_metrics().num_preemptions_recompute > 0
    for prompt, out in zip(prompts, outputs):
        check(out.prompt_logprobs, hf_prompt_logprobs(model, prompt), prompt, 3)

