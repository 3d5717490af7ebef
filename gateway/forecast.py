"""What admitting one more request would do to time: the gateway's forecast of each
request's first token and last token, from the work admitted before it and the step-time
models its workers publish (WorkerStats.prefill_s_per_token, decode_step_base_s,
decode_step_per_seq_s, decode_step_per_context_token_s: fitted on each worker's own steps,
calibrated at its start).

    first token   the prompt tokens queued ahead of it (admitted, not yet prefilled, served
                  before it: priority first, then earliest deadline, then arrival, the
                  order the prefill workers' waiting queues keep), and its own, at the
                  prefill workers' pooled rate
    last token    its first token, then its expected output at the step time of the decode
                  batch it joins: every admitted request's sequences (n choices: n), spread
                  over the decode workers, and their contexts as they are now (a batch
                  that requests join as others leave holds requests at every stage of
                  their decode: its contexts now are what it holds on average),
                  scaled by what finished requests' steps took against their forecasts

A request's expected output is its max_tokens when it ignores EOS; otherwise the smaller of
its max_tokens and the mean output of the last OUTPUT_WINDOW requests that stopped on their
own (DEFAULT_OUTPUT before any has).

`judge` is admission's question: may this request in, and if not, why not. A request with
a deadline must be forecast to finish within DEADLINE_SHARE of the time it has left, and
must not push an admitted request that is on track past the same share of its own. It is
hopeless (refused DEADLINE_EXCEEDED, not worth a retry) only if the workers' own line says
an idle deployment could not finish it in time; an idle deployment is judged by that line
alone, so what the scale learned under load never locks a shape out. A
forecast is only as good as its models: every admitted request's forecast first token is
kept to be compared with what happened (GatewayAdmission's stats).

A forecast can still be wrong: a cold deployment's first burst decodes in batches its
workers' line never saw. So while requests run, `to_shed` compares their progress with
their deadlines. The step their decoding shows (DecodeProgress: pooled over every
decoding request, over the last OBSERVE_WINDOW_S) is the line scaled by what it shows,
at the contexts the kept requests will have as they decode;
if at that step an admitted request would finish past its deadline (at every check for
a while: `Behind`), the fewest requests are shed so that the rest finish in time: hopeless ones first, then the lowest
priority, then the latest admitted (requests without a deadline are never shed). The
scale it observed also corrects the forecast of what is admitted next
(`Observed.scale`), before any request has finished to teach DecodeScale.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field, replace

# The share of a request's time that its forecast last token may use: the rest absorbs
# forecast error (steps slower than fitted, outputs longer than expected). At 0.9,
# benchmarks/overload.py's burst had every admitted request miss its deadline: its
# forecast was off by more than that margin (docs/admission.md).
DEADLINE_SHARE = 0.8
OUTPUT_WINDOW = 256
SCALE_WINDOW = 64
MIN_SCALE_TOKENS = 16
MAX_DECODE_SCALE = 3.0
DEFAULT_OUTPUT = 128  # expected output before any request has finished on its own

# Why admission refuses (baton_requests_refused's reasons, beside a worker's own), and
# why a request admitted is shed.
CONCURRENCY, QUEUE_WAIT, DEADLINE, SHED = "concurrency", "queue_wait", "deadline", "shed"
# The decode step the running requests show is measured over the last OBSERVE_WINDOW_S,
# once that spans MIN_OBSERVE_S and MIN_OBSERVED_TOKENS tokens (a worker's streams send
# tokens in gathers, so a shorter window reads the gathers, not the steps).
OBSERVE_WINDOW_S = 2.0
MIN_OBSERVE_S = 1.0
MIN_OBSERVED_TOKENS = 32
# A request is behind when its projected last token falls within this share of its time
# of its deadline (the projection's own margin for error).
SHED_MARGIN = 0.05
# Falling behind is confirmed, not read once: requests are shed only when every check over
# CONFIRM_SHARE of the shortest deadline among the admitted (at most OBSERVE_WINDOW_S, a
# window of its own) found some behind. A burst's first second slows the steps it shows (its
# calls arriving, its prompts prefilling beside the first decodes): one reading there shed
# 85 of a cold burst's first 147, and the steps that followed were faster (issue 51).
CONFIRM_SHARE = 0.1


@dataclass(slots=True)
class Admitted:
    """One admitted request, as the forecast sees it."""

    request_id: str
    priority: int
    deadline: float | None  # time.monotonic() seconds; None: none
    arrival: float
    order: int  # arrival index: ties go to the earlier
    num_prompt_tokens: int
    max_tokens: int
    expected_output: int
    num_seqs: int = 1  # its n choices: each a place in a decode batch
    started: bool = False  # its first token came
    num_generated: int = 0
    forecast_ttft_s: float | None = None  # at admission, from arrival
    # Its first decode step's tokens (the first after the prefill's, past the handoff):
    # when they came, how many it had then, and GatewayAdmission's integrals over time of
    # the sequences admitted and of the decoding requests' context tokens then.
    decode_start_at: float | None = None
    decode_start_tokens: int = 0
    areas_at_decode_start: tuple[float, float] = (0.0, 0.0)  # GatewayAdmission's integrals then
    last_event_at: float | None = None  # its latest decode event's arrival

    @property
    def key(self) -> tuple:
        """The prefill queues' order: priority, then earliest deadline (none last), then arrival."""
        return (self.priority, math.inf if self.deadline is None else self.deadline, self.order)

    def remaining_tokens(self) -> int:
        return max(1, min(self.max_tokens, max(self.expected_output, self.num_generated + 1)) - self.num_generated)

    def context_tokens(self) -> int:
        """Its sequences' context tokens now."""
        return self.num_seqs * (self.num_prompt_tokens + self.num_generated)

    def mean_context_tokens(self) -> float:
        """Its sequences' context tokens halfway through what it has left to decode: what it
        adds to a decode step, on average, from now to its end."""
        return self.num_seqs * (self.num_prompt_tokens + self.num_generated + self.remaining_tokens() / 2)


@dataclass(frozen=True, slots=True)
class Rates:
    """The workers' models, pooled. None: not known (no worker has published one yet)."""

    prefill_s_per_token: float | None  # one prompt token, all prefill workers working together
    decode_base_s: float | None  # a decode step: base + per_seq x its batch + per_token x its contexts
    decode_per_seq_s: float
    num_decode_workers: int
    # What the decode steps of finished requests took, over what was forecast for them
    # (DecodeScale): the gateway's streams take a little longer than a step, and a
    # line fitted on some steps misses on others.
    decode_scale: float = 1.0
    decode_per_token_s: float = 0.0

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens * (self.prefill_s_per_token or 0.0)

    def step_s(self, num_requests: int, num_context_tokens: float = 0.0) -> float:
        """A decode step when `num_requests` are admitted, their contexts `num_context_tokens`
        in all, spread evenly over the decode workers."""
        if self.decode_base_s is None:
            return 0.0
        workers = max(1, self.num_decode_workers)
        batch = -(-num_requests // workers)
        return (self.decode_base_s + self.decode_per_seq_s * batch
                + self.decode_per_token_s * num_context_tokens / workers) * self.decode_scale

    def line_s(self, mean_requests: float, mean_context_tokens: float = 0.0) -> float:
        """The workers' own line (unscaled) at a mean of `mean_requests` admitted and of
        `mean_context_tokens` in their contexts."""
        if self.decode_base_s is None:
            return 0.0
        workers = max(1, self.num_decode_workers)
        return (self.decode_base_s + self.decode_per_seq_s * mean_requests / workers
                + self.decode_per_token_s * mean_context_tokens / workers)

    @property
    def known(self) -> bool:
        return self.prefill_s_per_token is not None and self.decode_base_s is not None

    @property
    def unscaled(self) -> Rates:
        """The workers' own line, without what finished requests taught: what an idle
        deployment does."""
        return replace(self, decode_scale=1.0)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A refusal: why, what to tell the client, and when a retry could be admitted."""

    reason: str  # CONCURRENCY, QUEUE_WAIT or DEADLINE
    message: str
    retry_after_s: float
    hopeless: bool = False  # its deadline cannot be met even by an idle deployment


class DecodeScale:
    """The time between a finished request's decoded tokens (from its first decode step
    on: the handoff before it is not a step) over the workers' line at the mean number of
    requests admitted while it decoded (not the batch it joined: others came and went),
    and at the decoding requests' mean contexts then:
    their mean over the last SCALE_WINDOW requests of MIN_SCALE_TOKENS or more, within
    [1, MAX_DECODE_SCALE] (a forecast is corrected up, never below the workers' own
    line, which learns on its own)."""

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=SCALE_WINDOW)

    def add(self, request: Admitted, ended_at: float, areas: tuple[float, float], rates: Rates) -> None:
        """`areas`: the integrals over time of the sequences admitted and of the decoding
        requests' context tokens, now."""
        decoded = request.num_generated - request.decode_start_tokens
        if request.decode_start_at is None or decoded < MIN_SCALE_TOKENS or not rates.known:
            return
        seconds = ended_at - request.decode_start_at
        if seconds <= 0:
            return
        (admitted, context), (admitted_then, context_then) = areas, request.areas_at_decode_start
        expected = rates.line_s((admitted - admitted_then) / seconds, (context - context_then) / seconds)
        if expected > 0:
            self._ratios.append(seconds / decoded / expected)

    @property
    def value(self) -> float:
        if not self._ratios:
            return 1.0
        return min(MAX_DECODE_SCALE, max(1.0, sum(self._ratios) / len(self._ratios)))


class OutputLengths:
    """Mean output of the requests that recently stopped on their own."""

    def __init__(self) -> None:
        self._lengths: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._total = 0

    def add(self, num_tokens: int) -> None:
        if len(self._lengths) == self._lengths.maxlen:
            self._total -= self._lengths[0]
        self._lengths.append(num_tokens)
        self._total += num_tokens

    def expected(self, max_tokens: int, ignore_eos: bool) -> int:
        if ignore_eos:
            return max_tokens
        mean = self._total / len(self._lengths) if self._lengths else DEFAULT_OUTPUT
        return max(1, min(max_tokens, math.ceil(mean)))


@dataclass(frozen=True, slots=True)
class Observed:
    """The decode step the running requests show (DecodeProgress.sample)."""

    step_s: float  # seconds between a decoding request's tokens, on average over its tokens
    batch: float  # the sequences decoding as each of those tokens came, on average (the line
    # at that batch is the line's mean step over those tokens: the two compare)
    context: float  # their context tokens in all then, on average

    def scale(self, rates: Rates) -> float | None:
        """The step over the workers' own line at that batch and context (None: no line)."""
        line = rates.unscaled.line_s(self.batch, self.context)
        return self.step_s / line if line > 0 else None


class DecodeProgress:
    """The decode step the running requests show, pooled over a sliding window: for each
    event of a decoding request, the time since its previous event, over the tokens the
    event brought, summed over every decoding request over the last OBSERVE_WINDOW_S.
    Only delivered spans count: a stream whose tokens gather (a decode worker past its
    message rate pauses it) reads the steps its gathers held, not the lag of the gather
    still to come, which is most of what a request that started a moment ago has had
    (reading time decoding over tokens delivered, a cold burst's first second read 2.3x
    its steps and shed the whole first wave). Pooled over requests and seconds, it reads
    the steps, not one stream's gathers or one request's start."""

    def __init__(self, now: float) -> None:
        self._requests = 0  # decoding now
        self._seqs = 0  # their sequences (n choices each)
        self.context_tokens = 0  # their sequences' context tokens, in all
        # Summed over events: the time since the same request's previous event, the tokens the
        # events brought (one choice's: a request's step is its choices' too), and the
        # sequences decoding and their context tokens as each came.
        self._sums = (0.0, 0, 0, 0)  # (seconds, tokens, token seqs, token contexts)
        self._samples: deque[tuple[float, tuple]] = deque([(now, self._sums)])  # (time, sums then)

    def started(self, num_seqs: int, num_context_tokens: int) -> None:
        """A request's first decode step came: its `num_seqs` sequences now hold
        `num_context_tokens` in all."""
        self._requests += 1
        self._seqs += num_seqs
        self.context_tokens += num_context_tokens

    def ended(self, num_seqs: int, num_context_tokens: int) -> None:
        """A request that had started decoding ended, its sequences `num_context_tokens` long in all."""
        self._requests -= 1
        self._seqs -= num_seqs
        self.context_tokens -= num_context_tokens

    @property
    def num_decoding(self) -> int:
        return self._requests

    def decoded(self, num_tokens: int, seconds: float, num_seqs: int = 1) -> None:
        """A decoding request's event brought `num_tokens` more to each of its `num_seqs`
        sequences, `seconds` after its previous one."""
        self.context_tokens += num_tokens * num_seqs
        total_seconds, tokens, token_seqs, token_contexts = self._sums
        self._sums = (total_seconds + max(0.0, seconds), tokens + num_tokens, token_seqs + num_tokens * self._seqs,
                      token_contexts + num_tokens * self.context_tokens)

    def sample(self, now: float) -> Observed | None:
        """The step over the window to now (None: it spans too little yet)."""
        samples = self._samples
        samples.append((now, self._sums))
        while len(samples) > 2 and samples[1][0] <= now - OBSERVE_WINDOW_S:
            samples.popleft()
        since, (seconds, tokens, token_seqs, token_contexts) = samples[0]
        total_seconds, total_tokens, total_seqs, total_contexts = self._sums
        num_tokens = total_tokens - tokens
        if now - since < MIN_OBSERVE_S or num_tokens < MIN_OBSERVED_TOKENS:
            return None
        return Observed((total_seconds - seconds) / num_tokens, (total_seqs - token_seqs) / num_tokens,
                        (total_contexts - token_contexts) / num_tokens)

    def restart(self, now: float) -> None:
        """Observe afresh from now (the batch changed: requests were shed)."""
        self._samples.clear()
        self._samples.append((now, self._sums))


@dataclass
class Forecast:
    """The admitted requests, and what admitting another would do to their times."""

    admitted: dict[str, Admitted] = field(default_factory=dict)
    # Not yet started, in prefill order (their keys, and the requests by key).
    _waiting_keys: list[tuple] = field(default_factory=list)
    _waiting: dict[tuple, Admitted] = field(default_factory=dict)
    num_seqs: int = 0  # the admitted requests' sequences (their choices), summed

    def add(self, request: Admitted) -> None:
        self.admitted[request.request_id] = request
        self.num_seqs += request.num_seqs
        if not request.started:
            bisect.insort(self._waiting_keys, request.key)
            self._waiting[request.key] = request

    def started(self, request_id: str) -> None:
        request = self.admitted.get(request_id)
        if request is not None and not request.started:
            request.started = True
            self._drop_waiting(request)

    def remove(self, request_id: str) -> Admitted | None:
        request = self.admitted.pop(request_id, None)
        if request is not None:
            self.num_seqs -= request.num_seqs
            if not request.started:
                self._drop_waiting(request)
        return request

    def _drop_waiting(self, request: Admitted) -> None:
        index = bisect.bisect_left(self._waiting_keys, request.key)
        if index < len(self._waiting_keys) and self._waiting_keys[index] == request.key:
            del self._waiting_keys[index]
        self._waiting.pop(request.key, None)

    def context_tokens(self) -> float:
        """The admitted requests' context tokens now."""
        return sum(request.context_tokens() for request in self.admitted.values())

    def tokens_ahead(self, key: tuple) -> int:
        """Prompt tokens of the waiting requests served before `key`."""
        return sum(self._waiting[k].num_prompt_tokens for k in self._waiting_keys[: bisect.bisect_left(self._waiting_keys, key)])

    def ttft_s(self, request: Admitted, rates: Rates) -> float:
        """Seconds from now to `request`'s first token, were it admitted now."""
        return rates.prefill_s(self.tokens_ahead(request.key) + request.num_prompt_tokens)

    def judge(self, request: Admitted, rates: Rates, now: float, max_queue_wait_s: float) -> Verdict | None:
        """None if `request` may be admitted now (its forecast first token is then set), else why not."""
        if not rates.known:
            return None  # nothing to forecast by yet: the concurrency bound alone applies
        if not self.admitted:
            # Idle: the workers' own line. The scale was learned from requests that ran beside
            # others; applied to an idle deployment it could refuse a shape for good (nothing
            # of it would run again, so nothing would correct it: a closed loop of 400-token
            # requests with a 30 s deadline was refused for a minute straight as hopeless).
            rates = rates.unscaled
        own_ttft = rates.prefill_s(request.num_prompt_tokens)
        ttft = self.ttft_s(request, rates)
        batch = self.num_seqs + request.num_seqs
        context = self.context_tokens()
        own_context = request.context_tokens()
        step_after = rates.step_s(batch, context + own_context)
        if request.deadline is not None:
            share = DEADLINE_SHARE * (request.deadline - now)
            # Alone, its steps are at its own contexts as they grow.
            alone_context = request.mean_context_tokens() / request.num_seqs
            alone = own_ttft + request.remaining_tokens() * rates.unscaled.step_s(1, alone_context)
            if alone > share:
                return Verdict(DEADLINE, f"its deadline cannot be met: it has {request.deadline - now:.2f} s and "
                                         f"needs {alone:.2f} s on an idle deployment", 0.0, hopeless=True)
            finish = ttft + request.remaining_tokens() * step_after
            if finish > share:
                return Verdict(DEADLINE, f"its deadline cannot be met now: first token forecast in {ttft:.2f} s, "
                                         f"last in {finish:.2f} s, deadline in {request.deadline - now:.2f} s",
                               self._next_finish_s(rates, now))
        if ttft > max_queue_wait_s:
            return Verdict(QUEUE_WAIT, f"first token forecast in {ttft:.1f} s (queue wait limit "
                                       f"{max_queue_wait_s:g} s)", ttft - max_queue_wait_s)
        late = self._pushed_past_deadline(request, rates, now, rates.step_s(self.num_seqs, context), step_after)
        if late:
            return Verdict(DEADLINE, f"admitting it would make {late} admitted request(s) miss their deadlines",
                           self._next_finish_s(rates, now))
        request.forecast_ttft_s = (now - request.arrival) + ttft
        return None

    def _pushed_past_deadline(self, new: Admitted, rates: Rates, now: float, step_now: float, step_after: float
                              ) -> int:
        """How many admitted requests on track for their deadlines (at a decode step of
        `step_now`) would not be with `new` in (at `step_after`)."""
        new_prefill = rates.prefill_s(new.num_prompt_tokens)
        late = 0
        queued = 0  # prompt tokens of waiting requests before this one
        for key in self._waiting_keys:  # waiting requests, in prefill order
            request = self._waiting[key]
            queued += request.num_prompt_tokens
            if request.deadline is not None:
                start = now + rates.prefill_s(queued)
                late += self._late(request, start, start + (new_prefill if key > new.key else 0.0),
                                   step_now, step_after)
        for request in self.admitted.values():
            if request.started and request.deadline is not None:
                late += self._late(request, now, now, step_now, step_after)
        return late

    @staticmethod
    def _late(request: Admitted, start: float, start_after: float, step_now: float, step_after: float) -> int:
        limit = request.deadline - (1 - DEADLINE_SHARE) * (request.deadline - request.arrival)
        remaining = request.remaining_tokens()
        on_track = start + remaining * step_now <= limit
        return int(on_track and start_after + remaining * step_after > limit)

    # ------------------------------------------------------------- shedding
    def to_shed(self, rates: Rates, now: float, observed: Observed | None) -> list[Admitted]:
        """The fewest admitted requests to end now so that every other one with a deadline
        finishes within it at the step the running requests show (`observed`, DecodeProgress's,
        scaled along the workers' line to each batch); [] while none is behind, or nothing
        has been observed."""
        if observed is None:
            return []
        anchor = rates.unscaled.line_s(observed.batch, observed.context)

        def step_at(num_seqs: int, context: float) -> float:  # the observed step, scaled along the line
            if anchor > 0:
                return observed.step_s * rates.unscaled.line_s(num_seqs, context) / anchor
            return observed.step_s * num_seqs / max(1.0, observed.batch)  # no line: in proportion

        free = [r for r in self.admitted.values() if r.deadline is None]  # never shed
        base = (sum(r.num_seqs for r in free), sum(r.mean_context_tokens() for r in free))
        timed = sorted((r for r in self.admitted.values() if r.deadline is not None), key=lambda r: (r.priority,
                                                                                                     r.order))
        if self._all_on_time(timed, base, step_at, rates, now):
            return []
        hopeless = [r for r in timed if not self._all_on_time([r], base, step_at, rates, now)]
        hopeless_ids = {r.request_id for r in hopeless}
        keepable = [r for r in timed if r.request_id not in hopeless_ids]
        # The longest prefix (highest priority, earliest admitted first) that finishes in time.
        low, high = 0, len(keepable)
        while low < high:
            k = (low + high + 1) // 2
            kept = keepable[:k]
            if self._all_on_time(kept, base, step_at, rates, now):
                low = k
            else:
                high = k - 1
        return hopeless + keepable[low:]

    @staticmethod
    def _all_on_time(requests: list[Admitted], base: tuple[int, float], step_at, rates: Rates, now: float) -> bool:
        """Whether each of `requests` (with deadlines) finishes in time in a decode batch of
        them beside `base` (the sequences and context tokens of the requests never shed):
        the started ones decoding from now, the waiting ones after the prompts of those
        among them before them in prefill order. The batch is these requests to their
        ends, nothing joining them that admission has not judged against their
        deadlines: their contexts grow as they decode, so its steps are at their
        contexts halfway through what each has left."""
        step = step_at(base[0] + sum(r.num_seqs for r in requests),
                       base[1] + sum(r.mean_context_tokens() for r in requests))
        queued = 0
        for request in sorted((r for r in requests if not r.started), key=lambda r: r.key):
            queued += request.num_prompt_tokens
            if _behind(request, now + rates.prefill_s(queued) + request.remaining_tokens() * step):
                return False
        return not any(_behind(request, now + request.remaining_tokens() * step)
                       for request in requests if request.started)

    def _next_finish_s(self, rates: Rates, now: float) -> float:
        """Seconds until the first admitted request is forecast to finish: a retry hint."""
        step = rates.step_s(self.num_seqs, self.context_tokens())
        started = [r.remaining_tokens() * step for r in self.admitted.values() if r.started]
        return min(started, default=rates.prefill_s(self.tokens_ahead((math.inf,))) + step)


class Behind:
    """Since when the checks have found admitted requests behind their deadlines."""

    def __init__(self) -> None:
        self.since: float | None = None

    def confirmed(self, now: float, behind: bool, admitted) -> bool:
        """Whether falling behind is confirmed at `now`: this check found some of `admitted`
        behind (`behind`), and so did every one since the first that did, for long enough.
        A confirmation starts the next one afresh."""
        if not behind:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        span = min((r.deadline - r.arrival for r in admitted if r.deadline is not None), default=0.0)
        if now - self.since < min(OBSERVE_WINDOW_S, CONFIRM_SHARE * span):
            return False
        self.since = None
        return True


def _behind(request: Admitted, finish: float) -> bool:
    """Whether a request finishing at `finish` is behind its deadline (within SHED_MARGIN of its time)."""
    return finish > request.deadline - SHED_MARGIN * (request.deadline - request.arrival)
