"""Conversions between protobuf messages and engine records, used only at the gRPC edge."""

from __future__ import annotations

from collections.abc import Sequence

from baton.wire.internal.v1 import worker_pb2
from baton.wire.v1 import generation_pb2 as pb
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
}
FINISH_REASON_NAMES = {value: name for name, value in _FINISH_REASONS.items()}


def sampling_params_from_pb(message: pb.SamplingParams, *, with_stop_strings: bool = True) -> SamplingParams:
    """Engine SamplingParams from the wire; unset optional fields take the defaults.

    Raises ValueError (with the engine's message) on out-of-range values.
    """
    defaults = SamplingParams()
    has = message.HasField
    return SamplingParams(
        temperature=message.temperature if has("temperature") else defaults.temperature,
        top_p=message.top_p if has("top_p") else defaults.top_p,
        top_k=message.top_k if has("top_k") else defaults.top_k,
        min_p=message.min_p if has("min_p") else defaults.min_p,
        seed=message.seed if has("seed") else None,
        repetition_penalty=(
            message.repetition_penalty if has("repetition_penalty") else defaults.repetition_penalty
        ),
        max_tokens=message.max_tokens if has("max_tokens") else defaults.max_tokens,
        min_tokens=message.min_tokens,
        stop=list(message.stop) if with_stop_strings else None,
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if has("logprobs") else None,
        include_stop_str_in_output=message.include_stop_str_in_output,
        skip_special_tokens=(
            message.skip_special_tokens if has("skip_special_tokens") else defaults.skip_special_tokens
        ),
    )


def finish_reason_to_pb(reason: str | None) -> int:
    """Engine finish reason ("stop", "length", None) as the wire enum."""
    return _FINISH_REASONS[reason]


def logprobs_to_pb(entries: Sequence[TokenLogprobs] | None) -> list[pb.TokenLogprob]:
    if not entries:
        return []
    return [
        pb.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top_logprobs],
        )
        for entry in entries
    ]


def worker_stats_to_pb(stats: SchedulerStats, **fields) -> worker_pb2.WorkerStats:
    """A worker's stats message: the scheduler's counters plus the worker's own `fields`."""
    return worker_pb2.WorkerStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_swapped=stats.num_swapped,
        num_kv_blocks_total=stats.num_kv_blocks_total,
        num_kv_blocks_used=stats.num_kv_blocks_used,
        num_kv_blocks_free=stats.num_kv_blocks_free,
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        num_kv_handoffs_pending=stats.num_held + stats.num_receiving,
        num_preemptions_recompute=stats.num_preemptions_recompute,
        num_preemptions_swap=stats.num_preemptions_swap,
        num_steps=stats.num_steps,
        mean_seqs_per_step=stats.mean_seqs_per_step,
        mean_queue_seconds=stats.mean_queue_time,
        num_finished=stats.num_finished,
        recent=recent_stats_to_pb(stats.recent),
        oldest_queued_seconds=stats.oldest_queued_time,
        **fields,
    )


def recent_stats_to_pb(recent) -> worker_pb2.RecentStats:
    return worker_pb2.RecentStats(
        window_seconds=recent.window_s,
        seconds=recent.seconds,
        seconds_since_last_step=min(recent.seconds_since_last_step, 1e12),
        num_steps=recent.num_steps,
        mean_batch_size=recent.mean_batch_size,
        mean_tokens_per_step=recent.mean_tokens_per_step,
        mean_kv_usage=recent.mean_kv_usage,
        mean_num_waiting=recent.mean_num_waiting,
        num_admissions=recent.num_admissions,
        num_preemptions_recompute=recent.num_preemptions_recompute,
        num_preemptions_swap=recent.num_preemptions_swap,
        num_swapped_blocks_out=recent.num_swapped_blocks_out,
        num_queued=recent.num_queued,
        mean_queue_seconds=recent.mean_queue_time,
        num_steps_kv_blocked=recent.num_steps_kv_blocked,
        num_steps_seq_capped=recent.num_steps_seq_capped,
    )
