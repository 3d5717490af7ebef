"""The gateway's admission control: an AdmissionQueue (baton/runtime/admission.py) whose
limits, unless configured, follow the capacity its workers report.

- requests in flight (`--max-concurrent-requests`): the decode workers' max_num_seqs,
  summed. Every admitted request then has a place in a running batch once prefilled,
  so none waits on a decode worker while its prefill worker holds its KV;
- prompt tokens queued, admitted but without a first token yet
  (`--max-queued-tokens`): QUEUE_STEPS, half a step of the prefill workers'
  token budgets (the decode workers' when there are no prefill workers: they
  prefill then). The count includes the prompts being prefilled, so a newcomer's
  first token waits for at most that many tokens, its own included: the bound is
  a bound on time to first token. Half a step still keeps a prefill worker busy
  (one part of the queue is computed while the rest waits). On the overload
  benchmark (benchmarks/overload.py, SmolLM2-135M, 3x the capacity, roles on
  cores of their own) half a step held the accepted TTFT p99 at 1.1-1.3x the
  unloaded p99 for 5% less goodput than a whole step, which let it reach 2.2x
  (3.0x at 1.5 steps). The price: a prompt longer than the bound gets in only when
  nothing is queued, so under sustained overload such prompts are refused far more
  often than short ones; a deployment that serves them sets `--max-queued-tokens` to
  at least its longest prompts. (A bound on the tokens ahead of a newcomer instead,
  which does not depend on its length, cut goodput by a third on the same benchmark.)

Beyond either, a request is refused at once: RESOURCE_EXHAUSTED with a RetryInfo.
The request count is checked before tokenizing, the prompt tokens right after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from baton.runtime.admission import AdmissionLimits, AdmissionQueue, Overloaded
from baton.runtime.settings import GatewaySettings
from gateway.errors import RequestError
from gateway.workers import POLL_INTERVAL_S, Worker, WorkerPool

QUEUE_STEPS = 0.5
# With no worker's limits known yet (none has answered a poll): the dispatcher
# refuses with UNAVAILABLE anyway, so admission stands aside.
UNKNOWN = AdmissionLimits(max_requests=1 << 30, max_queued_tokens=1 << 40)


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """The configured limits; 0 means derived from the workers."""

    max_concurrent_requests: int = 0
    max_queued_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("admission limits must be >= 0 (0: derived from the workers)")

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayLimits:
        return cls(settings.max_concurrent_requests, settings.max_queued_tokens)

    def derive(self, prefill: list[Worker], decode: list[Worker]) -> AdmissionLimits:
        """The limits over these workers' last polled stats (down ones too: a worker that
        blips out for a poll should not halve the gateway's limits)."""
        requests = self.max_concurrent_requests or sum(w.stats.max_num_seqs for w in decode)
        budgets = [w.stats.max_num_batched_tokens for w in (prefill if _known(prefill) else decode)]
        step = sum(budgets)  # 0: no worker's budget is known yet
        tokens = self.max_queued_tokens or (max(1, int(QUEUE_STEPS * step)) if step else 0)
        return AdmissionLimits(requests or UNKNOWN.max_requests, tokens or UNKNOWN.max_queued_tokens)


def _known(workers: list[Worker]) -> bool:
    return any(w.stats.max_num_batched_tokens for w in workers)


class GatewayAdmission:
    """Admits or refuses the gateway's requests; limits re-derived at most once a poll."""

    def __init__(self, pool: WorkerPool, limits: GatewayLimits = GatewayLimits()) -> None:
        self.pool = pool
        self.configured = limits
        self.queue = AdmissionQueue(UNKNOWN)
        self._derived_at = float("-inf")

    @property
    def limits(self) -> AdmissionLimits:
        self._refresh()
        return self.queue.limits

    def _refresh(self) -> None:
        """The workers' stats change once a poll, so the derived limits may too."""
        now = time.monotonic()
        if now - self._derived_at >= POLL_INTERVAL_S:
            self.queue.limits = self.configured.derive(self.pool.prefill, self.pool.decode)
            self._derived_at = now

    def admit(self, request_id: str) -> None:
        """Take a request on before tokenizing it; RequestError RESOURCE_EXHAUSTED if full."""
        self._refresh()
        try:
            self.queue.admit(request_id)
        except Overloaded as refusal:
            raise _refused(refusal) from None

    def queue_tokens(self, request_id: str, num_tokens: int) -> None:
        """Its prompt, once tokenized; RequestError RESOURCE_EXHAUSTED (and released) if
        too many tokens are queued."""
        try:
            self.queue.queue_tokens(request_id, num_tokens)
        except Overloaded as refusal:
            raise _refused(refusal) from None

    def started(self, request_id: str) -> None:
        self.queue.started(request_id)

    def release(self, request_id: str) -> None:
        self.queue.release(request_id)


def _refused(refusal: Overloaded) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{refusal}; retry in {refusal.retry_after_s:.1f} s",
                        retry_after_s=refusal.retry_after_s)
