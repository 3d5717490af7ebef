"""The engine on the Triton attention backend gives transformers' greedy tokens.

Without a GPU the kernels run under Triton's interpreter on CPU tensors, in
float32 (the backend asks for the interpreter itself). The runs force what the
kernels must get right inside a real engine: prompts cut into chunks that
attend over their cached prefix, decodes and chunks in one launch, block size
4 so that sequences span many scattered blocks, and a pool small enough that
sequences are preempted by recompute and by swap. On a GPU the same test runs
natively, on the same loop (tests/gpu/test_gpu.py adds the CUDA-only checks, CUDA
graphs and overlapped scheduling among them).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_parity import TINY_CONFIGS, mixed_workload
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# MHA, GQA with biases and head dim 32, MQA with llama3 rope scaling.
@pytest.mark.parametrize("name", ["llama-mha-hd16-tied", "llama-gqa-hd32-untied-bias", "llama3-rope-gqa-hd16"])
def test_triton_backend_greedy_parity(name, tmp_path):
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS[name]
    hf_model, model_dir = make_tiny_model(
        tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32, **extra
    )
    # Lengths and the engine's loop alone decide the schedule: with this seed the pool
    # below preempts four times by recompute and once by swap, whatever the model, on the
    # plain loop (a step at a time, eager: the CPU's default, pinned for the GPU).
    # Overlapped scheduling, the GPU's default, admits and preempts at other steps.
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=8, seed=1)
    hf_model = hf_model.to(DEVICE)  # the reference on the same device
    with torch.device(DEVICE):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]

    llm = LLM(
        model_dir,
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        max_num_batched_tokens=24,  # prompts of up to 47 tokens span several chunks
        max_num_seqs=8,
        num_kv_blocks=16,  # 64 token slots for 8 sequences of up to ~70 tokens
        num_swap_blocks=4,
        preemption_mode="swap",
        admission_reserve_steps=0,
        overlap_scheduling=False,
        enforce_eager=True,
    )
    assert llm.engine.runner.backend.name == "triton"
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)

    for prompt, out, want in zip(prompts, outputs, expected):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
    stats = llm.get_metrics()
    assert stats.num_preemptions_recompute > 0, "the pool should force recompute preemption"
    assert stats.num_preemptions_swap > 0, "the pool should force swap preemption"
