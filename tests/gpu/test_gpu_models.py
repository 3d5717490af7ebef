"""Qwen3, its mixture of experts and FP8 weights on a CUDA GPU (marker `gpu`: skipped
without one; `make test-gpu`, and gpu-check's engine phase).

- Greedy parity with transformers in float32 for a tiny qwen3 and qwen3_moe, with CUDA
  graphs and overlapped scheduling (the defaults on CUDA): the decoder's per-head q/k
  norms and the fused-MoE kernel replayed in graphs give transformers' tokens.
- FP8 in bfloat16: a model loaded with quantization="fp8" (and a block-FP8 checkpoint of a
  mixture of experts) against the same model computed in bfloat16 on its FP8-rounded
  weights; what differs is the activations' quantization, bounded below.
- FP8 decode steps replayed as CUDA graphs give the tokens of the same overlapped loop run
  eagerly (float32 activations: the Triton FP8 GEMMs and the FP8 fused MoE in graphs).

The kernels themselves are tested against torch in tests/kernels/test_triton_moe.py and
tests/kernels/test_triton_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.quantization import ONLINE_FP8, round_trip_fp8
from tests.engine.test_parity import mixed_workload
from tests.engine.test_quantization import write_fp8_checkpoint
from tests.support.tiny_models import hf_greedy, make_tiny_model, tiny_configs_2026

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

QWEN3, QWEN3_MOE = "qwen3-gqa-hd32-qk-norm", "qwen3-moe-norm-topk"

# FP8 logits against the bfloat16 model on the same FP8-rounded weights. The weights are the
# same e4m3 values and scales on both sides (the reference's dequantized weights rounded to
# bfloat16: 2^-9 of each, negligible); what differs is that each FP8 linear quantizes its
# input per token (per token and 32 columns for block weights) to e4m3, which moves a normal
# value by at most 2^-4 of itself, rho ~ 0.027 RMS for Gaussian data (tests/kernels/
# test_triton_fp8.py). One linear's output then errs by ~rho of its norm; the down projection
# by ~0.04 (its input's rounding and gate_up's, propagated: tests/kernels/test_triton_moe.py).
# The four sublayers of two layers add such independent errors to a residual stream of five
# terms of about equal norm: ~0.04 * sqrt(4 / 5) ~ 0.036 of the final hidden state, which the
# final norm and the unquantized LM head pass on to the logits. Each side's own bfloat16
# rounding adds 2-5% (these models' bfloat16 logits against float32 on a CPU). Simulated on
# a CPU (torch's e4m3 rounding at every FP8 linear's input, 6 seeds x 16 prompts of each
# model): 0.027-0.034 of the logits' norm over all rows, 0.064 at most for one row, in
# bfloat16 as in float32. Checked at about twice that. A scale read wrongly moves the logits
# by far more: a missing scale by orders of magnitude, a per-block scale applied to the
# wrong block by tens of percent.
FP8_LOGITS_TOLERANCE = 0.06  # || fp8 - reference || / || reference || over every prompt's row
FP8_ROW_TOLERANCE = 0.12  # the same, for each row


def tiny_model_at_init_scale(directory, name: str):
    """tiny_configs_2026()'s `name` in float32, its weights at transformers' init scale.
    make_tiny_model widens every weight 3x, so that greedy tokens have no near-ties; those
    models amplify any perturbation (bfloat16's rounding alone moves their logits by 10-70%),
    so the FP8 tests take them back to the init scale (2-5%)."""
    arch, heads, kv_heads, head_dim, tied, extra = tiny_configs_2026()[name]
    hf_model, model_dir = make_tiny_model(directory, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32,
                                          **extra)
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.div_(3.0)
    hf_model.save_pretrained(model_dir)
    return hf_model, model_dir


def random_prompts(vocab_size: int, num_prompts: int = 16, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (num_prompts,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def eager_bf16_llm(model_dir: str, **kwargs) -> LLM:
    """An engine that runs each prompt's prefill eagerly, one step at a time."""
    return LLM(model_dir, device="cuda", dtype="bfloat16", enforce_eager=True, overlap_scheduling=False,
               enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=1024, num_kv_blocks=256,
               **kwargs)


def last_token_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:  # [P, vocab] float32
    """The logits of each prompt's last token, as its prefill computes them (the LM head's
    output, caught on its way to the sampler)."""
    model = llm.engine.runner.model
    compute_logits = model.compute_logits
    caught = []
    model.compute_logits = lambda hidden: caught.append(compute_logits(hidden)) or caught[-1]
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        del model.compute_logits
    logits = torch.cat(caught).float()
    # One row per prompt, in prompt order: each row's greedy token is the one the engine sampled.
    assert logits.shape[0] == len(prompts)
    assert logits.argmax(-1).tolist() == [out.token_ids[0] for out in outputs]
    return logits


def assert_fp8_logits_close(logits: torch.Tensor, reference: torch.Tensor) -> None:
    overall = ((logits - reference).norm() / reference.norm()).item()
    rows = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()
    assert overall <= FP8_LOGITS_TOLERANCE and rows <= FP8_ROW_TOLERANCE, (overall, rows)


@pytest.mark.parametrize("name", [QWEN3, QWEN3_MOE])
def test_greedy_parity_on_gpu_float32_with_graphs_and_overlap(name, tmp_path):
    """As tests/gpu/test_gpu.py's float32 parity, on Qwen3's q/k norms and the fused-MoE
    kernel: 20 prompts through a pool that preempts, decode steps replayed as graphs."""
    arch, heads, kv_heads, head_dim, tied, extra = tiny_configs_2026()[name]
    hf_model, model_dir = make_tiny_model(
        tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32, **extra
    )
    hf_model = hf_model.to("cuda")
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=20, seed=len(name))
    with torch.device("cuda"):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]

    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=20,
              num_kv_blocks=28, num_swap_blocks=6, preemption_mode="swap", admission_reserve_steps=0)
    engine = llm.engine
    assert engine.runner.backend.name == "triton"
    assert engine.graph_capture is not None and engine.overlap.enabled
    assert engine.graph_capture.batch_sizes == (1, 2, 4, 8, 16, 20)
    replayed = []
    prepare = engine.runner.static_decode.prepare
    engine.runner.static_decode.prepare = lambda out: replayed.append(prepare(out)) or replayed[-1]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == expected
    assert sum(p is not None for p in replayed) > 10, "decode steps should replay graphs"
    stats = llm.get_metrics()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0, stats


@pytest.mark.parametrize("name", [QWEN3, QWEN3_MOE])
def test_online_fp8_logits_within_activation_rounding_of_the_rounded_model(name, tmp_path):
    """quantization="fp8" on CUDA (FP8 linears and experts, torch._scaled_mm where it can):
    its logits against bfloat16 on the same weights rounded through FP8 per channel."""
    hf_model, model_dir = tiny_model_at_init_scale(tmp_path, name)
    prompts = random_prompts(hf_model.config.vocab_size, seed=len(name))
    fp8 = eager_bf16_llm(model_dir, quantization="fp8")
    assert any(type(m).__name__ == "Fp8Linear" for m in fp8.engine.runner.model.modules())
    logits = last_token_logits(fp8, prompts)
    del fp8

    reference = eager_bf16_llm(model_dir)
    rounded = round_trip_fp8(dict(reference.engine.runner.model.named_parameters()), ONLINE_FP8)
    assert rounded == 4 * hf_model.config.num_hidden_layers  # qkv, o, and the MLP's or experts' two
    assert_fp8_logits_close(logits, last_token_logits(reference, prompts))


def test_block_fp8_moe_checkpoint_logits_within_activation_rounding_of_the_dequantized_model(tmp_path):
    """A block-FP8 checkpoint (Qwen's -FP8 layout, 32x32 blocks here) of a mixture of experts,
    served from its FP8 weights (block GEMMs, the fused MoE on block scales), against its
    dequantized weights in bfloat16."""
    hf_model, _ = tiny_model_at_init_scale(tmp_path / "made", QWEN3_MOE)
    directory = write_fp8_checkpoint(hf_model, tmp_path / "block-fp8", "block-fp8")
    prompts = random_prompts(hf_model.config.vocab_size, seed=3)
    fp8 = eager_bf16_llm(directory)
    model = fp8.engine.runner.model
    assert model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert model.layers[0].mlp.experts.block_size == (32, 32)
    logits = last_token_logits(fp8, prompts)
    del fp8, model
    reference = eager_bf16_llm(f"{directory}-dequantized")
    assert_fp8_logits_close(logits, last_token_logits(reference, prompts))


def test_fp8_moe_decode_replayed_as_graphs_gives_the_eager_tokens(tmp_path):
    """quantization="fp8" with float32 activations (the Triton FP8 GEMM, not _scaled_mm, and
    the FP8 fused MoE): decode steps replayed as graphs give the tokens of the same loop run
    eagerly, bit for bit. Both loops overlap, so both schedule the same steps; every context
    stays under MIN_SPLIT_SEQ_LEN (one attention split either way) and each row of the FP8
    GEMMs is computed from its own tokens alone, so padding a batch to its graph's size
    changes no real row. (Against the plain loop, steps of other sizes would move float32
    roundings, and a 1e-7 change that crosses an e4m3 rounding point moves an activation by
    2^-4: tokens could part for no fault.)"""
    arch, heads, kv_heads, head_dim, tied, extra = tiny_configs_2026()[QWEN3_MOE]
    hf_model, model_dir = make_tiny_model(tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32,
                                          **extra)
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=12, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    runs = {}
    for eager in (True, False):
        llm = LLM(model_dir, device="cuda", dtype="float32", quantization="fp8", block_size=4,
                  max_num_batched_tokens=64, max_num_seqs=12, num_kv_blocks=256, enforce_eager=eager,
                  overlap_scheduling=True)
        engine = llm.engine
        assert (engine.graph_capture is None) == eager and engine.overlap.enabled
        replayed = []
        if not eager:
            prepare = engine.runner.static_decode.prepare
            engine.runner.static_decode.prepare = lambda out: replayed.append(prepare(out)) or replayed[-1]
        runs[eager] = [out.token_ids for out in llm.generate(prompts, params)]
        if not eager:
            assert sum(p is not None for p in replayed) > 10, "decode steps should replay graphs"
        del llm, engine
    assert runs[False] == runs[True]
