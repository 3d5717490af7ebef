"""A mixture of experts on CPU against a dense model of the same active parameters.

Two models at SmolLM2-135M's width (hidden 576, 9 heads of 64, 3 KV heads, 30
layers, its vocabulary, tied embeddings), random weights:

  dense  llama, a SwiGLU MLP of width 1536
  moe    mixtral, 8 SwiGLU experts of width 768, top-2: the same 2 x 768 = 1536
         active MLP width a token, four times the dense model's MLP weights

Both decode the same 32 prompts of 16 tokens greedily for 64 tokens each (EOS
ignored) at batch 32, through engine.LLM, rounds alternating between the models
so that a shared machine's drift falls out of the ratio. The MoE's figure is its
output tokens/s over the dense model's: the grouping (the slots sorted by expert,
each expert with tokens read once: in float32 the native experts kernel) must pay
for its routing. Target: >= 0.7x. At batch 32
all 8 experts have tokens, so a MoE step reads about 2.8x the dense step's weight
bytes; the report also gives each model's weight bytes streamed per second, MoE over
dense, the figure the grouping's own cost shows in when the machine is
bandwidth-bound. Beside it,
transformers' own MoE forward (`generate`, batch 32, its default experts
implementation) on the same MoE weights.

A step cannot take less than its weight bytes over the machine's read bandwidth (measured
here: the best of three sums over 1 GiB); the report gives each step against that floor,
and the ratio the MoE would reach at its floor against the dense step as measured: where
that bound is under the target, no grouping can meet it on this machine in this dtype.

The first round is cold (a fresh engine: oneDNN's first calls, the allocator's
first growth) and is reported apart; the figure is the median of the warm rounds.

Run from the repository root:
    python -m benchmarks.moe_cpu [--rounds 3] [--num-layers 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from time import perf_counter

import torch

TARGET = 0.7
WIDTH = {
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
MODELS = {
    "dense": ("llama", {"intermediate_size": 1536}),
    "moe": ("mixtral", {"intermediate_size": 768, "num_local_experts": 8, "num_experts_per_tok": 2,
                        "sliding_window": None}),
}


def make_model(kind: str, num_layers: int, directory: Path):
    """A random `kind` model saved to `directory` (float32), and the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = MODELS[kind]
    config = AutoConfig.for_model(model_type, num_hidden_layers=num_layers, **WIDTH, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


def weight_bytes_per_step(kind: str, num_layers: int, batch: int) -> float:
    """Weight bytes a decode step of `batch` reads (float32): every layer's attention and
    MLP (for the MoE only the experts the batch touches: E * (1 - (1 - k/E)^batch) of E
    under uniform routing), the norms, and the tied embedding read whole as the LM head."""
    hidden, heads, kv_heads, head_dim = (WIDTH[k] for k in ("hidden_size", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim"))
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 2 * hidden
    _, extra = MODELS[kind]
    mlp = 3 * hidden * extra["intermediate_size"]
    if kind == "moe":
        experts, top_k = extra["num_local_experts"], extra["num_experts_per_tok"]
        mlp = mlp * experts * (1 - (1 - top_k / experts) ** batch) + experts * hidden  # + the router
    return 4 * (num_layers * (attention + mlp) + WIDTH["vocab_size"] * hidden + hidden)


def read_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """The machine's read bandwidth in bytes/s, at this process's torch threads: the best of
    `repeats` sums over a float32 tensor of `gib` GiB (far larger than any cache)."""
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = perf_counter()
        data.sum()
        best = min(best, perf_counter() - start)
    return data.numel() * 4 / best


def prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (num, length), generator=generator).tolist()


def baton_tokens_per_second(directory: Path, batch: list[list[int]], max_tokens: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(str(directory), dtype="float32", max_num_seqs=len(batch), num_kv_blocks=4 * len(batch) * 6,
              calibrate_step_time=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = perf_counter()
    outputs = llm.generate(batch, params)
    seconds = perf_counter() - start
    assert all(len(out.token_ids) == max_tokens for out in outputs)
    return len(batch) * max_tokens / seconds


@torch.no_grad()
def hf_tokens_per_second(model, batch: list[list[int]], max_tokens: int) -> float:
    input_ids = torch.tensor(batch)
    start = perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
                         temperature=None, top_p=None, top_k=None)
    seconds = perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + max_tokens
    return len(batch) * max_tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each model; the first is cold")
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' MoE generate")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    batch = prompts(args.batch, args.prompt_len, WIDTH["vocab_size"])
    results: dict[str, list[float]] = {"dense": [], "moe": [], "hf-moe": []}
    with tempfile.TemporaryDirectory() as work:
        hf_models = {kind: make_model(kind, args.num_layers, Path(work) / kind) for kind in MODELS}
        for round_index in range(args.rounds):
            order = list(MODELS) if round_index % 2 == 0 else list(reversed(MODELS))
            for kind in order:
                results[kind].append(baton_tokens_per_second(Path(work) / kind, batch, args.max_tokens))
            if not args.no_hf and round_index < 2:  # transformers is slow: a cold and a warm round
                results["hf-moe"].append(hf_tokens_per_second(hf_models["moe"], batch, args.max_tokens))
            print(f"round {round_index + 1}: " + ", ".join(
                f"{kind} {values[-1]:.1f} tok/s" for kind, values in results.items() if values), flush=True)
    warm = {kind: statistics.median(values[1:] or values) for kind, values in results.items() if values}
    cold = {kind: values[0] for kind, values in results.items() if values}
    ratio = warm["moe"] / warm["dense"]
    # How close each comes to streaming its own weights: tokens/s times bytes a step reads.
    bytes_ratio = weight_bytes_per_step("moe", args.num_layers, args.batch) / weight_bytes_per_step(
        "dense", args.num_layers, args.batch)
    # The floor: a decode step cannot take less than its weight bytes over the machine's read
    # bandwidth. A step's time, from tokens/s at batch `batch` (the short prompts' prefill
    # included, as in the ratio itself).
    bandwidth = read_bandwidth()
    step_ms = {kind: 1000 * args.batch / warm[kind] for kind in MODELS}
    floor_ms = {kind: 1000 * weight_bytes_per_step(kind, args.num_layers, args.batch) / bandwidth for kind in MODELS}
    report = {
        "read_gb_per_s": bandwidth / 1e9, "step_ms": step_ms, "weight_floor_ms": floor_ms,
        "moe_step_over_its_floor": step_ms["moe"] / floor_ms["moe"],
        # The best the MoE could do against this dense step, were it to stream its weights at the
        # machine's full read bandwidth and do nothing else.
        "moe_over_dense_bound": step_ms["dense"] / floor_ms["moe"],
        "batch": args.batch, "max_tokens": args.max_tokens, "num_layers": args.num_layers,
        "threads": torch.get_num_threads(), "warm_tokens_per_second": warm, "cold_tokens_per_second": cold,
        "moe_over_dense": ratio, "cold_moe_over_dense": cold["moe"] / cold["dense"],
        "moe_over_hf_moe": warm["moe"] / warm["hf-moe"] if "hf-moe" in warm else None,
        "target": TARGET, "passed": ratio >= TARGET,
        "moe_over_dense_weight_bytes": bytes_ratio, "moe_over_dense_bytes_per_second": ratio * bytes_ratio,
    }
    print(f"MoE (8 experts, top-2) over dense of the same active parameters, batch {args.batch}: "
          f"{ratio:.2f}x warm (cold {report['cold_moe_over_dense']:.2f}x), target >= {TARGET}: "
          f"{'PASS' if report['passed'] else 'FAIL'}")
    print(f"A MoE step reads {bytes_ratio:.2f}x the dense step's weight bytes at batch {args.batch}; "
          f"weight bytes/s, MoE over dense: {ratio * bytes_ratio:.2f}x")
    print(f"Read bandwidth {report['read_gb_per_s']:.1f} GB/s: a MoE step takes {step_ms['moe']:.1f} ms against "
          f"a floor of {floor_ms['moe']:.1f} ms for its weights ({report['moe_step_over_its_floor']:.2f}x), the "
          f"dense step {step_ms['dense']:.1f} ms (floor {floor_ms['dense']:.1f} ms); so at best MoE over dense "
          f"is {report['moe_over_dense_bound']:.2f}x on this machine")
    if report["moe_over_hf_moe"] is not None:
        print(f"Baton's MoE over transformers' MoE generate on the same weights: {report['moe_over_hf_moe']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
