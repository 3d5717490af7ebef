"""Where a request's time went, phase by phase, from its arrival at the gateway to its
second token.

Each process stamps the moments of a request it sees, in wall-clock nanoseconds (one
clock for all the processes of a host; across hosts, as close as their clocks agree),
and the gateway, which sees the request end to end, turns them into phases: each the
time between two moments. Two chains share the prefill:

    arrival -gateway_queue-> prefill_sent -prefill_queue-> admitted -prefill_compute-> first_token
      first_token -first_token_out-> first_token_out                                    (time to first token)
      first_token -handover-> decode_received -decode_queue-> kv_admitted -pull_start-> receive_started
        -kv_channel-> channel_ready -kv_copy-> copied
        -kv_checksum-> kv_received -kv_ready_wait-> kv_ready -first_decode_step-> second_token
        -second_token_out-> second_token_out                                           (time to second token)

`first_token` and `second_token` are when the worker sampled them; the `_out` moments,
when the gateway had them. The phases of a chain add up to its time exactly. A request
prefilled on its decode worker (colocated) has the first chain and no handoff phases.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from baton.wire.records import LatencyStatus, PhaseLatency

# Moments, by the process that stamps them.
ARRIVAL, PREFILL_SENT = "arrival", "prefill_sent"  # the gateway
FIRST_TOKEN_OUT, SECOND_TOKEN_OUT = "first_token_out", "second_token_out"  # the gateway
ADMITTED, FIRST_TOKEN = "admitted", "first_token"  # the worker that prefilled (its engine)
DECODE_RECEIVED = "decode_received"  # the decode worker: a handed-off request's Decode call arrived
# The decode worker's pull.
RECEIVE_STARTED, CHANNEL_READY, COPIED, KV_RECEIVED = "receive_started", "channel_ready", "copied", "kv_received"
KV_ADMITTED, KV_READY, SECOND_TOKEN = "kv_admitted", "kv_ready", "second_token"  # the decode worker's engine


@dataclass(frozen=True)
class Phase:
    name: str
    start: str  # moment
    end: str  # moment
    help: str
    # What shortens it, when it is the largest between the first token and the second
    # (`baton status`).
    advice: str = ""


PHASES = (
    Phase("gateway_queue", ARRIVAL, PREFILL_SENT, "At the gateway: tokenizing, admission and routing."),
    Phase("prefill_queue", PREFILL_SENT, ADMITTED, "The call to the worker that prefills, and the prompt's wait "
          "there for a place in a batch."),
    Phase("prefill_compute", ADMITTED, FIRST_TOKEN, "The prompt's chunks, to its first token."),
    Phase("first_token_out", FIRST_TOKEN, FIRST_TOKEN_OUT, "The first token, from the worker's step to the "
          "gateway."),
    Phase("handover", FIRST_TOKEN, DECODE_RECEIVED, "From the prefill worker's first token to the decode "
          "worker's Decode call: the answer to the gateway, and its call.",
          "the prefill worker's answer and the gateway's Decode call: a busy gateway (more of them) or the network"),
    Phase("decode_queue", DECODE_RECEIVED, KV_ADMITTED, "The decode worker's queue: the wait for a place in its "
          "batch and blocks for the prompt's KV.",
          "handed-off requests waited for a place in the decode worker's batch: more decode workers, a higher "
          "--max-num-seqs, or shorter steps there (a lower --max-decode-stretch)"),
    Phase("pull_start", KV_ADMITTED, RECEIVE_STARTED, "From the admission to the start of the KV pull.",
          "the decode worker's event loop was slow to start the pull: a busy decode worker process "
          "(more decode workers)"),
    Phase("kv_channel", RECEIVE_STARTED, CHANNEL_READY, "The pull's wait for a channel to the prefill worker "
          "(opening one the first time).",
          "pulls waited for a channel to their prefill worker: more prefill workers, so that fewer pulls share each"),
    Phase("kv_copy", CHANNEL_READY, COPIED, "The send's start and the copy of the blocks.",
          "the copy itself: a faster transport (ipc on one host, nccl between GPUs), or prompts whose prefix the "
          "decode worker holds already (prefix caching)"),
    Phase("kv_checksum", COPIED, KV_RECEIVED, "The blocks' checksums (--verify-kv) and the send's end.",
          "--verify-kv checksums every block on both sides: leave it off where the transport is trusted"),
    Phase("kv_ready_wait", KV_RECEIVED, KV_READY, "The received KV, waiting for the decode engine's step in "
          "progress to end.",
          "the received KV waited for the decode engine's step in progress: shorter steps (a lower "
          "--max-decode-stretch, prompts kept on prefill workers with --max-prefill-queue-tokens 0)"),
    Phase("first_decode_step", KV_READY, SECOND_TOKEN, "The decode worker's first step of the request, to its "
          "second token.",
          "the decode worker's steps are long: more decode workers, a lower --max-num-seqs or --max-decode-stretch"),
    Phase("second_token_out", SECOND_TOKEN, SECOND_TOKEN_OUT, "The second token, from the decode worker's step "
          "to the gateway.",
          "the second token's way back to the gateway: a busy gateway (more of them) or the network"),
)
PHASE_ADVICE = {phase.name: phase.advice for phase in PHASES if phase.advice}
PHASE_NAMES = tuple(phase.name for phase in PHASES)
# The phases between the first token and the second, in a handed-off request's chain.
HANDOFF_PHASES = PHASE_NAMES[4:]


def phases(moments: dict[str, int]) -> dict[str, float]:
    """The phases (seconds) whose two moments are both known, and in order: a phase between
    the processes of two hosts whose clocks disagree by more than it lasted is left out."""
    durations = {phase.name: (moments[phase.end] - moments[phase.start]) / 1e9 for phase in PHASES
                 if phase.start in moments and phase.end in moments}
    return {name: seconds for name, seconds in durations.items() if seconds >= 0}


def stamp(moments: dict[str, int], **monotonic: float | None) -> dict[str, int]:
    """`moments` with each given time.monotonic() reading added as its moment (None: not)."""
    offset = time.time_ns() - time.monotonic_ns()
    moments.update({name: offset + int(value * 1e9) for name, value in monotonic.items() if value is not None})
    return moments


def engine_moments(timings, handed_off: bool = False) -> dict[str, int]:
    """The moments an engine's RequestTimings hold (None: no timings). A handed-off request
    was admitted to wait for its KV, not to prefill; if the pull failed and its prompt was
    prefilled here after all, the token that prefill sampled is its second."""
    if timings is None:
        return {}
    if handed_off:
        second = timings.first_decode_at if timings.kv_ready_at is not None else timings.first_token_at
        return stamp({}, **{KV_ADMITTED: timings.admitted_at, KV_READY: timings.kv_ready_at, SECOND_TOKEN: second})
    return stamp({}, **{ADMITTED: timings.admitted_at, FIRST_TOKEN: timings.first_token_at,
                        SECOND_TOKEN: timings.first_decode_at})


# The requests `baton status` reports phases over: the gateway's latest.
RECENT_REQUESTS = 256


class RecentLatency:
    """The phases of the gateway's latest RECENT_REQUESTS requests (each with both tokens)."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._requests: deque[tuple[float, float, dict[str, float]]] = deque(maxlen=size)

    def add(self, ttft: float, ttst: float, phases: dict[str, float]) -> None:
        self._requests.append((ttft, ttst, phases))

    def status(self, latest: int | None = None) -> LatencyStatus:
        """Over the latest `latest` requests (None: all it keeps)."""
        requests = list(self._requests)[-latest:] if latest else list(self._requests)
        if not requests:
            return LatencyStatus(0, ())
        rows = []
        for name in PHASE_NAMES:
            values = sorted(phases[name] for _, _, phases in requests if name in phases)
            if values:
                rows.append(PhaseLatency(name, _quantile(values, 0.5), _quantile(values, 0.9),
                                         sum(values) / len(values)))
        means = {row.phase: row.mean_s for row in rows if row.phase in HANDOFF_PHASES}
        ttft, ttst = sorted(r[0] for r in requests), sorted(r[1] for r in requests)
        return LatencyStatus(len(requests), tuple(rows), _quantile(ttft, 0.5), _quantile(ttft, 0.9),
                             _quantile(ttst, 0.5), _quantile(ttst, 0.9), max(means, key=means.get, default=""))


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values` (nearest rank)."""
    return values[min(len(values) - 1, int(q * len(values)))]
