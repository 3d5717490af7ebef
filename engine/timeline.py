"""Timeline events of a traced request: what happened to it on this engine, and when.

A request added with `trace=True` records one event per state change the
scheduler or the engine makes for it (`Request.record`); its outputs carry the
events off as they come (`RequestOutput.events`). The records are plain data:
turning them into span events, with their names and attributes, is the
tracing layer's business (baton/runtime/tracing.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import PreemptionKind


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """Base of every event: `time_ns` is wall-clock time (time.time_ns), stamped when made."""

    time_ns: int = field(default_factory=time.time_ns, kw_only=True)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The engine step a request's work ran in, and that step's batch."""

    step_index: int  # the scheduler's step count once the step ended
    num_seqs: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Admitted(TimelineEvent):
    """Entered the running batch from the waiting queue (or began to receive its KV)."""

    queue_time_s: float  # arrival to this admission
    readmitted: bool  # it was admitted before: preempted by recompute, or its KV never came
    kv_remote: bool  # its prompt's KV comes from another engine
    # Tokens at its start whose KV the prefix cache held (of a kv_remote request: those
    # not received).
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of them, those copied back from the host tier


@dataclass(frozen=True, slots=True)
class PrefillChunk(TimelineEvent):
    """A step computed a chunk of its prompt (or of tokens whose KV it lost)."""

    start: int  # num_computed_tokens before the chunk
    num_tokens: int
    # The chunk recomputes KV the request had before: after a recompute preemption, or
    # a handoff whose KV never arrived.
    is_recompute: bool
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class Preempted(TimelineEvent):
    """Taken out of the running batch to free KV blocks for others."""

    kind: PreemptionKind
    num_blocks: int  # blocks it held
    num_computed_tokens: int  # tokens whose KV it had


@dataclass(frozen=True, slots=True)
class SwappedIn(TimelineEvent):
    """Back in the running batch after a swap preemption."""

    num_blocks: int  # blocks copied back from the swap pool


@dataclass(frozen=True, slots=True)
class KvReceived(TimelineEvent):
    """Its prompt's KV, computed by another engine, arrived: it decodes from here."""


@dataclass(frozen=True, slots=True)
class KvReceiveFailed(TimelineEvent):
    """Its prompt's KV will not arrive: it waits again, to prefill here."""


@dataclass(frozen=True, slots=True)
class FirstDecodeStep(TimelineEvent):
    """The first step that sampled a token after the first one (its prompt done)."""

    batch: StepBatch
