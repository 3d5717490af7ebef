"""`baton status`: each worker's health, load and recent scheduling, then plain-language
findings about what holds the deployment back and what to change.

The figures come from the gateway (GatewayAdmin.GetDeploymentStatus), which asks
every worker for its stats at that moment. "Recent" figures cover a worker's last
minute of engine steps; steps happen only while there is work, so a worker that has
been idle for a minute shows none.

What is diagnosed, per worker (thresholds below):

- unreachable, not serving, or serving but not routed to by the gateway;
- batch held small by memory pressure: the batch stays under half of
  max_num_seqs while requests wait or are preempted, and the KV cache is
  nearly full or most steps leave requests waiting for blocks;
- waiting requests not admitted although KV blocks are not the limit;
- a high preemption rate (preemptions per entry into the batch), with the mean
  swap size;
- queue time (arrival to admission) above the given SLO: the mean of recently
  admitted requests, or the age of the oldest request still waiting;
- failing KV transfers and expiring KV leases.

A decode worker that speculates (--speculative) also shows its acceptance rate, in all
and by position, and the speed-up it earns.

And for the deployment: the gateway's admission, and its latest requests' times to
first and second token by phase (baton/runtime/latency.py), naming the phase with the
largest share of the time from the first token to the second, and what shortens it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import grpc

from baton.cli.client import GatewayConnection
from baton.runtime.clients import GatewayAdminClient
from baton.runtime.latency import PHASE_ADVICE
from baton.runtime.settings import add_flags, from_args
from baton.wire import stats_convert
from baton.wire.records import AdmissionStatus, DeploymentStatus, LatencyStatus, WorkerStats, WorkerStatus

# Memory pressure: the mean share of KV blocks in use.
KV_PRESSURE_USAGE = 0.9
# A batch under this share of max_num_seqs is small (if requests are waiting).
SMALL_BATCH_SHARE = 0.5
# Preemptions per entry into the running batch above this are high.
HIGH_PREEMPTION_RATE = 0.1
# Requests waiting on average, at least, before "not admitted" is reported.
MIN_MEAN_WAITING = 0.5
# "Not admitted" is about other limits than KV: blocks were short in at most this share of steps.
RARELY = 0.1


@dataclass(frozen=True)
class Finding:
    worker: str
    problem: str
    detail: str
    advice: str

    def __str__(self) -> str:
        return f"{self.worker}: {self.problem}. {self.detail}.\n    -> {self.advice}."


def worker_name(status: WorkerStatus) -> str:
    return status.stats.worker_id if status.stats is not None and status.stats.worker_id else status.address


def diagnose(status: WorkerStatus, queue_slo_s: float) -> list[Finding]:
    """What is wrong with one worker, in words, each with what to change."""
    name = worker_name(status)
    if not status.reachable or status.stats is None:
        return [Finding(name, f"{status.role} worker unreachable", status.error or "no answer",
                        "check that the process runs and listens at this address; the gateway routes "
                        "around it meanwhile")]
    stats = status.stats
    findings = []
    if not stats.serving:
        findings.append(Finding(name, "not serving", "it is loading its model or shutting down",
                                "wait for it to load; if it stays so, read its log"))
    elif not status.in_rotation:
        findings.append(Finding(name, "serving but not routed to",
                                "the gateway's last poll of it failed, or came before it was serving",
                                "it rejoins at the gateway's next good poll (every 0.1 s); if it stays out, "
                                "read the gateway's log for why its polls fail"))
    findings += _scheduling(name, stats, queue_slo_s)
    if stats.num_transfer_failures:
        total = stats.num_transfers + stats.num_transfer_failures
        findings.append(Finding(
            name, "KV transfers failing",
            f"{stats.num_transfer_failures} of {total} KV transfers failed since start",
            "check the link between the workers and --transfer-timeout-s; a failed handoff is "
            "prefilled again on the decode worker, which costs it a prefill",
        ))
    if stats.kv_channel_refusal:
        findings.append(Finding(
            name, "KV channel refused",
            f"no transport could join it to a peer: {stats.kv_channel_refusal}",
            "give both workers the same --kv-transport, or auto; ipc needs them on one host, nccl on two GPUs, "
            "gloo CPU caches. Meanwhile every prompt handed between them is prefilled again on the decode worker",
        ))
    if stats.num_kv_blocks_fenced:
        findings.append(Finding(
            name, "KV blocks fenced",
            f"{stats.num_kv_blocks_fenced} KV blocks are kept out of use: a prefill worker stopped answering in "
            "the middle of copying into them, and may still write",
            "they return when that prefill worker answers or exits: find it (its log says it stalled) and "
            "restart it",
        ))
    if stats.num_leases_expired:
        findings.append(Finding(
            name, "KV leases expiring",
            f"{stats.num_leases_expired} prefilled prompts were dropped unpulled since start",
            "decode workers pull too late: add decode workers, or raise --lease-s",
        ))
    return findings


def _scheduling(name: str, stats: WorkerStats, queue_slo_s: float) -> list[Finding]:
    recent = stats.recent
    if recent is None or recent.num_steps == 0:
        return []
    findings = []
    max_seqs = stats.max_num_seqs or 1
    small = recent.mean_batch_size < SMALL_BATCH_SHARE * max_seqs
    preemptions = recent.num_preemptions_recompute + recent.num_preemptions_swap
    short_of_kv = recent.mean_num_waiting > 0 or preemptions > 0 or recent.num_steps_kv_blocked > 0
    blocked_share = recent.num_steps_kv_blocked / recent.num_steps
    if small and short_of_kv and (recent.mean_kv_usage >= KV_PRESSURE_USAGE or blocked_share >= 0.5):
        advice = ("give the KV cache more memory (--kv-cache-memory or --num-kv-blocks), lower --max-model-len "
                  "so requests grow less, or add a worker")
        if stats.role == "prefill":
            advice = (f"a prefilled prompt keeps its blocks until a decode worker pulls them "
                      f"({stats.num_kv_handoffs_pending} waiting now): add decode workers, or give the KV cache "
                      f"more memory (--kv-cache-memory or --num-kv-blocks)")
        findings.append(Finding(
            name, "batch held small by memory pressure",
            f"the batch averaged {recent.mean_batch_size:.1f} of {stats.max_num_seqs} sequences while "
            f"{recent.mean_num_waiting:.1f} requests waited on average; {recent.num_steps_kv_blocked} of "
            f"{recent.num_steps} steps left requests waiting for KV blocks, with the cache "
            f"{recent.mean_kv_usage:.0%} full on average (a request is admitted only when its prompt plus "
            f"room to grow fits, and preempted requests come back first)",
            advice,
        ))
    elif small and recent.mean_num_waiting >= MIN_MEAN_WAITING and blocked_share <= RARELY:
        findings.append(Finding(
            name, "waiting requests not admitted",
            f"{recent.mean_num_waiting:.1f} requests waited on average while the batch averaged "
            f"{recent.mean_batch_size:.1f} of {stats.max_num_seqs} sequences, and KV blocks were short in only "
            f"{recent.num_steps_kv_blocked} of {recent.num_steps} steps (the cache was "
            f"{recent.mean_kv_usage:.0%} full on average)",
            f"the step's token budget (--max-num-batched-tokens {stats.max_num_batched_tokens}) goes to "
            f"running requests and prefill chunks before newcomers: raise it",
        ))
    if recent.num_admissions and preemptions / recent.num_admissions > HIGH_PREEMPTION_RATE:
        detail = (f"{preemptions / recent.num_admissions:.0%} of entries into the batch ended in a preemption "
                  f"({preemptions} in {recent.num_steps} steps: {recent.num_preemptions_recompute} by recompute, "
                  f"{recent.num_preemptions_swap} by swap)")
        if recent.num_preemptions_swap:
            blocks = recent.num_swapped_blocks_out / recent.num_preemptions_swap
            detail += (f"; the average swap moved {blocks:.1f} blocks "
                       f"({blocks * stats.kv_block_bytes / 2**20:.2f} MiB) to the CPU and back")
        findings.append(Finding(
            name, "high preemption rate", detail,
            "each preemption recomputes or moves KV: give the KV cache more memory, lower --max-num-seqs so "
            "fewer sequences compete for blocks, or shorten --max-model-len",
        ))
    admitted_late = recent.num_queued and recent.mean_queue_seconds > queue_slo_s
    if admitted_late or stats.oldest_queued_seconds > queue_slo_s:
        findings.append(Finding(
            name, "queue time above the SLO",
            f"requests admitted recently waited {recent.mean_queue_seconds * 1e3:.0f} ms on average from arrival "
            f"to admission ({recent.num_queued} requests), and the oldest still waiting has waited "
            f"{stats.oldest_queued_seconds * 1e3:.0f} ms (SLO {queue_slo_s * 1e3:.0f} ms)",
            "add workers for this load, or lower --max-num-batched-tokens / --max-num-seqs to trade "
            "throughput for latency",
        ))
    return findings


# ------------------------------------------------------------------ report
def diagnose_admission(admission: AdmissionStatus | None) -> list[Finding]:
    """What the gateway's admission says is wrong: mispredictions, and refusals."""
    if admission is None:
        return []
    findings = []
    if admission.num_deadline_misses:
        findings.append(Finding(
            "gateway", "deadlines missed after admission",
            f"{admission.num_deadline_misses} admitted requests ended at their deadline (forecast first token "
            f"{admission.mean_forecast_ttft_s:.2f} s mean, observed {admission.mean_observed_ttft_s:.2f} s)",
            "each is a forecast that failed: compare the workers' recent step times with their load, and look for "
            "a worker slowed by another process or outputs longer than the requests' history",
        ))
    refused = admission.num_refused_concurrency + admission.num_refused_queue_wait + admission.num_refused_deadline
    if refused:
        findings.append(Finding(
            "gateway", "requests refused",
            f"{refused} of {refused + admission.num_admitted} requests refused since start "
            f"({admission.num_refused_concurrency} at the concurrency bound, {admission.num_refused_queue_wait} "
            f"over the {admission.max_queue_wait_s:g} s queue wait, {admission.num_refused_deadline} for their "
            "deadlines)",
            "add workers (prefill workers for queue wait, decode workers for concurrency and deadlines), or "
            "raise --max-queue-wait-s if clients would rather wait",
        ))
    return findings


def _render_admission(admission: AdmissionStatus) -> list[str]:
    limit = admission.max_concurrent_requests or "unknown"
    refused = (f"{admission.num_refused_concurrency} concurrency, {admission.num_refused_queue_wait} queue wait, "
               f"{admission.num_refused_deadline} deadline"
               if admission.num_refused_concurrency + admission.num_refused_queue_wait
               + admission.num_refused_deadline else "none")
    lines = [
        f"gateway admission  {admission.num_in_flight} in flight (limit {limit}), {admission.num_admitted} "
        f"admitted since start",
        f"  refused     {refused}",
        f"  deadlines   {admission.num_met_deadlines} met, {admission.num_deadline_misses} missed after admission",
    ]
    if not admission.forecast_known:
        lines.append("  forecast    none yet: no worker has published its step times")
    else:
        line = (f"  forecast    a first token now in {admission.forecast_queue_wait_s:.2f} s "
                f"(limit {admission.max_queue_wait_s:g} s)")
        if admission.mean_observed_ttft_s:
            line += (f"; recent first tokens {admission.mean_forecast_ttft_s:.2f} s forecast, "
                     f"{admission.mean_observed_ttft_s:.2f} s observed (mean)")
        lines.append(line)
        lines.append(f"  decode      {admission.decode_step_base_s * 1e3:.1f} ms + "
                     f"{admission.decode_step_per_seq_s * 1e3:.2f} ms a sequence + "
                     f"{admission.decode_step_per_context_token_s * 1e6:.2f} us a context token a step, "
                     f"x{admission.decode_scale:.2f} as finished requests ran")
    return lines


def render(status: DeploymentStatus, findings: list[Finding]) -> str:
    lines = [f"model: {status.model}", ""]
    if status.admission is not None:
        lines += _render_admission(status.admission)
        lines.append("")
    if status.latency is not None and status.latency.num_requests:
        lines += _render_latency(status.latency)
        lines.append("")
    for worker in status.workers:
        lines += _render_worker(worker)
        lines.append("")
    if findings:
        lines.append("findings:")
        lines += [f"  - {finding}" for finding in findings]
    else:
        lines.append("findings: none; every worker looks healthy.")
    return "\n".join(lines)


def _render_worker(worker: WorkerStatus) -> list[str]:
    name = worker_name(worker)
    if not worker.reachable or worker.stats is None:
        return [f"{name}  {worker.role}  {worker.address}  UNREACHABLE ({worker.error})"]
    stats = worker.stats
    recent = stats.recent
    health = "NOT SERVING" if not stats.serving else "SERVING" if worker.in_rotation else "SERVING, not routed to"
    usage = stats.num_kv_blocks_used / stats.num_kv_blocks_total if stats.num_kv_blocks_total else 0.0
    lines = [
        f"{name}  {worker.role}  {worker.address}  {health}",
        f"  requests    running {stats.num_running}, waiting {stats.num_waiting}, swapped {stats.num_swapped}, "
        f"KV handoffs pending {stats.num_kv_handoffs_pending}",
        f"  KV cache    {usage:.0%} used now ({stats.num_kv_blocks_used}/{stats.num_kv_blocks_total} blocks)",
    ]
    if recent is not None and recent.num_steps:
        preemptions = recent.num_preemptions_recompute + recent.num_preemptions_swap
        rate = preemptions / recent.num_admissions if recent.num_admissions else 0.0
        lines += [
            f"  recent      {recent.num_steps} steps over {recent.seconds:.1f} s, the last "
            f"{recent.seconds_since_last_step:.1f} s ago",
            f"  KV usage    {recent.mean_kv_usage:.0%} mean",
            f"  batch       {recent.mean_batch_size:.1f} sequences per step (max {stats.max_num_seqs}), "
            f"{recent.mean_tokens_per_step:.0f} tokens per step, {recent.mean_num_waiting:.1f} waiting",
            f"  preemption  {rate:.0%} of {recent.num_admissions} entries into the batch "
            f"({recent.num_preemptions_recompute} recompute, {recent.num_preemptions_swap} swap)",
            f"  queue time  {recent.mean_queue_seconds * 1e3:.0f} ms mean over {recent.num_queued} requests, "
            f"oldest waiting {stats.oldest_queued_seconds * 1e3:.0f} ms",
        ]
    else:
        window = f" in the last {recent.window_seconds:.0f} s" if recent is not None else ""
        lines.append(f"  recent      idle: no steps{window}")
    lines.append(_prefix_cache_line(stats))
    if stats.num_kv_offload_blocks_total:
        lines.append(_host_tier_line(stats))
    if stats.num_speculative_tokens:
        lines.append(_speculation_line(stats))
    for transport in stats.kv_transports:
        rate = (transport.num_transferred_bytes / transport.transfer_seconds / 1e9
                if transport.transfer_seconds > 0 else 0.0)
        name = transport.transport if transport.transport != "none" else "no channel"
        lines.append(f"  KV {name:<8} {transport.num_transfers} transfers, {transport.num_failures} failed, "
                     f"{transport.num_transferred_bytes / 2**20:.1f} MiB at {rate:.2f} GB/s")
    return lines


def _prefix_cache_line(stats: WorkerStats) -> str:
    """Prefix caching: the hit rate since start and over the recent window, what it holds,
    and (decode) the handed-off blocks it did not need moved."""
    if not stats.prefix_caching:
        return "  prefix      caching off"
    recent = stats.recent
    line = (f"  prefix      {stats.prefix_cache_hit_rate:.0%} of prompt tokens cached since start "
            f"({stats.prefix_cache_hit_tokens} of {stats.prefix_cache_queried_tokens})")
    if recent is not None and recent.prefix_cache_queried_tokens:
        line += f", {recent.prefix_cache_hit_rate:.0%} recently"
    line += f"; {stats.num_kv_blocks_cached} blocks cached, {stats.num_kv_blocks_evictable} of them unused"
    if stats.prefix_cache_received_blocks:
        line += (f"; {stats.prefix_cache_reused_blocks} of {stats.prefix_cache_received_blocks} handed-off "
                 "prompt blocks held already")
    return line


def _host_tier_line(stats: WorkerStats) -> str:
    """The prefix cache's host tier, since start: hits, what it holds, copies and evictions."""
    line = (f"  host tier   {stats.prefix_cache_host_hit_tokens} prompt tokens found there"
            f" ({stats.kv_offload_reloaded_bytes / 2**20:.1f} MiB copied back"
            f" in {stats.kv_offload_reload_seconds:.2f} s)")
    if stats.prefix_cache_host_reused_blocks:
        line += f", {stats.prefix_cache_host_reused_blocks} handed-off blocks"
    return line + (f"; {stats.num_kv_offload_blocks_cached} of {stats.num_kv_offload_blocks_total} host blocks "
                   f"cached, {stats.kv_offload_written_blocks} written, {stats.num_kv_offload_evicted} evicted")


def _speculation_line(stats: WorkerStats) -> str:
    """Speculative decoding, since start: the share of proposed tokens accepted, in all and
    by position, and the speed-up (emitted tokens over what the checks cost in decode steps)."""
    line = f"  speculation up to {stats.num_speculative_tokens} proposed tokens a row and step"
    if not stats.spec_num_checks:
        return line + "; none checked yet"
    by_position = " ".join(f"{rate:.0%}" for rate in stats.spec_acceptance_by_position)
    return (f"{line}: {stats.spec_acceptance_rate:.0%} accepted ({stats.spec_num_accepted} of "
            f"{stats.spec_num_proposed}; by position {by_position}), {stats.spec_num_emitted} tokens in "
            f"{stats.spec_num_checks} checks, {stats.spec_speedup:.2f}x plain decoding's speed")


def _render_latency(latency: LatencyStatus) -> list[str]:
    ms = 1e3
    phases = ", ".join(f"{p.phase} {p.p50_s * ms:.0f}" for p in latency.phases)
    lines = [f"latency     over the gateway's last {latency.num_requests} requests: first token p50 "
             f"{latency.ttft_p50_s * ms:.0f} ms (p90 {latency.ttft_p90_s * ms:.0f}), second token p50 "
             f"{latency.ttst_p50_s * ms:.0f} ms (p90 {latency.ttst_p90_s * ms:.0f})",
             f"  phases    p50 ms: {phases}"]
    if latency.largest:
        lines.append(f"  largest   from the first token to the second: {latency.largest}; "
                     f"{PHASE_ADVICE.get(latency.largest, '')}")
    return lines


def to_json(status: DeploymentStatus, findings: list[Finding]) -> str:
    latency = status.latency
    largest = None
    if latency is not None and latency.largest:
        largest = {"phase": latency.largest, "advice": PHASE_ADVICE.get(latency.largest, "")}
    return json.dumps({"status": stats_convert.deployment_status_to_json(status),
                       "findings": [asdict(finding) for finding in findings],
                       "largest_second_token_phase": largest}, indent=2)


def add_status_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GatewayConnection)  # --gateway: the gateway's --admin-listen address if it has one
    parser.add_argument("--queue-slo-ms", type=float, default=1000.0,
                        help="report mean queue times (arrival to admission) above this (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the status and findings as JSON")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="(default: %(default)s)")


def status_command(args: argparse.Namespace) -> int:
    """`baton status`: print the deployment's status and findings; 1 if the gateway
    cannot be reached."""
    connection = from_args(GatewayConnection, args)
    with connection.open_channel() as channel:
        try:
            client = GatewayAdminClient(channel, connection.bearer_key)
            status = client.get_deployment_status(timeout=args.timeout_s)
        except grpc.RpcError as error:
            hint = ""
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # a public port: GatewayAdmin is not there
                hint = ("; GatewayAdmin is served on the gateway's --admin-listen address (baton up: "
                        "--admin-port), not on its public port")
            print(f"baton status: gateway {connection.gateway}: {error.code().name}: {error.details()}{hint}",
                  file=sys.stderr)
            return 1
    slo_s = args.queue_slo_ms / 1e3
    findings = [finding for worker in status.workers for finding in diagnose(worker, slo_s)]
    findings += diagnose_admission(status.admission)
    print(to_json(status, findings) if args.json else render(status, findings))
    return 0
