"""Greedy parity with Hugging Face transformers, under chunking, mixed batches and preemption.

The engine runs with block size 4, a small token budget (prompts span several
chunks), many concurrent sequences of mixed lengths, and a KV pool small
enough that sequences are preempted both by recompute and by swap. The tokens
must still equal `model.generate(do_sample=False)` on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.request import RequestStatus
from tests.support.tiny_models import hf_greedy, make_tiny_model, tiny_configs_2026

# (architecture, num_heads, num_kv_heads, head_dim, tied, extra config)
TINY_CONFIGS = {
    "llama-mha-hd16-tied": ("llama", 4, 4, 16, True, {}),
    "llama-gqa-hd32-untied-bias": ("llama", 4, 2, 32, False, {"attention_bias": True}),
    "llama3-rope-gqa-hd16": (
        "llama",
        4,
        1,
        16,
        False,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-gqa-hd32-qkv-bias": ("qwen2", 4, 2, 32, True, {}),
    "mistral-gqa-hd16": ("mistral", 4, 2, 16, False, {"sliding_window": None}),
    **{name: config for name, config in tiny_configs_2026().items()},
}


def mixed_workload(vocab_size: int, num_prompts: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 48, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    max_tokens = torch.randint(4, 24, (num_prompts,), generator=g).tolist()
    return prompts, max_tokens


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_parity_tiny_models_float64(name, tmp_path):
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS[name]
    hf_model, model_dir = make_tiny_model(
        tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float64, **extra
    )
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=20, seed=len(name))
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]

    llm = LLM(
        model_dir,
        dtype="float64",
        block_size=4,
        max_num_batched_tokens=24,  # prompts of up to 47 tokens span several chunks
        max_num_seqs=20,
        num_kv_blocks=28,  # 112 token slots for 20 sequences of up to ~70 tokens
        # Swap while the small swap pool has room, recompute when it is full: both kinds happen.
        num_swap_blocks=6,
        preemption_mode="swap",
        admission_reserve_steps=0,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)

    for prompt, out, want in zip(prompts, outputs, expected):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    stats = llm.get_metrics()
    assert stats.num_preemptions_recompute > 0, "the pool should force recompute preemption"
    assert stats.num_preemptions_swap > 0, "the pool should force swap preemption"
    assert stats.mean_seqs_per_step > 2
    assert stats.num_kv_blocks_used == 0 and stats.num_swap_blocks_used == 0
    llm.engine.check_integrity()


def shared_prefix_workload(vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts that start with one of two system prompts (one a whole number of blocks of 4,
    one not), some of them nothing more, some a repeat, some an earlier prompt's next turn."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (24, 13)]
    prompts: list[list[int]] = []
    for i in range(18):
        system = systems[i % 2]
        if i % 6 == 0:
            prompts.append(list(system))  # the whole prompt is cached once the first has run
        elif i % 6 == 1 and prompts:
            prompts.append(list(prompts[-1]))  # a repeat
        elif i % 6 == 2 and len(prompts) > 1:
            prompts.append(prompts[-2] + torch.randint(3, vocab_size, (5,), generator=g).tolist())  # a next turn
        else:
            n = int(torch.randint(1, 20, (1,), generator=g))
            prompts.append(system + torch.randint(3, vocab_size, (n,), generator=g).tolist())
    max_tokens = torch.randint(4, 20, (len(prompts),), generator=g).tolist()
    return prompts, max_tokens


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_parity_with_shared_prefixes(name, mode, tmp_path):
    """Prefix caching on and off give transformers' tokens, with blocks shared between
    running requests, evicted, and preempted by swap or recompute meanwhile."""
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS[name]
    hf_model, model_dir = make_tiny_model(tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float64,
                                          **extra)
    prompts, max_tokens = shared_prefix_workload(hf_model.config.vocab_size, seed=len(name))
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    for caching in (True, False):
        llm = LLM(
            model_dir, dtype="float64", block_size=4, max_num_batched_tokens=24, max_num_seqs=18,
            num_kv_blocks=30, num_swap_blocks=10, preemption_mode=mode, admission_reserve_steps=0,
            enable_prefix_caching=caching,
        )
        outputs = llm.generate(prompts, params)
        for prompt, out, want in zip(prompts, outputs, expected):
            assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged (caching {caching})"
        stats = llm.get_metrics()
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
        assert stats.num_kv_blocks_used == 0 and stats.num_swap_blocks_used == 0
        llm.engine.check_integrity()
        if caching:
            assert sum(out.num_cached_tokens for out in outputs) > 0
            assert stats.num_kv_blocks_evicted > 0, "the small pool should evict cached blocks"
        else:
            assert all(out.num_cached_tokens == 0 for out in outputs)


@pytest.mark.parametrize("policy,mode", [("static", "recompute"), ("continuous", "auto")])
def test_greedy_parity_static_and_forced_modes(policy, mode, tmp_path):
    hf_model, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float64)
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=10, seed=7)
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(
        model_dir,
        dtype="float64",
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        num_kv_blocks=24,
        num_swap_blocks=64,
        scheduler_policy=policy,
        preemption_mode=mode,
        admission_reserve_steps=0,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.get_metrics()
    if policy == "static":
        # Static batches reserve their worst case up front and never preempt;
        # the small pool bounds the batch instead.
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap == 0
        assert stats.mean_seqs_per_step < 6
    else:
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0


SMOLLM2_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
]


@pytest.mark.slow
# The chat template's system prompt is a shared prefix: with caching the prompts take
# fewer blocks, so a smaller pool still forces preemption.
@pytest.mark.parametrize("enable_prefix_caching,num_kv_blocks", [(True, 30), (False, 60)])
def test_greedy_parity_smollm2_float32(smollm2_hf, enable_prefix_caching, num_kv_blocks):
    hf_model, tokenizer = smollm2_hf
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        for c in SMOLLM2_CHATS
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    max_tokens = 24
    expected = [hf_greedy(hf_model, p, max_tokens, stop_at_eos=True) for p in prompts]

    from engine.model.loader import load_from_hf_model

    loaded = load_from_hf_model(hf_model, tokenizer, torch.float32, "smollm2-135m")
    llm = LLM(
        "smollm2-135m",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        num_kv_blocks=num_kv_blocks,
        num_swap_blocks=16,
        admission_reserve_steps=0,
        enable_prefix_caching=enable_prefix_caching,
        loaded_model=loaded,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for chat, out, want in zip(SMOLLM2_CHATS, outputs, expected):
        assert out.token_ids == want, chat
        assert out.text == tokenizer.decode(want, skip_special_tokens=True)
    stats = llm.get_metrics()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert stats.num_kv_blocks_used == 0
    cached = [out.num_cached_tokens for out in outputs]
    if enable_prefix_caching:
        assert sum(cached) > 0 and stats.prefix_cache_hit_tokens > 0
    else:
        assert cached == [0] * len(outputs) and stats.num_kv_blocks_cached == 0


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama"):
        LLM(str(tmp_path), dtype="float32")


@pytest.mark.slow
def test_smollm2_stop_strings_and_eos(smollm2_hf):
    hf_model, tokenizer = smollm2_hf
    from engine.model.loader import load_from_hf_model

    llm = LLM("smollm2-135m", loaded_model=load_from_hf_model(hf_model, tokenizer, torch.float32, "smollm2-135m"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    free, stopped, unmatched = llm.generate(
        [prompt, prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=40),
            SamplingParams(temperature=0.0, max_tokens=40, stop=["Paris"]),
            SamplingParams(temperature=0.0, max_tokens=5, stop=["never-in-the-output"]),
        ],
    )
    # A stop string that never matches: the request ends by length and its text keeps every token.
    assert unmatched.finish_reason == "length"
    assert unmatched.text == tokenizer.decode(unmatched.token_ids, skip_special_tokens=True)
    assert "Paris" in free.text and free.finish_reason == "stop"  # ended by EOS
    assert free.token_ids[-1] in llm.engine.eos_token_ids
    assert stopped.finish_reason == "stop" and "Paris" not in stopped.text
    assert free.text.startswith(stopped.text) and len(stopped.token_ids) < len(free.token_ids)
    assert llm.get_metrics().num_kv_blocks_used == 0
    # The token that completes the string is also the last max_tokens allows: the scheduler
    # ended the request by length, and it reports the string (as vLLM does), its status
    # left as the scheduler set it.
    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=len(stopped.token_ids),
                                                        stop=["Paris"]))
    final = []
    while engine.has_unfinished_requests():
        final += [out for out in engine.step().outputs if out.finished]
    assert [(out.finish_reason, out.stop_reason, out.text) for out in final] == [("stop", "Paris", stopped.text)]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.finish_reason == "stop"
