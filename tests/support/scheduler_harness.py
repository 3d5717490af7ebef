"""A scheduler with a fake runner: builds requests, steps, feeds sampled tokens back."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.scheduler.preemption import PreemptionCostModel

EOS = 2


def make_scheduler(
    *,
    num_blocks: int = 64,
    num_swap_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 512,
    bytes_per_block: int = 1024,
    enable_prefix_caching: bool = False,
    num_offload_blocks: int = 0,
    **scheduler_kwargs,
) -> Scheduler:
    kv = KVCacheManager(
        num_blocks=num_blocks,
        num_swap_blocks=num_swap_blocks,
        block_size=block_size,
        max_blocks_per_seq=-(-max_model_len // block_size),
        initial_rows=4,
        enable_prefix_caching=enable_prefix_caching,
        num_offload_blocks=num_offload_blocks,
    )
    return Scheduler(
        SchedulerConfig(**scheduler_kwargs),
        kv,
        PreemptionCostModel(bytes_per_block),
        max_model_len=max_model_len,
    )


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 8,
    priority: int = 0,
    deadline: float | None = None,
    **params,
) -> Request:
    prompt = [10 + (i % 50) for i in range(prompt_len)]
    return Request(
        request_id,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        priority=priority,
        deadline=deadline,
        eos_token_ids=(EOS,),
    )


def next_token(request: Request) -> int:
    """A deterministic stand-in for the model: never EOS."""
    return 100 + request.num_tokens % 7


def fake_step(scheduler: Scheduler, check: bool = True) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake model; returns the schedule and the requests that finished."""
    out = scheduler.schedule()
    sampled = [
        request
        for request, num_new in zip(out.requests, out.num_scheduled_tokens)
        if request.num_computed_tokens + num_new == request.num_tokens
    ]
    finished = scheduler.complete_step(out, sampled, [next_token(r) for r in sampled])
    if check:
        scheduler.check_integrity()
    return out, finished


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        out, _ = fake_step(scheduler)
        outs.append(out)
    raise AssertionError("scheduler did not finish its requests")
