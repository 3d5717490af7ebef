"""The gateway's admission control: whether a request may start, decided at once.

Two bounds, and a forecast (gateway/forecast.py):

- requests in flight (`--max-concurrent-requests`): the decode workers' max_num_seqs,
  summed. Every admitted request then has a place in a running batch once prefilled,
  so none waits on a decode worker while its prefill worker holds its KV. Checked
  before tokenizing: an overloaded gateway refuses at once;
- the forecast first token (`--max-queue-wait-s`, DEFAULT_MAX_QUEUE_WAIT_S, a minute): the
  prompt tokens queued ahead of it and its own, at the prefill workers' measured
  rate. A burst queues while its last request's first token is forecast within the
  bound: seconds, so that what a person or a benchmark client sends at once is served;
- its deadline (the gRPC deadline, the request's SLO): a request whose forecast last
  token falls past DEADLINE_SHARE of the time it has is refused before any prefill
  is spent, and so is one that would push an admitted request past its own. A
  deadline that not even an idle deployment could meet is DEADLINE_EXCEEDED; every
  other refusal is RESOURCE_EXHAUSTED with a RetryInfo (when the cause should clear).
- optionally, prompt tokens queued (`--max-queued-tokens`, off by default): a hard
  bound on the queue in tokens, for a deployment that wants one.

The gateway dispatches what it admits at once; the order in which the admitted wait
for their prefill is the prefill workers' (priority, then earliest deadline, then
arrival), and the forecast assumes that order. Requests moved off a lost worker are
not admitted again: admission is the gateway's promise to a request, made once.

A promise a wrong forecast cannot keep is not kept for everyone at the cost of all:
while requests decode, their progress is checked against their deadlines (at most every
SHED_INTERVAL_S, as their tokens come), and when the deployment falls behind, the
fewest are shed (Forecast.to_shed) with DEADLINE_EXCEEDED naming why, so that the rest
finish in time; the step they show also scales the forecast of what is admitted next.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, replace

import grpc

from baton.runtime.admission import AdmissionLimits, AdmissionQueue, Overloaded
from baton.runtime.settings import GatewaySettings
from baton.wire.records import AdmissionStatus
from engine.sampling_params import SamplingParams
from gateway.errors import RequestError
from gateway.forecast import (
    CONCURRENCY,
    DEADLINE,
    MAX_DECODE_SCALE,
    QUEUE_WAIT,
    SHED,
    Admitted,
    Behind,
    DecodeProgress,
    DecodeScale,
    Forecast,
    OutputLengths,
    Rates,
    Verdict,
)
from gateway.workers import POLL_INTERVAL_S, Worker, WorkerPool

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_WAIT_S = 60.0
# With no worker's limits known yet (none has answered a poll): the dispatcher
# refuses with UNAVAILABLE anyway, so admission stands aside.
UNKNOWN = AdmissionLimits(max_requests=1 << 30, max_queued_tokens=1 << 40)
FORECAST_WINDOW = 256  # requests whose forecast and observed first tokens are compared
MIN_RETRY_S, MAX_RETRY_S = 0.1, 10.0
SHED_INTERVAL_S = 0.25  # how often running requests' progress is checked against their deadlines


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """The configured limits; 0 means derived from the workers (or, for the token bound, none)."""

    max_concurrent_requests: int = 0
    max_queued_tokens: int = 0
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("admission limits must be >= 0 (0: derived from the workers)")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayLimits:
        return cls(settings.max_concurrent_requests, settings.max_queued_tokens, settings.max_queue_wait_s)

    def derive(self, decode: list[Worker]) -> AdmissionLimits:
        """The bounds over these workers' last polled stats (down ones too: a worker that
        blips out for a poll should not halve the gateway's limits)."""
        requests = self.max_concurrent_requests or sum(w.stats.max_num_seqs for w in decode)
        return AdmissionLimits(requests or UNKNOWN.max_requests, self.max_queued_tokens or UNKNOWN.max_queued_tokens)


def pooled_rates(prefill: list[Worker], decode: list[Worker]) -> Rates:
    """The serving workers' published models, pooled: prefill workers prefill together
    (the decode workers, when no prefill worker serves); a decode step's model is the
    decode workers' mean."""
    # A worker has a model once any of its coefficients is known (a line fitted through
    # the origin has no base: taking it for none let a burst in on the concurrency bound alone).
    decoders = [w for w in decode if w.is_up and w.stats.decode_step_s(1) is not None]
    prefillers = [w for w in prefill if w.is_up and w.stats.prefill_s_per_token > 0] or \
        [w for w in decoders if w.stats.prefill_s_per_token > 0]
    per_second = sum(1.0 / w.stats.prefill_s_per_token for w in prefillers)
    return Rates(
        prefill_s_per_token=1.0 / per_second if per_second else None,
        decode_base_s=sum(w.stats.decode_step_base_s for w in decoders) / len(decoders) if decoders else None,
        decode_per_seq_s=sum(w.stats.decode_step_per_seq_s for w in decoders) / len(decoders) if decoders else 0.0,
        num_decode_workers=len(decoders),
        decode_per_token_s=(sum(w.stats.decode_step_per_context_token_s for w in decoders) / len(decoders)
                            if decoders else 0.0),
    )


class AdmissionStats:
    """What admission did: refusals by reason, deadlines missed after admission, and
    forecast against observed first tokens (seconds from arrival)."""

    def __init__(self) -> None:
        self.num_admitted = 0
        self.refused: Counter[str] = Counter()
        self.num_deadline_misses = 0  # admitted, then ended at their deadline
        self.num_met_deadlines = 0  # finished with a deadline, within it
        self.num_shed = 0  # admitted, then ended early: the deployment fell behind
        self.ttft_pairs: deque[tuple[float, float]] = deque(maxlen=FORECAST_WINDOW)  # (forecast, observed)

    def mean_ttft(self) -> tuple[float | None, float | None]:
        """Mean forecast and observed first token of the last FORECAST_WINDOW requests."""
        if not self.ttft_pairs:
            return None, None
        n = len(self.ttft_pairs)
        return sum(f for f, _ in self.ttft_pairs) / n, sum(o for _, o in self.ttft_pairs) / n


class GatewayAdmission:
    """Admits or refuses the gateway's requests; bounds re-derived at most once a poll."""

    def __init__(self, pool: WorkerPool, limits: GatewayLimits = GatewayLimits(),
                 clock=time.monotonic) -> None:
        self.pool = pool
        self.configured = limits
        self.queue = AdmissionQueue(UNKNOWN, clock)
        self.forecast = Forecast()
        self.outputs = OutputLengths()
        self.decode_scale = DecodeScale()
        self.stats = AdmissionStats()
        self._clock = clock
        self._orders = itertools.count()
        self._derived_at = float("-inf")
        self._rates = Rates(None, None, 0.0, 0)
        # The integrals over time of the sequences admitted and of the decoding requests'
        # context tokens (DecodeScale's), to when they were last advanced.
        self._areas = (0.0, 0.0)
        self._area_at = clock()
        # The requests in flight (self.queue's) by the front end each came by, for the gauge.
        self._fronts: dict[str, str] = {}
        self._num_in_flight: Counter[str] = Counter()
        # Requests shed, by id, with the error they end with; and the step scale the
        # running requests show (None: nothing observed), as of the last check that saw one.
        self.shed: dict[str, RequestError] = {}
        self.progress = DecodeProgress(clock())
        self.observed_scale: float | None = None
        self._checked_at = float("-inf")
        self.behind = Behind()

    @property
    def limits(self) -> AdmissionLimits:
        self._refresh()
        return self.queue.limits

    @property
    def rates(self) -> Rates:
        self._refresh()
        return self._rates

    def _refresh(self) -> None:
        """The workers' stats change once a poll, so the derived limits and rates may too."""
        now = self._clock()
        if now - self._derived_at >= POLL_INTERVAL_S:
            self.queue.limits = self.configured.derive(self.pool.decode)
            self._rates = replace(pooled_rates(self.pool.prefill, self.pool.decode),
                                  decode_scale=self.decode_scale.value)
            self._derived_at = now

    def _advance(self) -> tuple[float, float]:
        """The integrals of the sequences admitted and of the decoding requests' context
        tokens over time, brought to now (call before either changes)."""
        now = self._clock()
        admitted, context = self._areas
        elapsed = now - self._area_at
        self._areas = (admitted + self.forecast.num_seqs * elapsed, context + self.progress.context_tokens * elapsed)
        self._area_at = now
        return self._areas

    def check_room(self, num_seqs: int, field: str = "sampling.n") -> None:
        """RequestError RESOURCE_EXHAUSTED if `num_seqs` more sequences (a batch's, all its
        prompts' choices) would not fit beside those in flight, INVALID_ARGUMENT (naming
        `field`, what asked for them) if they could never fit; nothing is held either way."""
        self._refresh()
        limit = self.queue.limits.max_requests
        if num_seqs > limit:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{num_seqs} sequences asked for (prompts times n): "
                               f"this deployment runs at most {limit} at once", field=field)
        try:
            self.queue.check_room(num_seqs)
        except Overloaded as refusal:
            self.stats.refused[CONCURRENCY] += 1
            raise _refused(Verdict(CONCURRENCY, str(refusal), refusal.retry_after_s)) from None

    def admit(self, request_id: str, front: str = "", num_seqs: int = 1) -> None:
        """Take a request on before tokenizing it; RequestError RESOURCE_EXHAUSTED if its
        `num_seqs` sequences (its n choices: each runs in a decode batch) would pass what
        the decode workers can run. `front`: the front end it came by (grpc, http), for
        `in_flight`."""
        self.check_room(num_seqs)
        self.queue.admit(request_id, num_seqs=num_seqs)
        self._fronts[request_id] = front
        self._num_in_flight[front] += 1

    def in_flight(self, front: str) -> int:
        """Requests that came by `front`, admitted and not yet released or refused (read
        by a scrape's thread: one lookup)."""
        return self._num_in_flight[front]

    def _leave(self, request_id: str) -> None:
        front = self._fronts.pop(request_id, None)
        if front is not None:
            self._num_in_flight[front] -= 1

    def queue_tokens(self, request_id: str, num_tokens: int, params: SamplingParams | None = None,
                     priority: int = 0, deadline: float | None = None, arrival: float | None = None,
                     max_context: int | None = None, num_seqs: int = 1) -> float | None:
        """Its prompt, once tokenized, and what it asks for: RequestError (and released)
        if the forecast says no. `deadline`: time.monotonic() seconds, None for none.
        `max_context`: the model's context, which ends a request before its max_tokens
        when they do not fit beside its prompt (None: unknown); `num_seqs`: its choices,
        each a place in a decode batch. Returns its forecast first token, seconds from
        arrival (None: no model yet)."""
        now = self._clock()
        params = params or SamplingParams()
        max_tokens = params.max_tokens if max_context is None else max(1, min(params.max_tokens,
                                                                              max_context - num_tokens))
        request = Admitted(request_id, priority, deadline, now if arrival is None else arrival, next(self._orders),
                           num_tokens, max_tokens, self.outputs.expected(max_tokens, params.ignore_eos),
                           num_seqs=num_seqs)
        verdict = self.forecast.judge(request, self._judging_rates(), now, self.configured.max_queue_wait_s)
        if verdict is None:
            try:
                self.queue.queue_tokens(request_id, num_tokens)
            except Overloaded as refusal:
                verdict = Verdict(QUEUE_WAIT, str(refusal), refusal.retry_after_s)
        if verdict is not None:
            self.queue.withdraw(request_id)
            self._leave(request_id)
            self.stats.refused[verdict.reason] += 1
            raise _refused(verdict)
        self._advance()
        self.forecast.add(request)
        self.stats.num_admitted += 1
        return request.forecast_ttft_s

    def started(self, request_id: str) -> None:
        """Its first token came: its prompt is no longer queued."""
        self.queue.started(request_id)
        request = self.forecast.admitted.get(request_id)
        if request is not None and not request.started:
            self.forecast.started(request_id)
            if request.forecast_ttft_s is not None:
                self.stats.ttft_pairs.append((request.forecast_ttft_s, self._clock() - request.arrival))

    def generated(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` more came (the first event: the prefill's first token)."""
        request = self.forecast.admitted.get(request_id)
        if request is None:
            return
        if request.decode_start_at is not None:
            now = self._clock()
            self._advance()
            self.progress.decoded(num_tokens, now - request.last_event_at, request.num_seqs)
            request.last_event_at = now
        elif request.num_generated:  # its first decode step's
            request.decode_start_at = request.last_event_at = self._clock()
            request.areas_at_decode_start = self._advance()
            request.decode_start_tokens = request.num_generated + num_tokens
            self.progress.started(request.num_seqs, request.num_seqs * (request.num_prompt_tokens
                                                                        + request.decode_start_tokens))
        request.num_generated += num_tokens
        self._check_progress()

    def _judging_rates(self) -> Rates:
        """The rates a newcomer is judged by: the decode scale is the larger of what
        finished requests taught and what the running ones show."""
        rates = self.rates
        if self.observed_scale is not None and self.observed_scale > rates.decode_scale:
            rates = replace(rates, decode_scale=min(MAX_DECODE_SCALE, self.observed_scale))
        return rates

    def _check_progress(self) -> None:
        """Shed what the running requests' progress says cannot finish in time (at most
        every SHED_INTERVAL_S)."""
        now = self._clock()
        if now - self._checked_at < SHED_INTERVAL_S:
            return
        self._checked_at = now
        rates, observed = self.rates, self.progress.sample(now)
        if observed is not None:
            self.observed_scale = observed.scale(rates)
        elif not self.progress.num_decoding:
            self.observed_scale = None  # kept while a fresh window fills, forgotten once none decodes
        shed = [r for r in self.forecast.to_shed(rates, now, observed) if r.request_id not in self.shed]
        if not self.behind.confirmed(now, bool(shed), self.forecast.admitted.values()):
            return
        self.progress.restart(now)  # the batch it was measured in is gone
        kept = len(self.forecast.admitted) - len(self.shed) - len(shed)
        for request in shed:
            self.shed[request.request_id] = RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"shed: the deployment fell behind its forecast, and this request could not finish by its deadline "
                f"beside the {kept} admitted requests kept (those of higher priority, or admitted earlier)",
                reason=SHED)
        self.stats.num_shed += len(shed)
        logger.warning("admission: the deployment fell behind its forecast (decode steps %s the workers' line%s): "
                       "shed %d request(s), kept %d",
                       "?" if self.observed_scale is None else f"{self.observed_scale:.1f}x",
                       "" if observed is None else f": {observed.step_s * 1e3:.1f} ms at a batch of "
                       f"{observed.batch:.0f}, {observed.context / max(1.0, observed.batch):.0f} tokens each",
                       len(shed), kept)

    def shed_error(self, request_id: str) -> RequestError | None:
        """The error a shed request ends with (None: it is not shed)."""
        return self.shed.get(request_id)

    def release(self, request_id: str, outcome: str | None = None) -> None:
        """It ended, however; `outcome`: its finish reason, or "deadline" when its deadline
        passed first (a forecast that failed it)."""
        self.queue.release(request_id)
        self._leave(request_id)
        self.shed.pop(request_id, None)
        if request_id not in self.forecast.admitted:
            return
        areas = self._advance()
        request = self.forecast.remove(request_id)
        if request.decode_start_at is not None:
            self.progress.ended(request.num_seqs, request.num_seqs * (request.num_prompt_tokens
                                                                      + request.num_generated))
        if outcome == "stop":
            self.outputs.add(request.num_generated)
        if outcome in ("stop", "length"):
            self.decode_scale.add(request, self._clock(), areas, self.rates)
        if outcome == DEADLINE:
            self.stats.num_deadline_misses += 1
        elif request.deadline is not None and outcome in ("stop", "length"):
            self.stats.num_met_deadlines += 1

    def status(self) -> AdmissionStatus:
        """For `baton status`."""
        wait = self.forecast_wait_s()
        forecast, observed = self.stats.mean_ttft()
        limit = self.limits.max_requests
        return AdmissionStatus(
            max_concurrent_requests=0 if limit == UNKNOWN.max_requests else limit,
            max_queue_wait_s=self.configured.max_queue_wait_s, num_in_flight=self.queue.num_requests,
            num_admitted=self.stats.num_admitted, num_refused_concurrency=self.stats.refused[CONCURRENCY],
            num_refused_queue_wait=self.stats.refused[QUEUE_WAIT], num_refused_deadline=self.stats.refused[DEADLINE],
            num_deadline_misses=self.stats.num_deadline_misses, num_met_deadlines=self.stats.num_met_deadlines,
            forecast_known=wait is not None, forecast_queue_wait_s=wait or 0.0,
            mean_forecast_ttft_s=forecast or 0.0, mean_observed_ttft_s=observed or 0.0,
            decode_scale=self.decode_scale.value, decode_step_base_s=self.rates.decode_base_s or 0.0,
            decode_step_per_seq_s=self.rates.decode_per_seq_s,
            decode_step_per_context_token_s=self.rates.decode_per_token_s,
        )

    def forecast_wait_s(self) -> float | None:
        """The first token a request with an empty prompt would be forecast now (None: no model yet)."""
        rates = self.rates
        return rates.prefill_s(self.forecast.tokens_ahead((float("inf"),))) if rates.known else None


def _refused(verdict: Verdict) -> RequestError:
    if verdict.hopeless:
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"refused: {verdict.message}", reason=verdict.reason)
    retry = min(MAX_RETRY_S, max(MIN_RETRY_S, verdict.retry_after_s))
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {verdict.message}; retry in {retry:.1f} s",
                        retry_after_s=retry, reason=verdict.reason)
