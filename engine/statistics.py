"""The statistics an engine exports, each declared once.

A statistic is a field of `EngineStats` (or of `RecentStats`, the same over the recent
window) declared with `stat()`: its name and type, what it means, whether it is a level
(GAUGE: read as it is, summed or maxed across workers) or a running total (COUNTER: read
as a rate), its field number on the wire, and the Prometheus family it is exported as.
A tuple statistic (a count per position) is a repeated field on the wire and one series
per position in its family, labelled by its `index_label`.
Every layer above reads the declaration instead of listing the fields again:

    Scheduler.stats()     SchedulerStats(EngineStats): computes each field, plus the engine's own
    worker_stats()        WorkerStats(EngineStats): the engine's fields taken as declared
    worker.proto          its EngineStats and RecentStats fields, written from these declarations
                          by `python -m baton.devtools.protogen` (tests check they are current)
    /metrics              one Prometheus family per declared metric (baton/runtime/metrics.py)
    baton status --json   every field of WorkerStats

No torch here: the gateway reads these records.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from dataclasses import dataclass, field

GAUGE = "gauge"
COUNTER = "counter"


@dataclass(frozen=True)
class StatSpec:
    kind: str  # GAUGE or COUNTER
    help: str
    number: int  # its field number in the wire message
    # The Prometheus family it is exported as (None: not exported), and the label that
    # tells it from the other statistics of its family, if it shares one.
    metric: str | None = None
    label: tuple[str, str] | None = None
    # A statistic that is a tuple of counts (one per position): the label whose value is
    # each count's position, from 1, in its family's series.
    index_label: str | None = None


def stat(kind: str, help: str, number: int, metric: str | None = None, label: tuple[str, str] | None = None,
         default: object = 0, index_label: str | None = None) -> typing.Any:
    """A statistic's field (see the module's docstring)."""
    assert kind in (GAUGE, COUNTER), kind
    return field(default=default, metadata={"stat": StatSpec(kind, help, number, metric, label, index_label)})


def declared(cls: type) -> list[tuple[str, StatSpec]]:
    """The statistics `cls` declares: (name, spec), in declaration order."""
    return [(f.name, f.metadata["stat"]) for f in dataclasses.fields(cls) if "stat" in f.metadata]


def values(record: object, cls: type) -> dict[str, object]:
    """`record`'s values of the statistics `cls` declares (record is a cls or a subclass)."""
    return {name: getattr(record, name) for name, _ in declared(cls)}


def repeated(cls: type) -> list[str]:
    """The statistics `cls` declares that are tuples (repeated fields on the wire)."""
    hints = typing.get_type_hints(cls)
    return [name for name, _ in declared(cls) if typing.get_origin(hints[name]) is tuple]


_PROTO_TYPES = {int: "uint64", float: "double", bool: "bool"}


def _proto_type(hint: typing.Any) -> str:
    """int: uint64, ...; tuple[int, ...]: repeated uint64."""
    if typing.get_origin(hint) is tuple:
        return "repeated " + _PROTO_TYPES[typing.get_args(hint)[0]]
    return _PROTO_TYPES[hint]


def proto_fields(cls: type) -> list[str]:
    """The wire message's lines for the statistics `cls` declares: each field with its
    help as the comment above it (what baton.devtools.protogen writes into worker.proto)."""
    hints = typing.get_type_hints(cls)
    lines = []
    for name, spec in declared(cls):
        lines += ["  // " + line for line in textwrap.wrap(spec.help, 86)]
        lines.append(f"  {_proto_type(hints[name])} {name} = {spec.number};")
    return lines


@dataclass(frozen=True, slots=True, kw_only=True)
class RecentStats:
    """What the scheduler did over its recent steps: the last `window_seconds`, or fewer
    steps if it has been idle (steps happen only while there is work)."""

    window_seconds: float = stat(GAUGE, "The window's length.", 1)
    seconds: float = stat(GAUGE, "The time the window's steps span, from its first to its last.", 2)
    seconds_since_last_step: float = stat(GAUGE, "Seconds since the last step (inf, on the wire 1e12: none yet).", 3)
    num_steps: int = stat(COUNTER, "Steps in the window.", 4)
    mean_batch_size: float = stat(GAUGE, "Sequences per step.", 5)
    mean_tokens_per_step: float = stat(GAUGE, "Tokens per step.", 6)
    mean_kv_usage: float = stat(GAUGE, "Fraction of KV blocks in use after each step, averaged.", 7)
    mean_num_waiting: float = stat(GAUGE, "Requests left waiting after each step, averaged.", 8)
    num_admissions: int = stat(COUNTER, "Entries into the running batch: admissions, readmissions, swap-ins.", 9)
    num_preemptions_recompute: int = stat(COUNTER, "Preemptions that will recompute the request's KV.", 10)
    num_preemptions_swap: int = stat(COUNTER, "Preemptions that moved the request's KV to the CPU swap pool.", 11)
    num_swapped_blocks_out: int = stat(COUNTER, "Blocks moved to the CPU swap pool by swap preemptions.", 12)
    num_queued: int = stat(COUNTER, "Requests admitted for the first time.", 13)
    mean_queue_seconds: float = stat(GAUGE, "Their mean time from arrival to admission.", 14)
    num_steps_kv_blocked: int = stat(COUNTER, "Steps that ended with requests waiting for KV blocks (refused for lack "
                                     "of free blocks, or held back by a preemption or swapped requests).", 15)
    num_steps_seq_capped: int = stat(COUNTER, "Steps that ended with requests waiting because max_num_seqs "
                                     "sequences were running.", 16)
    prefix_cache_queried_tokens: int = stat(COUNTER, "Prompt tokens looked up in the prefix cache at admissions "
                                            "to prefill.", 17)
    prefix_cache_hit_tokens: int = stat(COUNTER, "Of them, those found cached.", 18)
    busy_seconds: float = stat(GAUGE, "The engine's time in the window's steps: `seconds` without the idle gaps "
                                      "between them (their mean step is busy_seconds / num_steps).", 19)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens admitted to prefill whose KV was cached."""
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def preemption_rate(self) -> float:
        """Preemptions per entry into the running batch."""
        return self.num_preemptions / self.num_admissions if self.num_admissions else 0.0

    @property
    def mean_swap_blocks(self) -> float:
        """Blocks moved out per swap preemption."""
        return self.num_swapped_blocks_out / self.num_preemptions_swap if self.num_preemptions_swap else 0.0


class SpeculationCounts(typing.Protocol):
    """What EngineStats reads of speculative decoding's counts (the speculator's SpecStats,
    engine/spec_decode/speculator.py, which says what each is)."""

    num_checks: int
    num_proposed: int
    num_accepted: int
    num_emitted: int
    proposed_by_position: tuple[int, ...]
    accepted_by_position: tuple[int, ...]
    plain_steps_saved: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """An engine's load now and its work since start, as every worker exports them."""

    # Load now.
    num_running: int = stat(GAUGE, "Requests in the running batch.", 4, "baton_num_requests_running")
    num_waiting: int = stat(GAUGE, "Requests queued, not yet admitted.", 5, "baton_num_requests_waiting")
    num_swapped: int = stat(GAUGE, "Requests preempted to the CPU swap pool.", 6, "baton_num_requests_swapped")
    num_kv_handoffs_pending: int = stat(GAUGE, "Requests whose KV is held for a handoff (prefill) or arriving "
                                        "(decode).", 11, "baton_num_requests_kv_handoff")
    num_queued_prefill_tokens: int = stat(GAUGE, "Prompt tokens queued or mid-prefill, not yet computed.", 10,
                                          "baton_num_queued_prefill_tokens")
    oldest_queued_seconds: float = stat(GAUGE, "Seconds the longest-waiting request not yet admitted has waited "
                                        "(0: none waits).", 29, "baton_oldest_queued_seconds")
    num_kv_blocks_total: int = stat(GAUGE, "KV cache blocks in all.", 7, "baton_kv_cache_blocks_total")
    num_kv_blocks_used: int = stat(GAUGE, "KV cache blocks in use (running, held for a handoff, or being "
                                   "received).", 8, "baton_kv_cache_blocks_used")
    num_kv_blocks_free: int = stat(GAUGE, "KV cache blocks free.", 9, "baton_kv_cache_blocks_free")
    num_kv_blocks_fenced: int = stat(GAUGE, "KV cache blocks kept out of use after a transfer whose sender stopped "
                                     "answering mid-copy, until it is known to write no more.", 33,
                                     "baton_kv_cache_blocks_fenced")
    # Since start.
    num_steps: int = stat(COUNTER, "Engine steps run.", 20, "baton_engine_steps")
    num_tokens_scheduled_total: int = stat(COUNTER, "Tokens run through the model.", 45, "baton_scheduled_tokens")
    mean_seqs_per_step: float = stat(GAUGE, "Sequences per engine step since start.", 21)
    num_finished: int = stat(COUNTER, "Requests finished (any reason).", 23, "baton_engine_requests_finished")
    num_preemptions_recompute: int = stat(COUNTER, "Preemptions by recompute.", 12, "baton_preemptions",
                                          ("kind", "recompute"))
    num_preemptions_swap: int = stat(COUNTER, "Preemptions by swap.", 13, "baton_preemptions", ("kind", "swap"))
    # Prefix caching (off: all zero).
    prefix_caching: bool = stat(GAUGE, "Whether prefix caching is on.", 35, default=False)
    num_kv_blocks_cached: int = stat(GAUGE, "KV cache blocks in the prefix cache (held or not).", 36,
                                     "baton_kv_cache_blocks_cached")
    num_kv_blocks_evictable: int = stat(GAUGE, "Cached blocks held by nobody: free, their KV kept until the space "
                                        "is needed.", 37, "baton_kv_cache_blocks_evictable")
    num_kv_blocks_evicted: int = stat(COUNTER, "Cached KV blocks evicted for space.", 46,
                                      "baton_prefix_cache_evictions")
    # vLLM names the first two alike: their ratio over a window is the hit rate.
    prefix_cache_queried_tokens: int = stat(COUNTER, "Prompt tokens looked up in the prefix cache at admissions to "
                                            "prefill.", 38, "baton_prefix_cache_queries")
    prefix_cache_hit_tokens: int = stat(COUNTER, "Prompt tokens found in the prefix cache (not computed).", 39,
                                        "baton_prefix_cache_hits")
    prefix_cache_received_blocks: int = stat(COUNTER, "Prompt blocks of requests handed off to this worker "
                                             "(decode).", 40, "baton_prefix_cache_received_blocks")
    prefix_cache_reused_blocks: int = stat(COUNTER, "Prompt blocks of handed-off requests already held here: not "
                                           "transferred.", 41, "baton_prefix_cache_reused_blocks")
    # The prefix cache's host tier (engine/kv/host_tier.py; off: all zero).
    num_kv_offload_blocks_total: int = stat(GAUGE, "Host blocks of the prefix cache's host tier, besides swap's "
                                            "(0: none).", 56, "baton_kv_offload_blocks_total")
    num_kv_offload_blocks_cached: int = stat(GAUGE, "Blocks the host tier holds, by the hashes that name them on "
                                             "the device.", 57, "baton_kv_offload_blocks_cached")
    prefix_cache_host_hit_tokens: int = stat(COUNTER, "Of the prompt tokens found in the prefix cache, those copied "
                                             "back from the host tier.", 58,
                                             "baton_prefix_cache_host_hits")
    prefix_cache_host_reused_blocks: int = stat(COUNTER, "Of the handed-off prompt blocks held already, those copied "
                                                "back from the host tier.", 59,
                                                "baton_prefix_cache_host_reused_blocks")
    kv_offload_written_blocks: int = stat(COUNTER, "Device blocks written through to the host tier as they entered "
                                          "the prefix cache.", 60, "baton_kv_offload_written_blocks")
    kv_offload_reloaded_bytes: int = stat(COUNTER, "Bytes of KV copied from the host tier back to the device on "
                                          "hits.", 61, "baton_kv_offload_reloaded_bytes")
    kv_offload_reload_seconds: float = stat(COUNTER, "Seconds those copies took (on CUDA, timed on the device).", 64,
                                            "baton_kv_offload_reload_seconds")
    num_kv_offload_evicted: int = stat(COUNTER, "Host-tier blocks evicted for space (by the tier, or by swap "
                                       "preemption).", 62, "baton_kv_offload_evictions")
    kv_copy_bytes_per_s: float = stat(GAUGE, "Host-device KV copy bandwidth (swaps, the host tier's copies): "
                                      "measured, else a guess.", 63, "baton_kv_copy_bytes_per_second")
    num_kv_landed: int = stat(COUNTER, "Handed-off requests whose KV went into blocks set aside as they arrived.", 47,
                              "baton_kv_landed")
    # The step-time model (engine/runner/step_time.py), measured at start and refitted as it
    # serves; the gateway predicts waits with it. 0.0: not measured yet.
    decode_step_base_s: float = stat(GAUGE, "A decode step of n sequences of c context tokens in all takes "
                                     "decode_step_base_s + decode_step_per_seq_s * n + "
                                     "decode_step_per_context_token_s * c seconds (least squares over the recent "
                                     "decode-only steps): its fixed part.", 42, "baton_decode_step_base_seconds")
    decode_step_per_seq_s: float = stat(GAUGE, "Its part per sequence.", 43, "baton_decode_step_per_seq_seconds")
    decode_step_per_context_token_s: float = stat(GAUGE, "Its part per context token.", 65,
                                                  "baton_decode_step_per_context_token_seconds")
    prefill_s_per_token: float = stat(GAUGE, "Seconds a prompt token takes to prefill (moving average over steps "
                                      "that are mostly prefill).", 44, "baton_prefill_seconds_per_token")
    # Speculative decoding (engine/spec_decode; off: all zero, the per-position counts
    # empty). vLLM's vllm:spec_decode_* name the like.
    num_speculative_tokens: int = stat(GAUGE, "Most tokens a decoding row proposes a step (--num-speculative-tokens; "
                                       "0: speculative decoding off).", 48)
    spec_num_checks: int = stat(COUNTER, "Rows that checked proposals, one per row and step.", 49,
                                "baton_spec_decode_checks")
    spec_num_proposed: int = stat(COUNTER, "Proposed tokens checked by the model.", 50,
                                  "baton_spec_decode_proposed_tokens")
    spec_num_accepted: int = stat(COUNTER, "Proposed tokens accepted (the model's own sample agreed).", 51,
                                  "baton_spec_decode_accepted_tokens")
    spec_num_emitted: int = stat(COUNTER, "Tokens the checking rows emitted: the accepted proposals and one of the "
                                 "model's own per check.", 52, "baton_spec_decode_emitted_tokens")
    spec_check_cost_steps: float = stat(COUNTER, "What the checks cost, in decode steps (step-time model: one each, "
                                        "plus each proposal's share); emitted tokens over this is the speed-up.", 53,
                                        "baton_spec_decode_check_cost_steps")
    spec_proposed_by_position: tuple[int, ...] = stat(COUNTER, "Per position i (1..num_speculative_tokens): "
                                                      "checks that proposed an i-th token.", 54,
                                                      "baton_spec_decode_proposed_tokens_per_pos", default=(),
                                                      index_label="position")
    spec_accepted_by_position: tuple[int, ...] = stat(COUNTER, "Per position i: checks whose i-th proposed token "
                                                      "was accepted.", 55, "baton_spec_decode_accepted_tokens_per_pos",
                                                      default=(), index_label="position")

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of the proposed tokens accepted (0.0: none proposed)."""
        return self.spec_num_accepted / self.spec_num_proposed if self.spec_num_proposed else 0.0

    @property
    def spec_acceptance_by_position(self) -> tuple[float, ...]:
        """Per position: the share of the proposals there that were accepted."""
        return tuple(accepted / proposed if proposed else 0.0
                     for accepted, proposed in zip(self.spec_accepted_by_position, self.spec_proposed_by_position))

    def with_speculation(self, spec: SpeculationCounts) -> typing.Self:
        """This snapshot with the speculator's counts (SpecStats) as its spec_* fields."""
        return dataclasses.replace(
            self,
            num_speculative_tokens=len(spec.proposed_by_position),
            spec_num_checks=spec.num_checks,
            spec_num_proposed=spec.num_proposed,
            spec_num_accepted=spec.num_accepted,
            spec_num_emitted=spec.num_emitted,
            # Plain decoding takes a step a token: the checks cost what they emitted, less what they saved.
            spec_check_cost_steps=spec.num_emitted - spec.plain_steps_saved,
            spec_proposed_by_position=spec.proposed_by_position,
            spec_accepted_by_position=spec.accepted_by_position,
        )

    @property
    def spec_speedup(self) -> float:
        """Speculation's speed-up since start: the plain decode steps its emitted tokens would
        have taken over what its checks cost in decode steps, num_emitted / (num_emitted -
        plain_steps_saved) in the speculator's terms (1.0: break-even; 0.0: no check yet)."""
        return self.spec_num_emitted / self.spec_check_cost_steps if self.spec_check_cost_steps > 0 else 0.0
