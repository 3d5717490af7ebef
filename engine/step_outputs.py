"""What a step leaves in its requests: their new tokens, noted in order (logprobs, times),
each added to its text, which may complete a stop string and end the request there; and
the prefill chunks of traced requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import RequestStatus
from engine.timeline import PrefillChunk

if TYPE_CHECKING:
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
