"""Offline throughput on one device for benchmarks/gpu.py: Baton (continuous and static)
against transformers (`generate` in static batches, and its continuous batching), all
on the same random weights.

The transformers model is built from a dummy model's config (engine/dummy_models.py)
with random weights drawn on the device; Baton's model is built from it
(`load_from_hf_model`: q/k/v and gate/up concatenated, the rest shared), so both
serve identical weights. Every request decodes greedily, ignores EOS, and produces
exactly its requested number of tokens. Each system gets an untimed warmup first
(Triton compilation, cuBLAS handles, CUDA graph capture); the clock covers
generation only.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import traceback
from dataclasses import asdict, dataclass, replace
from time import perf_counter

import numpy as np
import torch

from benchmarks.gpu_bandwidth import synchronize
from benchmarks.offline_throughput import SystemResult, _check_lengths, run_hf_static
from benchmarks.gpu_targets import Target
from benchmarks.workload import BenchRequest, make_workload, total_output_tokens, total_prompt_tokens

WORKLOADS = ("mixed", "sharegpt")  # mixed first: it carries the hf-static target

ALL_SYSTEMS = ("baton-continuous", "baton-static", "hf-static", "hf-continuous")
HF_CB_CUDA_GRAPHS = {"on": True, "off": False, "auto": None}  # "auto": transformers' own heuristic
# hf-continuous requests per step when its attention needs a dense mask (sdpa): that mask
# spans every cached token of the step, so its cost grows with the square of the batch.
HF_CB_MASKED_MAX_REQUESTS = 64
HF_CB_CPU_MAX_REQUESTS = 16  # its best on 2 CPU cores (benchmarks/offline_throughput.py)
HF_CB_CPU_PAGE_SIZE = 32
HF_CB_STALL_SECONDS = 300  # no request finished for this long: give up on hf-continuous


@dataclass(frozen=True)
class LogNormalWorkloadConfig:
    """A ShareGPT-like workload: prompt and output lengths log-normal around chat-like
    medians, clipped to the bounds (inclusive)."""

    num_requests: int = 1000
    prompt_median: float = 200.0
    output_median: float = 180.0
    sigma: float = 0.7
    min_prompt_len: int = 4
    max_prompt_len: int = 2048
    min_output_len: int = 4
    max_output_len: int = 1024
    min_token_id: int = 100
    seed: int = 0


def make_lognormal_workload(vocab_size: int, config: LogNormalWorkloadConfig) -> list[BenchRequest]:
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    prompt_lens = np.clip(np.rint(rng.lognormal(math.log(config.prompt_median), config.sigma, n)),
                          config.min_prompt_len, config.max_prompt_len)
    output_lens = np.clip(np.rint(rng.lognormal(math.log(config.output_median), config.sigma, n)),
                          config.min_output_len, config.max_output_len)
    return [
        BenchRequest(
            request_id=f"req-{i}",
            prompt_token_ids=[int(t) for t in rng.integers(config.min_token_id, vocab_size, int(prompt_lens[i]))],
            max_tokens=int(output_lens[i]),
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class OfflineConfig:
    """How every system is set up for one run."""

    model: str  # a dummy:<name> model
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int  # baton-continuous
    max_num_batched_tokens: int  # Baton's step budget, and hf-continuous's
    static_batch_size: int  # hf-static's batch and baton-static's max_num_seqs
    gpu_memory_utilization: float
    hf_cb_cuda_graphs: str  # a key of HF_CB_CUDA_GRAPHS
    hf_cb_max_requests: int | None  # None: HF_CB_MASKED_MAX_REQUESTS under sdpa, else transformers' own
    num_warmup_requests: int
    seed: int = 0


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warmup_requests(requests: list[BenchRequest], num_requests: int,
                    max_tokens: int | None = None) -> list[BenchRequest]:
    """The first requests (cut to `max_tokens` if given), for an untimed warmup that
    compiles and allocates as the run will.

    NOTE: Baton warms up on whole requests: Triton compiles a kernel variant per
    split count (a decode batch of few, long sequences splits each context) and per
    argument specialization, and a full-length tail of small batches meets most of
    them before the clock starts.
    """
    return [BenchRequest(f"warmup-{r.request_id}", r.prompt_token_ids,
                         r.max_tokens if max_tokens is None else min(r.max_tokens, max_tokens))
            for r in requests[:num_requests]]


# ----------------------------------------------------------------------------- models


def build_hf_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """transformers' *ForCausalLM of the dummy model `model`, made on `device` in `dtype`,
    weights N(0, 0.02) (norms around 1) from a seeded generator on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.dummy_models import dummy_model
    from engine.model.dummy import WEIGHT_STD

    spec = dummy_model(model)
    if spec is None:
        raise ValueError(f"the GPU benchmark builds its models from a dummy:<name> config, not {model!r}")
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            mean = 1.0 if name.endswith("norm.weight") else 0.0
            parameter.normal_(mean, WEIGHT_STD, generator=generator)
    return hf_model.eval()


def baton_model_from_hf(hf_model, config: OfflineConfig):
    """Baton's LoadedModel on the same weights (shared where unchanged)."""
    from engine.model.loader import load_from_hf_model

    return load_from_hf_model(hf_model, None, config.dtype, config.model, config.max_model_len,
                              device=config.device)


# ----------------------------------------------------------------------------- Baton


def _baton_inputs(requests: list[BenchRequest]):
    from engine import SamplingParams

    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    return prompts, params


def run_baton(policy: str, loaded, requests: list[BenchRequest], config: OfflineConfig) -> SystemResult:
    from engine import LLM

    llm = LLM(
        config.model,
        loaded_model=loaded,
        device=str(config.device),
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.static_batch_size if policy == "static" else config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        scheduler_policy=policy,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
    )
    try:
        return time_generation(llm, f"baton-{policy}", requests, config.num_warmup_requests, config.device)
    finally:
        del llm
        release_memory(config.device)


def time_generation(llm, name: str, requests: list[BenchRequest], num_warmup_requests: int,
                    device: torch.device) -> SystemResult:
    """`requests` through a ready engine, timed, after an untimed warmup on the first
    `num_warmup_requests` of them; the engine's steps and preemptions over the timed run."""
    llm.generate(*_baton_inputs(warmup_requests(requests, num_warmup_requests)))
    before = llm.engine.get_metrics(with_queue_times=False)
    prompts, params = _baton_inputs(requests)
    synchronize(device)
    start = perf_counter()
    outs = llm.generate(prompts, params)
    synchronize(device)
    seconds = perf_counter() - start
    after = llm.engine.get_metrics(with_queue_times=False)
    token_ids = [list(out.token_ids)[: r.max_tokens] for out, r in zip(outs, requests)]
    _check_lengths(name, token_ids, requests)
    num_steps = after.num_steps - before.num_steps
    num_seqs = after.mean_seqs_per_step * after.num_steps - before.mean_seqs_per_step * before.num_steps
    extra = {
        "num_steps": num_steps,
        "mean_seqs_per_step": num_seqs / max(num_steps, 1),
        "num_preemptions": (after.num_preemptions_recompute + after.num_preemptions_swap
                            - before.num_preemptions_recompute - before.num_preemptions_swap),
        "num_kv_blocks": llm.engine.kv_cache.num_blocks,
    }
    return SystemResult(name, seconds, total_output_tokens(requests), token_ids, extra)


# ----------------------------------------------------------------------------- transformers


def hf_flash_attention_available() -> bool:
    """Whether transformers' continuous batching would switch to flash attention (installed package only)."""
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def hf_continuous_config(requests: list[BenchRequest], config: OfflineConfig, cuda_graphs: str):
    """transformers' continuous batching settings, given only as fields the installed
    version has (5.17 calls the page size `block_size`, 5.23 `page_size`).

    - max_batch_tokens: Baton's step budget; no prefix sharing (random prompts share none).
    - On CUDA: transformers sizes its paged cache from free memory; CUDA graphs as
      `cuda_graphs` says; attention as it picks (flash when installed, else paged sdpa),
      with HF_CB_MASKED_MAX_REQUESTS requests per step under sdpa unless overridden.
    - On CPU: as benchmarks/offline_throughput.py (pages for every request at full
      length, no graphs, no async batching, sdpa).
    """
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs = {
        "max_batch_tokens": config.max_num_batched_tokens,
        "allow_block_sharing": False,
        "scheduler_type": "fifo",
        "seed": config.seed,
    }
    if config.device.type == "cuda":
        masked = not hf_flash_attention_available()
        kwargs["max_requests_per_batch"] = config.hf_cb_max_requests or (HF_CB_MASKED_MAX_REQUESTS if masked else None)
        kwargs["use_cuda_graph"] = HF_CB_CUDA_GRAPHS[cuda_graphs]
    else:
        kwargs[hf_page_size_field()] = HF_CB_CPU_PAGE_SIZE
        kwargs["num_blocks"] = sum(math.ceil((r.num_prompt_tokens + r.max_tokens) / HF_CB_CPU_PAGE_SIZE)
                                   for r in requests) + 1
        kwargs["max_requests_per_batch"] = config.hf_cb_max_requests or HF_CB_CPU_MAX_REQUESTS
        kwargs.update(max_blocks_per_request=0, use_async_batching=False, use_cuda_graph=False,
                      auto_switch_to_flash=False)
    return ContinuousBatchingConfig(**{k: v for k, v in kwargs.items() if k in names})


def hf_page_size_field() -> str:
    """ContinuousBatchingConfig's name for the tokens per cache page in the installed transformers."""
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return "page_size" if "page_size" in names else "block_size"


def run_hf_continuous(model, requests: list[BenchRequest], config: OfflineConfig) -> SystemResult:
    """transformers' ContinuousBatchingManager; with CUDA graphs "on", a failure retries
    once with transformers' own choice ("auto") and records why."""
    try:
        return _run_hf_continuous(model, requests, config, config.hf_cb_cuda_graphs)
    except Exception as error:  # noqa: BLE001 - reported, then retried without forcing graphs
        if config.device.type != "cuda" or config.hf_cb_cuda_graphs != "on":
            raise
        print(f"  hf-continuous with CUDA graphs failed ({error!r}); retrying with transformers' default",
              flush=True)
        result = _run_hf_continuous(model, requests, config, "auto")
        result.extra["cuda_graphs_error"] = repr(error)[:500]
        return result


def _run_hf_continuous(model, requests: list[BenchRequest], config: OfflineConfig,
                       cuda_graphs: str) -> SystemResult:
    """NOTE: no inference_mode here: the manager's background thread updates the cache
    tensors created on this thread, which inference tensors forbid."""
    from transformers import GenerationConfig

    cb_config = hf_continuous_config(requests, config, cuda_graphs)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    attn_implementation = model.config._attn_implementation
    results = {}
    try:
        # Builds the paged cache and batch processor, and captures CUDA graphs, before the clock.
        manager.warmup()
        resolved = manager.continuous_batching_config
        for r in requests:
            manager.add_request(r.prompt_token_ids, request_id=r.request_id, max_new_tokens=r.max_tokens,
                                eos_token_id=-1)
        start = last_progress = perf_counter()
        manager.start()
        while len(results) < len(requests):
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died; see its log above")
                if perf_counter() - last_progress > HF_CB_STALL_SECONDS:
                    raise RuntimeError(f"transformers' continuous batching finished no request in "
                                       f"{HF_CB_STALL_SECONDS} s ({len(results)}/{len(requests)} done)")
                continue
            last_progress = perf_counter()
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"{result.request_id} failed: {result.error}")
                results[result.request_id] = result
        seconds = perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()
        release_memory(config.device)
    token_ids = [list(results[r.request_id].generated_tokens)[: r.max_tokens] for r in requests]
    _check_lengths("hf-continuous", token_ids, requests)
    extra = {
        "attn_implementation": attn_implementation,
        "cuda_graphs_setting": cuda_graphs,
        "use_cuda_graph": str(resolved.use_cuda_graph),
        "use_async_batching": str(resolved.use_async_batching),
        "page_size": getattr(resolved, hf_page_size_field()),
        "num_blocks": resolved.num_blocks,
        "max_batch_tokens": resolved.max_batch_tokens,
        "max_requests_per_batch": resolved.max_requests_per_batch,
    }
    return SystemResult("hf-continuous", seconds, total_output_tokens(requests), token_ids, extra)


def run_system(name: str, hf_model, loaded, requests: list[BenchRequest], config: OfflineConfig) -> SystemResult:
    """One system on `requests`, after its untimed warmup."""
    if name == "baton-continuous":
        return run_baton("continuous", loaded, requests, config)
    if name == "baton-static":
        return run_baton("static", loaded, requests, config)
    if name == "hf-static":
        warmup = warmup_requests(requests, min(config.num_warmup_requests, config.static_batch_size), 4)
        run_hf_static(hf_model, warmup, config.static_batch_size, config.device)
        return run_hf_static(hf_model, requests, config.static_batch_size, config.device)
    if name == "hf-continuous":
        return run_hf_continuous(hf_model, requests, config)
    raise ValueError(f"unknown system {name!r}; choose from {ALL_SYSTEMS}")


def first_token_agreement(result: SystemResult, reference: SystemResult) -> float:
    """Fraction of requests whose first greedy token equals the reference's: a check that
    both systems serve the same weights (later tokens may drift apart in bfloat16)."""
    pairs = list(zip(result.output_token_ids, reference.output_token_ids))
    return sum(a[:1] == b[:1] for a, b in pairs) / len(pairs)


# ----------------------------------------------------------------------------- the section


def section_offline(run) -> dict:
    """benchmarks/gpu.py's `offline` section: every system on each workload, on the same weights."""
    from engine.dummy_models import dummy_model

    run.release_decode_llm()
    args, sizes = run.args, run.sizes
    vocab_size = dummy_model(args.model).vocab_size
    makers = {"mixed": lambda: make_workload(vocab_size, replace(sizes.mixed, seed=args.seed)),
              "sharegpt": lambda: make_lognormal_workload(vocab_size, replace(sizes.sharegpt, seed=args.seed))}
    workloads = {name: makers[name]() for name in WORKLOADS if name in args.workloads}
    longest = max(r.num_prompt_tokens + r.max_tokens for requests in workloads.values() for r in requests)
    config = OfflineConfig(
        model=args.model, device=run.device, dtype=run.dtype, max_model_len=-(-(longest + 16) // 256) * 256,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        static_batch_size=args.static_batch_size or sizes.static_batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization, hf_cb_cuda_graphs=args.hf_cb_cuda_graphs,
        hf_cb_max_requests=args.hf_cb_max_requests, num_warmup_requests=sizes.num_warmup_requests, seed=args.seed,
    )
    hf_model = build_hf_model(args.model, run.dtype, run.device, args.seed)
    loaded = baton_model_from_hf(hf_model, config)
    section = {"config": {k: str(v) for k, v in asdict(config).items()}, "workloads": {}, "targets": []}
    try:
        for workload, requests in workloads.items():
            entry = {"num_requests": len(requests), "num_prompt_tokens": total_prompt_tokens(requests),
                     "num_output_tokens": total_output_tokens(requests), "systems": {}, "unavailable": {}}
            section["workloads"][workload] = entry
            print(f"{workload}: {entry['num_requests']} requests, {entry['num_prompt_tokens']} prompt tokens, "
                  f"{entry['num_output_tokens']} output tokens", flush=True)
            results = {}
            for name in args.systems:
                try:
                    result = run_system(name, hf_model, loaded, requests, config)
                except Exception as error:
                    if not name.startswith("hf-"):
                        raise
                    # A baseline the installed transformers cannot run is reported, not fatal.
                    traceback.print_exc()
                    release_memory(run.device)
                    entry["unavailable"][name] = repr(error)[:1000]
                    print(f"  {name}: unavailable ({error!r})", flush=True)
                    continue
                results[name] = result
                entry["systems"][name] = {"seconds": result.seconds, "num_output_tokens": result.num_output_tokens,
                                          "output_tokens_per_second": result.tokens_per_second, **result.extra}
                print(f"  {name:<17} {result.seconds:8.2f} s {result.tokens_per_second:10.1f} output tok/s",
                      flush=True)
                run.record("offline", section)
            if "hf-static" in results:
                entry["first_token_agreement_with_hf_static"] = {
                    name: first_token_agreement(res, results["hf-static"]) for name, res in results.items()
                    if name != "hf-static"}
            section["targets"] = offline_targets(section["workloads"])
            run.record("offline", section)
    finally:
        del hf_model, loaded
        release_memory(run.device)
    for target in section["targets"]:
        print(Target(**{k: v for k, v in target.items() if k != "passed"}).line(), flush=True)
    return section


def offline_targets(workloads: dict) -> list[dict]:
    def ratio(workload: str, system: str, baseline: str) -> float | None:
        systems = workloads.get(workload, {}).get("systems", {})
        if system not in systems or baseline not in systems:
            return None
        return systems[system]["output_tokens_per_second"] / systems[baseline]["output_tokens_per_second"]

    targets = [Target("offline-mixed-vs-hf-static", "mixed workload, baton-continuous / hf-static throughput",
                      ratio("mixed", "baton-continuous", "hf-static"), 3.0),
               Target("offline-mixed-vs-hf-continuous",
                      "mixed workload, baton-continuous / hf-continuous (generate_batch) throughput",
                      ratio("mixed", "baton-continuous", "hf-continuous"), 1.5)]
    for workload in WORKLOADS:
        targets.append(Target(f"offline-{workload}-vs-baton-static",
                              f"{workload} workload, baton-continuous / baton-static throughput",
                              ratio(workload, "baton-continuous", "baton-static"), 2.5))
    return [t.to_json() for t in targets]
