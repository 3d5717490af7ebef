"""The request record: one generation request as the scheduler and runner see it."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling_params import length_limit
from engine.timeline import FirstDecodeStep

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.sampling_params import SamplingParams
    from engine.timeline import TimelineEvent


class InvalidRequestError(ValueError):
    """A request this engine can never run, for what one of its attributes holds. `name`
    is that attribute as the request record spells it ("prompt_token_ids", "request_id",
    "sampling_params.max_tokens", or add_prefilled_request's "first_token_id"), and
    `index` the position at fault in a list, if one is; so that a server can tell its
    caller which field of its request is at fault (SamplingParamError does the same for
    sampling values)."""

    def __init__(self, name: str, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.index = index


class PromptTooLongError(InvalidRequestError):
    """The prompt reaches the engine's max_model_len: no token could follow it."""

    def __init__(self, message: str) -> None:
        super().__init__("prompt_token_ids", message)


# In `Request.all_token_ids`: a token a step in flight has sampled but not yet reported
# (overlapped scheduling); the scheduler fills it in when the step's tokens arrive.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, holds no blocks (new, or preempted by recompute)
    RUNNING = 1  # holds device blocks, scheduled every step it has work
    SWAPPED = 2  # preempted by swap: its KV lives in the CPU swap pool
    HELD = 3  # prefill done, first token sampled; its blocks wait for a KV handoff
    RECEIVING = 4  # admitted with blocks allocated; its prompt's KV is arriving from elsewhere
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_HANDED_OFF = 8  # its KV moved to another engine, which continues it

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_HANDED_OFF: "handoff",
}


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a request's time went on this engine (seconds; None: did not happen here)."""

    queue_time: float | None  # arrival to admission
    # Admission for prefill to first token, when its prompt was prefilled here (after a
    # failed handoff: from the admission that started the local prefill).
    prefill_time: float | None
    num_preemptions: int
    # When it was first admitted, had its first token, had its received KV back in the
    # batch, and ended its first decode step (time.monotonic(); None: not here).
    admitted_at: float | None = None
    first_token_at: float | None = None
    kv_ready_at: float | None = None
    first_decode_at: float | None = None


# The running order (`Request.sort_key`), as a key for sorted lists of requests.
by_sort_key = attrgetter("sort_key")


def deadline_key(deadline: float | None) -> float:
    """A deadline as a sort key: no deadline sorts after every deadline."""
    return math.inf if deadline is None else deadline


class Request:
    """A request's tokens and progress.

    The one progress counter is `num_computed_tokens`: how many of
    `all_token_ids` have KV in the cache. Each step the scheduler gives the
    request up to `num_tokens - num_computed_tokens` tokens of work (a prefill
    chunk, or one decode token); when it catches up, the runner samples the
    next token. Preemption by recompute sets it back to 0.
    """

    # Each attribute, and what it holds.
    __slots__ = {
        "request_id": "",
        "prompt_token_ids": "",
        "all_token_ids": "The prompt, then each generated token (PENDING_TOKEN while it is on the device).",
        "sampling_params": "",
        "priority": "",
        "deadline": "When its caller gives up on it (time.monotonic() seconds; None: never). Orders the "
                    "queues within a priority level, earliest first; nothing here enforces it.",
        "arrival_time": "",
        "arrival_step": "",
        "arrival_index": "Order of arrival at the scheduler, for ties.",
        "status": "",
        "num_computed_tokens": "",
        "pending_sample_index": "While its last token is PENDING_TOKEN: that token's row among the sampled "
                                "tokens of the step still in flight (the next step reads it there, on the device).",
        "generator": "A seeded request's own generator, on the engine's device: the engine makes it "
                     "(sampler.make_generator), so that it draws where the sampler does.",
        "detokenizer": "",
        "eos_token_ids": "",
        "sort_key": "Running-queue order: (effective priority at admission, deadline (inf: none), admission "
                    "sequence number); the last is preempted first.",
        "first_scheduled_time": "",
        "first_token_time": "",
        "num_preemptions": "",
        "stop_reason": "",
        "logprobs": "",
        "prefill_only": "Disaggregated serving: after the first sampled token the request stops and holds its "
                        "KV (HELD) for a handoff instead of decoding.",
        "kv_remote": "Disaggregated serving: the prompt's KV comes from another engine; admission allocates "
                     "its blocks and waits (RECEIVING) instead of prefilling.",
        "abort_requested": "Aborted while RECEIVING: it ends when the receive does.",
        "landing": "The ticket of the blocks set aside that it received into (engine/kv/landing.py); None: "
                   "admitted from the queue.",
        "kv_ready_time": "A received prompt's KV landed (monotonic).",
        "prefill_start_time": "First admitted to prefill here (monotonic).",
        "first_decode_time": "End of its first decode step (monotonic).",
        "events": "Timeline events for tracing (None: not traced, nothing recorded); outputs carry them off "
                  "as they come.",
        "timings_taken": "take_timings() handed them out (its last output here).",
        "decode_timed": "take_decode_timings() handed them out (its second token's output).",
        "block_hashes": "Prefix caching: the hash chain of its full blocks, as far as it was needed "
                        "(engine/kv/prefix_hash.py).",
        "num_cached_tokens": "The prompt tokens its first prefill admission here found cached (None: never "
                             "admitted to prefill here, or its prompt's KV was received: a preemption's "
                             "recompute is no prefill of the prompt).",
        "num_host_cached_tokens": "Of those, the ones the host tier held (engine/kv/host_tier.py).",
        "num_reused_blocks": "A kv_remote request's prompt blocks found cached here, which its handoff skips.",
        "num_cached_estimate": "Its prompt tokens the cache held when last looked up (the queued-work estimate).",
        "output_start": "Where its generated tokens start in all_token_ids: before the prompt's end when an "
                        "earlier attempt generated its last tokens elsewhere (they count as output for the "
                        "penalties, bad words and a grammar).",
        "bad_word_ids": "Its bad words as token id sequences (the engine tokenizes them).",
        "grammar": "Its structured output's matcher (engine.sampling.grammar.GrammarState); None: free text.",
        "prompt_logprobs": "The prompt logprobs computed so far, until its first answer takes them "
                           "(engine.sampling.prompt_logprobs); None: not asked, or taken.",
        "spec_token_ids": "Speculative decoding: the tokens proposed to follow its last one, for the next "
                          "step to check (engine/spec_decode); empty: none.",
        "spec_num_checked": "Its proposals the model has checked (up to and including each step's first "
                            "rejection), and of those",
        "spec_num_accepted": "the ones accepted: its acceptance rate so far.",
        "spec_backoff": "Whether it proposes on the speculator's probe steps only: its lookup found nothing "
                        "last time (in an engine that overlaps its other steps).",
        "spec_index": "Its prompt-lookup index (engine/spec_decode/ngram.py NgramIndex), once it proposes.",
    }

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 priority: int = 0, deadline: float | None = None, eos_token_ids: tuple[int, ...] = (),
                 arrival_step: int = 0, arrival_time: float | None = None, prefill_only: bool = False) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids",
                                      f"request {request_id}: prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.deadline = deadline
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_step = arrival_step
        self.arrival_index = 0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.pending_sample_index = 0
        self.generator: torch.Generator | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.sort_key: tuple[int, float, int] = (priority, deadline_key(deadline), 0)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.prefill_only = prefill_only
        self.kv_remote = False
        self.abort_requested = False
        self.landing: str | None = None
        self.kv_ready_time: float | None = None
        self.prefill_start_time: float | None = None
        self.first_decode_time: float | None = None
        self.events: list[TimelineEvent] | None = None
        self.timings_taken = self.decode_timed = False
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens: int | None = None
        self.num_host_cached_tokens = 0
        self.num_reused_blocks = 0
        self.num_cached_estimate = 0
        self.output_start = len(self.prompt_token_ids)
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()
        self.grammar = None
        self.prompt_logprobs: list | None = [] if sampling_params.prompt_logprobs is not None else None
        self.spec_token_ids: list[int] = []
        self.spec_num_checked = 0
        self.spec_num_accepted = 0
        self.spec_backoff = False
        self.spec_index = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def max_num_tokens(self, max_model_len: int) -> int:
        """The length (prompt and output tokens) at which it ends by length: the length rule
        (engine.sampling_params.length_limit) for this request."""
        return length_limit(len(self.prompt_token_ids), self.sampling_params.max_tokens, max_model_len)

    @property
    def is_prefilling(self) -> bool:
        """Whether more than its last token is left to compute: its prompt (or, preempted by
        recompute, its output so far) is not yet all in the KV cache."""
        return self.num_computed_tokens < len(self.all_token_ids) - 1

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token generated for it, here and by earlier attempts (PENDING_TOKEN last
        while a step in flight has it)."""
        return self.all_token_ids[self.output_start :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def stop_string(self) -> str | None:
        """The stop string its text matched, if one did (which ends it)."""
        return None if self.detokenizer is None else self.detokenizer.stop_matched

    @property
    def finish_reason(self) -> str | None:
        """Why it ended: "stop" for a matched stop string, even when the token that
        completed the string had also ended it by length or EOS (as vLLM reports it)."""
        if self.is_finished and self.stop_string is not None:
            return "stop"
        return FINISH_REASONS.get(self.status)

    @property
    def finish_stop_reason(self) -> int | str | None:
        """What stopped it, when it stopped: the stop string, else the stop token id."""
        if self.is_finished and self.stop_string is not None:
            return self.stop_string
        return self.stop_reason if self.status == RequestStatus.FINISHED_STOPPED else None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that ran any of its tokens."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def note_token(self, logprob: Any, now: float, batch: int) -> None:
        """A token sampled for it in a step of `batch` rows, at monotonic `now`: keep its
        logprobs (if it asked), and the time of its first token (its prompt prefilled
        here) or of its first decode step."""
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.first_token_time is None and self.kv_ready_time is None:
            self.first_token_time = now
        elif self.first_decode_time is None:
            self.first_decode_time = now
            if self.events is not None:
                self.record(FirstDecodeStep(batch=batch))

    def record(self, event: TimelineEvent) -> None:
        """Add a timeline event (traced requests only: check `events is not None` first)."""
        self.events.append(event)

    def take_events(self) -> list[TimelineEvent] | None:
        """The events recorded since the last call (None when there are none)."""
        events = self.events
        if not events:
            return None
        self.events = []
        return events

    def take_timings(self) -> RequestTimings | None:
        """Its timings, for its last output on this engine; None after the first call (a
        request held for a handoff and aborted later reports them once, when held)."""
        if self.timings_taken:
            return None
        self.timings_taken = True
        return self.timings()

    def take_decode_timings(self) -> RequestTimings | None:
        """Its timings once its first decode step here has run (its second token), for that
        step's output; None before, and after the first call."""
        if self.first_decode_time is None or self.decode_timed:
            return None
        self.decode_timed = True
        return self.timings()

    def timings(self) -> RequestTimings:
        return RequestTimings(
            queue_time=self.queue_time,
            prefill_time=(
                self.first_token_time - self.prefill_start_time
                if self.kv_ready_time is None
                and self.first_token_time is not None
                and self.prefill_start_time is not None
                else None
            ),
            num_preemptions=self.num_preemptions,
            admitted_at=self.first_scheduled_time,
            first_token_at=self.first_token_time,
            kv_ready_at=self.kv_ready_time,
            first_decode_at=self.first_decode_time,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
