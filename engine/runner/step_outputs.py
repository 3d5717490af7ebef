"""What a step leaves in its requests: their new tokens, noted in order (logprobs, times),
each added to its text, which may complete a stop string and end the request there; the
output of a request that goes on; and the prefill chunks of traced requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.request import PENDING_TOKEN, RequestStatus
from engine.sampling import prompt_logprobs
from engine.timeline import PrefillChunk

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager
    from engine.request import Request
    from engine.scheduler import Scheduler
    from engine.timeline import StepBatch


def note_tokens(scheduler: Scheduler, request: Request, token_ids: list[int], logprobs: list | None, now: float,
                batch: StepBatch | None) -> bool:
    """Record a request's new tokens (their logprobs, times, text), in order; True if one
    completed a stop string, which ends the request: the tokens after it are cut from
    `token_ids`, `logprobs` and the request (a row that checked proposals may have more)."""
    for index, token_id in enumerate(token_ids):
        request.note_token(None if logprobs is None else logprobs[index], now, batch)
        if matches_stop_string(scheduler, request, token_id):
            num_dropped = len(token_ids) - index - 1
            if num_dropped:
                del token_ids[index + 1:]
                if logprobs is not None:
                    del logprobs[index + 1:]
                del request.all_token_ids[-num_dropped:]
            return True
    return False


def matches_stop_string(scheduler: Scheduler, request: Request, token_id: int) -> bool:
    """Add the token to the request's text (every token, also one that ended it by length
    or EOS this step: the text must include it); True if that completed a stop string,
    which ends the request unless the scheduler already has (its status then stays: its
    finish_reason reads the string)."""
    detokenizer = request.detokenizer
    if detokenizer is None or detokenizer.stop_matched is not None:
        return False
    detokenizer.append([token_id])
    if detokenizer.stop_matched is None:
        return False
    scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)  # no-op if already ended
    return True


def record_chunks(traced: list[tuple[Request, int, int, int]], batch: StepBatch) -> None:
    """A PrefillChunk event for each traced request that prefilled in the step just run:
    where the chunk started, its tokens, whether it recomputes KV the request had before
    (after a recompute preemption or a failed handoff), and the batch it ran in."""
    for request, start, num_new, num_tokens_before in traced:
        if num_new > 1 or start < request.num_prompt_tokens:
            request.record(PrefillChunk(
                start=start,
                num_tokens=num_new,
                is_recompute=num_tokens_before > request.num_prompt_tokens,
                batch=batch,
            ))


def running_output(request: Request, token_ids: list[int], new_logprobs: list | None,
                   kv_manager: KVCacheManager) -> RequestOutput:
    """The output of a request that goes on (or waits, HELD, for its KV to be pulled)."""
    kv_block_ids = None
    if request.status == RequestStatus.HELD:
        kv_block_ids = list(kv_manager.get_block_ids(request.request_id))
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        finished=False,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_host_cached_tokens=request.num_host_cached_tokens,
        # Not the next step's token, already PENDING when overlapped.
        num_output_tokens=request.num_output_tokens - (request.all_token_ids[-1] == PENDING_TOKEN),
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs.take(request),
        kv_block_ids=kv_block_ids,
        timings=None if kv_block_ids is None else request.take_timings(),
        decode_timings=request.take_decode_timings(),
        events=None if request.events is None else request.take_events(),
    )
