"""Admission control: a bound on the requests and the queued prompt tokens a process
takes on, so that overload is refused at once, with a hint of when to retry, instead of
queued without bound (where every request ends at its deadline and memory grows).

The gateway (gateway/admission.py) and each worker keep one `AdmissionQueue`:

    admit(id, num_seqs=n)       over max_requests sequences in flight: Overloaded
    queue_tokens(id, n)         over max_queued_tokens waiting to be prefilled: Overloaded
    started(id)                 its prompt is prefilled (first token): no longer queued
    release(id)                 it ended, however

A request counts as the sequences it runs (its n choices: each decodes in a place of
its own in a batch), so that n is refused here, before any token, rather than by a
decode worker's bound once its choices fan out. A request's prompt tokens count as
queued from admission to its first token: the
work a newcomer waits behind for its own first token, so the bound on them is a bound
on time to first token. A lone prompt longer than the bound is still admitted when
nothing else is queued, or it could never run. Every verb is O(1), on the event loop.

The retry hint is how long the queue takes to drain by what is over the bound, at the
rate requests (or prompt tokens) left it recently; before anything has left, a
constant. Either way it is clamped to [MIN_RETRY_S, MAX_RETRY_S]: a hint, not a promise.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MIN_RETRY_S = 0.1
MAX_RETRY_S = 10.0
DEFAULT_RETRY_S = 1.0  # nothing has left the queue yet: no rate to go by
DRAIN_WINDOW = 64  # departures the drain rates are measured over


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """`max_requests` sequences in flight at once (a request of n choices counts n);
    `max_queued_tokens` prompt tokens admitted and not yet prefilled."""

    max_requests: int
    max_queued_tokens: int

    def __post_init__(self) -> None:
        if self.max_requests <= 0 or self.max_queued_tokens <= 0:
            raise ValueError(f"admission limits must be positive: {self}")


class Overloaded(Exception):
    """A request refused by admission control: RESOURCE_EXHAUSTED, retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainRate:
    """Units (requests, tokens) leaving a queue per second, over its last DRAIN_WINDOW departures."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._departures: deque[tuple[float, int]] = deque(maxlen=DRAIN_WINDOW)
        self._total = 0  # units in `_departures`

    def add(self, amount: int) -> None:
        if len(self._departures) == DRAIN_WINDOW:
            self._total -= self._departures[0][1]
        self._departures.append((self._clock(), amount))
        self._total += amount

    def per_second(self) -> float | None:
        """None until two departures span some time (nothing to measure a rate by)."""
        if len(self._departures) < 2:
            return None
        # Departures since the oldest one kept, over the time since it (up to now, so
        # that a queue that stopped draining reads as slow, not as its old rate).
        seconds = self._clock() - self._departures[0][0]
        return (self._total - self._departures[0][1]) / seconds if seconds > 0 else None

    def seconds_for(self, amount: int) -> float:
        """The retry hint for `amount` units over the bound."""
        rate = self.per_second()
        seconds = DEFAULT_RETRY_S if not rate else amount / rate
        return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


class AdmissionQueue:
    """The requests a process has admitted and the prompt tokens they have queued.

    `limits` may be replaced at any time (the gateway derives its limits from the
    workers it polls); requests already admitted stay admitted.
    """

    def __init__(self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._requests: dict[str, int] = {}  # request id -> the sequences it runs
        self.num_seqs = 0
        self._queued: dict[str, int] = {}  # request id -> its prompt tokens, until started
        self.num_queued_tokens = 0
        self.num_refused = 0
        self._request_drain = DrainRate(clock)
        self._token_drain = DrainRate(clock)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def check_room(self, num_seqs: int) -> None:
        """Overloaded if `num_seqs` more sequences would pass the bound (a batch's whole
        count, checked before any of it is admitted); nothing is held either way."""
        excess = self.num_seqs + num_seqs - self.limits.max_requests
        if excess > 0:
            self.num_refused += 1
            raise Overloaded(f"overloaded: {self.num_seqs} sequences in flight (limit {self.limits.max_requests}), "
                             f"{num_seqs} more asked for", self._request_drain.seconds_for(excess))

    def admit(self, request_id: str, num_tokens: int = 0, *, num_seqs: int = 1, is_exempt: bool = False) -> None:
        """Take the request on (`num_seqs` sequences: its choices), with its prompt's
        `num_tokens` queued if known; Overloaded if that would pass a limit (nothing is
        then held), ValueError if it is already in. `is_exempt` (moved work, never
        refused): past the limits too, counted toward them."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        if not is_exempt:
            self.check_room(num_seqs)
        self._requests[request_id] = num_seqs
        self.num_seqs += num_seqs
        if num_tokens:
            self.queue_tokens(request_id, num_tokens, is_exempt=is_exempt)

    def queue_tokens(self, request_id: str, num_tokens: int, *, is_exempt: bool = False) -> None:
        """Queue an admitted request's `num_tokens` prompt tokens; Overloaded if that would
        pass the limit while others are queued, and the request is then released
        (`is_exempt`: never)."""
        assert request_id in self._requests and request_id not in self._queued, request_id
        excess = self.num_queued_tokens + num_tokens - self.limits.max_queued_tokens
        if excess > 0 and self.num_queued_tokens > 0 and not is_exempt:
            self.num_seqs -= self._requests.pop(request_id)
            self.num_refused += 1
            # A prompt longer than the bound gets in once the queue is empty: it need not
            # wait for more than the queue to drain.
            raise Overloaded(f"overloaded: {self.num_queued_tokens} prompt tokens queued (limit "
                             f"{self.limits.max_queued_tokens})",
                             self._token_drain.seconds_for(min(excess, self.num_queued_tokens)))
        self._queued[request_id] = num_tokens
        self.num_queued_tokens += num_tokens

    def withdraw(self, request_id: str) -> None:
        """Let go of a request refused after its admission (by a check made elsewhere):
        nothing of it stays, and it counts as a refusal, not a departure."""
        if request_id in self._requests:
            self._queued.pop(request_id, None)
            self.num_seqs -= self._requests.pop(request_id)
            self.num_refused += 1

    def started(self, request_id: str) -> None:
        """The request's prompt is prefilled: its tokens leave the queue (idempotent)."""
        num_tokens = self._queued.pop(request_id, 0)
        if num_tokens:
            self.num_queued_tokens -= num_tokens
            self._token_drain.add(num_tokens)

    def release(self, request_id: str) -> None:
        """The request ended, however (idempotent; unknown ids are ignored)."""
        if request_id in self._requests:
            self.started(request_id)
            num_seqs = self._requests.pop(request_id)
            self.num_seqs -= num_seqs
            self._request_drain.add(num_seqs)
