"""Speculative decoding on a CUDA GPU (marker `gpu`: skipped without one; `make test-gpu`,
and gpu-check's engine phase): the Triton decode kernel with checking entries, the CUDA
graphs of steps that check proposals, the CUDA generators of seeded rows rewound past the
draws of dropped proposals, and a draft model on the GPU. tests/engine/test_spec_engine.py checks
the same on CPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_parity import TINY_CONFIGS
from tests.engine.test_spec_engine import copying_prompts, count_step_kinds, run_checked, spec_stats
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

GREEDY_KW = dict(device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=16,
                 num_kv_blocks=40, num_swap_blocks=8, preemption_mode="swap", admission_reserve_steps=0)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_greedy_parity_with_speculation_on_gpu(eager, tmp_path):
    """N-gram proposals checked by the Triton decode kernel, in CUDA graphs of the entries'
    padded size (or eagerly), under chunking and preemption: transformers' greedy tokens."""
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS["llama-gqa-hd32-untied-bias"]
    hf_model, model_dir = make_tiny_model(tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32,
                                          **extra)
    hf_model = hf_model.to("cuda")
    prompts = copying_prompts(hf_model.config.vocab_size, 16, seed=4)
    max_tokens = [int(n) for n in torch.randint(6, 40, (len(prompts),), generator=torch.Generator().manual_seed(1))]
    with torch.device("cuda"):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model_dir, enforce_eager=eager, speculative="ngram", num_speculative_tokens=5, prompt_lookup_min=1,
              adaptive=False, **GREEDY_KW)
    engine = llm.engine
    assert engine.runner.backend.name == "triton" and engine.overlap.enabled
    kinds = count_step_kinds(engine)
    checked = []
    if not eager:
        prepare = engine.runner.static_decode.prepare

        def counting_prepare(out):
            prepared = prepare(out)
            if prepared is not None and prepared[0].sample_counts is not None:
                checked.append(sum(prepared[0].sample_counts))
            return prepared

        engine.runner.static_decode.prepare = counting_prepare
    requests = run_checked(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                             for n in max_tokens])
    for prompt, request, want in zip(prompts, requests, expected):
        assert request.output_token_ids == want, f"prompt of {len(prompt)} tokens diverged"
    spec_stats(engine)
    assert eager or checked, "no checking step replayed a graph"
    assert kinds["overlapped"] > 0 and kinds["checked"] > 0, kinds
    metrics = llm.get_metrics()
    assert metrics.num_preemptions_swap + metrics.num_preemptions_recompute > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_on_gpu_gives_the_same_tokens_with_and_without_speculation(method, tmp_path):
    """A seeded row's CUDA generator is rewound past the draws of the proposals it dropped;
    with a draft model (the target itself: its greedy drafts are often accepted) on the GPU."""
    hf_model, model_dir = make_tiny_model(tmp_path, dtype=torch.float32)
    prompts = copying_prompts(hf_model.config.vocab_size, 12, seed=3)
    shapes = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_p=0.8),
              dict(temperature=1.2, min_p=0.1)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=100 + i, **shapes[i % len(shapes)])
              for i in range(len(prompts))]
    # Plain steps, as on CPU: overlapped, a row whose lookup found nothing backs off, and few proposals are checked.
    kwargs = dict(device="cuda", dtype="float32", block_size=4, max_num_seqs=8, num_kv_blocks=256,
                  overlap_scheduling=False)
    plain = [r.output_token_ids for r in run_checked(LLM(model_dir, **kwargs).engine, prompts, params)]
    spec = dict(speculative=method, adaptive=False)
    spec.update(prompt_lookup_min=1) if method == "ngram" else spec.update(draft_model=model_dir)
    llm = LLM(model_dir, **kwargs, **spec)
    assert [r.output_token_ids for r in run_checked(llm.engine, prompts, params)] == plain
    spec_stats(llm.engine)
    if method == "draft":
        greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
        hf_model = hf_model.to("cuda")
        with torch.device("cuda"):
            expected = [hf_greedy(hf_model, p, 24) for p in prompts]
        before = llm.engine.speculator.stats()
        assert [r.output_token_ids for r in run_checked(llm.engine, prompts, greedy)] == expected
        after = llm.engine.speculator.stats()
        assert after.num_accepted - before.num_accepted == after.num_proposed - before.num_proposed > 0
        draft = llm.engine.speculator.draft
        assert draft.kv.num_used_blocks == 0 and not draft.shadows
