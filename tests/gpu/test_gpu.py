"""The engine and the workers on a CUDA GPU (marker `gpu`: skipped without one; `make test-gpu`).

The Triton kernels' own tests (tests/kernels/test_triton_kernels.py) run natively there
too, in bfloat16 as well; these check the whole engine on the GPU: greedy
parity with transformers in float32 under chunking and preemption (of both kinds
on the plain loop), with CUDA graphs and overlapped scheduling (the defaults on
CUDA) and without; steps that never make the host wait on the device but to read their
tokens; KV sizing by profiling, random-weight models in bfloat16, and a streamed
request through `baton up --colocated --device cuda` (marker `gpu_servers`: `make test-gpu`
runs it in a pytest process of its own, so that the server finds the GPU free).

Each test holds the GPU memory it uses until it ends, no longer (tests/conftest.py gives
it back between tests), so the tests do not depend on each other or on their order.
"""

from __future__ import annotations


import pytest
import torch

from engine import LLM, SamplingParams
from tests.serving.test_device import baton_up_streams_text
from tests.engine.test_parity import TINY_CONFIGS, mixed_workload
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs-overlap", "eager-plain"])
@pytest.mark.parametrize("name", ["llama-gqa-hd32-untied-bias", "qwen2-gqa-hd32-qkv-bias", "llama3-rope-gqa-hd16"])
def test_greedy_parity_on_gpu_float32(name, eager, tmp_path):
    """Lengths alone decide the schedule, and the loop: the eager, plain loop schedules as
    on the CPU, where this pool preempts by swap and, once the swap pool is full, by
    recompute, for each of these models (tests/engine/test_parity.py). Overlapped scheduling admits
    and preempts at other steps, so there only preemption itself is asserted, not its kinds."""
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS[name]
    hf_model, model_dir = make_tiny_model(
        tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32, **extra
    )
    hf_model = hf_model.to("cuda")
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=20, seed=len(name))
    with torch.device("cuda"):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]

    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=20,
        num_kv_blocks=28,
        num_swap_blocks=6,
        preemption_mode="swap",
        admission_reserve_steps=0,
        enforce_eager=eager,
        overlap_scheduling=not eager,
    )
    engine = llm.engine
    assert engine.runner.backend.name == "triton"
    assert (engine.graph_capture is None) == eager and engine.overlap.enabled == (not eager)
    replayed = []
    if not eager:
        assert engine.graph_capture.batch_sizes == (1, 2, 4, 8, 16, 20)
        # The graphs' pool, as this process's allocator counts it: other processes cannot move it.
        assert engine.graph_capture.seconds > 0 and engine.graph_capture.memory_bytes > 0
        prepare = engine.runner.static_decode.prepare
        engine.runner.static_decode.prepare = lambda out: replayed.append(prepare(out)) or replayed[-1]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == expected
    if not eager:
        assert sum(p is not None for p in replayed) > 10, "decode steps should replay graphs"
    stats = llm.get_metrics()
    if eager:
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0, stats
    else:
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0, stats


def test_kv_cache_sized_from_gpu_memory_utilization():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.reset_peak_memory_stats()  # this test's peak, not an earlier test's
    llm = LLM("dummy:llama-3.2-1b", device="cuda", gpu_memory_utilization=0.3, max_model_len=4096)
    engine = llm.engine
    assert engine.kv_cache.blocks.device.type == "cuda" and engine.kv_cache.blocks.dtype == torch.bfloat16
    assert engine.kv_cache.swap_blocks.is_pinned()
    cache_bytes = engine.kv_cache.num_blocks * engine.kv_layout.bytes_per_block
    assert cache_bytes > 1 << 30, "a 1B model leaves gigabytes of 30% of a datacenter GPU for KV"
    # Weights, cache and the step's activations stay inside the fraction.
    outputs = llm.generate([[5] * 2000] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(out.token_ids) == 4 for out in outputs)
    assert torch.cuda.max_memory_allocated() <= 0.3 * total + (256 << 20)


def test_dummy_model_in_bfloat16_streams_tokens_and_is_seeded():
    # No prefix caching: the repeat would reuse the first run's full blocks and compute only
    # the prompt's last tokens, in matmuls of another shape, whose bfloat16 rounding may
    # change what is sampled. Both runs compute the same tokens in the same steps instead.
    llm = LLM("dummy:smollm2-135m", device="cuda", kv_cache_memory_bytes=1 << 30, seed=7,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=3, ignore_eos=True)
    first = llm.generate(["The quick brown fox"], params)[0]
    again = llm.generate(["The quick brown fox"], params)[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    assert all(0 <= token < 49152 for token in first.token_ids)
    assert first.text  # the dummy tokenizer decodes every id


@pytest.mark.gpu_servers
def test_baton_up_colocated_on_cuda_answers_a_streamed_request(tmp_path):
    # 0.8 of the GPU for the one worker (an 8B model's 16 GB of weights, then its cache): that
    # share must be free when it starts, so `make test-gpu` runs this test in a pytest process
    # that holds no GPU memory (marker gpu_servers).
    baton_up_streams_text(tmp_path, ["--device", "cuda", "--model", "dummy:llama-3.1-8b",
                                     "--gpu-memory-utilization", "0.8", "--max-model-len", "4096"])


def test_a_step_waits_on_the_device_only_to_read_its_tokens(tmp_path):
    """Under sync debug mode "error" every synchronizing call raises (a blocking copy, a
    .item(), a nonzero, torch.cuda.synchronize): the engine steps a mixed batch of every
    sampling option, prefill chunks, decodes replayed as graphs and overlapped, and the
    only wait left is the event behind the tokens' copy, which the mode does not flag."""
    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, num_kv_blocks=256)
    engine = llm.engine
    options = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, logprobs=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, min_tokens=6, stop_token_ids=[7, 9], max_tokens=12),
    ]
    for round_index in range(2):  # the first compiles the kernels and fills the caches
        for i, params in enumerate(options):
            engine.add_request([10 + i + j for j in range(5 + 7 * i)], params, request_id=f"{round_index}-{i}")
        torch.cuda.set_sync_debug_mode("error" if round_index else "default")
        try:
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == 256
