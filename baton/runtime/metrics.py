"""Prometheus metrics: every Baton process serves its own on an HTTP port.

Names start with `baton_` and carry one `model_name` label (the served model; vLLM's
name for it, so dashboards made for vLLM filter alike), so the gateway's and the
workers' series of one deployment line up. Every process also serves
prometheus_client's standard process, platform and GC collectors (`process_*`,
`python_info`, `python_gc_*`) and `baton_build_info` (its version, role, Python's and,
on the workers, torch's). What each process measures is what it sees:

- gateway: the client's view of a request: time to first token, time per output
  token, inter-token latency, end-to-end latency; prompt and generation tokens;
  finished requests by finish reason, and requests refused for overload; requests
  in flight by front end (admission's count, read at scrape time).
- workers: the engine's state, read at scrape time: every statistic
  engine/statistics.py declares with a metric name (requests running, waiting and
  swapped, KV blocks, preemptions by kind, steps, prefix caching, the step-time
  model, speculative decoding's proposals and acceptance, per position too), plus the KV
  cache's usage, the prefix cache's recent hit ratio and, when speculating, the acceptance
  ratio and speed-up; each request's queue time and prefill time, from the timings on
  its last output; and, on the
  transfer path, KV bytes, transfer time and failures, each with a `transport`
  label (ipc, gloo, nccl), and channels refused for want of a transport.

The worker's engine state is read by a collector that asks the engine thread for a
snapshot between steps (`AsyncEngine.call`), on the scrape's thread: a scrape never
runs on the event loop and never touches the engine while it steps.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import platform
from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from baton import version
from baton.runtime import latency
from baton.runtime.server import listen_host
from baton.wire.records import KvTransportStats
from engine import statistics
from engine.statistics import EngineStats

logger = logging.getLogger(__name__)

# Latency buckets (seconds), from a fast decode step on a GPU to a long queue on a CPU.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
REFUSAL_REASONS = ("concurrency", "queue_wait", "deadline", "worker")
FRONT_ENDS = ("grpc", "http")  # baton.v1.Generation, the OpenAI HTTP API (gateway/http)


def process_registry(model: str, role: str, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """`registry` (a new one if None) with what every process serves besides its own
    metrics: prometheus_client's process, platform and GC collectors (the ones its
    default registry holds; Baton serves a registry of its own per process) and
    baton_build_info."""
    registry = registry or CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    build = dict(version=version(), role=role, python_version=platform.python_version())
    if role != "gateway":  # the workers run torch; the gateway does not load it, and reports none
        build["torch_version"] = _torch_version()
    Info("baton_build", "Baton's version, the process's role, its Python's and (workers) torch's",
         ["model_name"], registry=registry).labels(model).info(build)
    return registry


def _torch_version() -> str:
    """torch's version by its package metadata (the module itself is not imported for it)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch built from source, say
        return "unknown"


class GatewayMetrics:
    """The client-side view of requests, recorded by the gateway as it streams."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.registry = process_registry(model, "gateway", registry)
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("baton_time_to_first_token_seconds", "Request arrival to its first token",
                              labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self.tpot = Histogram("baton_time_per_output_token_seconds",
                              "Per request: (end - first token) / (output tokens - 1)",
                              labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self.itl = Histogram("baton_inter_token_latency_seconds", "Time between two streamed tokens",
                             labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self.e2e = Histogram("baton_e2e_request_latency_seconds", "Request arrival to its last token",
                             labels, registry=r, buckets=_REQUEST_BUCKETS).labels(model)
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens of finished requests",
                                     labels, registry=r).labels(model)
        self.generation_tokens = Counter("baton_generation_tokens", "Tokens generated for clients",
                                         labels, registry=r).labels(model)
        received = Counter("baton_requests_received", "Requests received, by front end: grpc (baton.v1.Generation) "
                           "or http (the OpenAI API)", ["model_name", "front"], registry=r)
        self._received = {front: received.labels(model, front) for front in FRONT_ENDS}
        finished = Counter("baton_requests_finished", "Finished requests by finish reason",
                           ["model_name", "finish_reason"], registry=r)
        self.finished = {reason: finished.labels(model, reason) for reason in FINISH_REASONS}
        self.migrations = Counter("baton_request_migrations", "Requests moved off a lost worker (per move)",
                                  labels, registry=r).labels(model)
        refused = Counter("baton_requests_refused", "Requests refused at once, by reason: concurrency, queue_wait "
                          "and deadline (the gateway's admission), worker (a worker's own)", ["model_name", "reason"],
                          registry=r)
        self._refused = {reason: refused.labels(model, reason) for reason in REFUSAL_REASONS}
        self.deadline_misses = Counter("baton_deadline_misses", "Admitted requests that ended at their deadline",
                                       labels, registry=r).labels(model)
        self.within_deadline = Counter("baton_requests_within_deadline",
                                       "Requests with a deadline that finished within it (goodput)",
                                       labels, registry=r).labels(model)
        self.forecast_ttft = Histogram("baton_forecast_time_to_first_token_seconds",
                                       "Admission's forecast of a request's first token, from arrival "
                                       "(baton_time_to_first_token_seconds is what happened)",
                                       labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self.ttst = Histogram("baton_time_to_second_token_seconds", "Request arrival to its second token (the "
                              "handoff's, when its prompt was prefilled on a prefill worker)",
                              labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        phase = Histogram("baton_request_phase_seconds", "A request's time to its first and second tokens, by "
                          "phase (baton/runtime/latency.py)", ["model_name", "phase"], registry=r,
                          buckets=_LATENCY_BUCKETS)
        self._phases = {name: phase.labels(model, name) for name in latency.PHASE_NAMES}
        self._in_flight = Gauge("baton_requests_in_flight", "Requests admitted and not yet ended, by front end: "
                                "what --max-concurrent-requests bounds", ["model_name", "front"], registry=r)

    def watch_in_flight(self, count: Callable[[str], int]) -> None:
        """Read each front end's requests in flight from `count(front)` at every scrape (the
        gateway's admission counts them)."""
        for front in FRONT_ENDS:
            self._in_flight.labels(self.model, front).set_function(lambda front=front: count(front))

    def received(self, front: str) -> None:
        self._received[front].inc()

    def refuse(self, reason: str) -> None:
        self._refused[reason if reason in self._refused else "worker"].inc()

    def record_request(self, *, arrival: float, token_times: list[float], finished_at: float,
                       num_prompt_tokens: int, finish_reason: str, phases: dict[str, float] | None = None) -> None:
        """One finished request (times from time.monotonic()), and its phases."""
        for name, seconds in (phases or {}).items():
            self._phases[name].observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        self.finished[finish_reason if finish_reason in self.finished else "error"].inc()
        self.e2e.observe(finished_at - arrival)
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        for previous, current in zip(token_times, token_times[1:]):
            self.itl.observe(current - previous)
        if len(token_times) > 1:
            self.ttst.observe(token_times[1] - arrival)
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))


class WorkerMetrics:
    """A worker's engine state (read at scrape time) and its KV transfers."""

    def __init__(self, model: str, role: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.role = role
        self.registry = process_registry(model, role, registry)
        labels = ["model_name"]
        transfer_labels = ["model_name", "transport"]  # ipc, gloo, nccl; "none" for a pull that got no channel
        r = self.registry
        self.transfer_time = Histogram("baton_kv_transfer_seconds", "One KV handoff, on this side",
                                       transfer_labels, registry=r, buckets=_LATENCY_BUCKETS)
        self.transferred_bytes = Counter("baton_kv_transferred_bytes", "KV bytes sent or received",
                                         transfer_labels, registry=r)
        self.transfer_failures = Counter("baton_kv_transfer_failures", "KV handoffs that failed",
                                         transfer_labels, registry=r)
        self.channel_refusals = Counter("baton_kv_channel_refusals",
                                        "KV channels refused at open: no transport can join the two workers",
                                        labels, registry=r).labels(model)
        self.queue_time = Histogram("baton_request_queue_time_seconds",
                                    "Arrival at the engine to admission into the batch",
                                    labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self.prefill_time = Histogram("baton_request_prefill_time_seconds",
                                      "Admission to first token, for prompts prefilled here",
                                      labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model)
        self._engine_collector: _EngineCollector | None = None

    def watch_engine(self, snapshot: Callable[[], object]) -> None:
        """Report the engine's SchedulerStats from `snapshot()` at every scrape."""
        self._engine_collector = _EngineCollector(self.model, snapshot)
        self.registry.register(self._engine_collector)

    def record_timings(self, timings) -> None:
        """A request's RequestTimings, at its last output on this worker."""
        if timings.queue_time is not None:
            self.queue_time.observe(timings.queue_time)
        if timings.prefill_time is not None:
            self.prefill_time.observe(timings.prefill_time)

    def record_transfer(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.transferred_bytes.labels(self.model, transport).inc(num_bytes)
        self.transfer_time.labels(self.model, transport).observe(seconds)

    def record_transfer_failure(self, transport: str) -> None:
        self.transfer_failures.labels(self.model, transport or "none").inc()


class TransferTally:
    """A worker's KV transfers since start, in all and by transport (its WorkerStats),
    each also recorded in its Prometheus metrics. Used on the event loop only."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._by_transport: dict[str, list] = {}  # transport: [transfers, failures, bytes, seconds]
        self.num_transfers_verified = 0

    def done(self, transport: str, num_bytes: int, seconds: float, verified: bool = False) -> None:
        tally = self._tally(transport)
        tally[0] += 1
        tally[2] += num_bytes
        tally[3] += seconds
        self.num_transfers_verified += verified
        self.metrics.record_transfer(transport, num_bytes, seconds)

    def failed(self, transport: str) -> None:
        """A transfer failed (`transport` "": no channel could be had for it)."""
        self._tally(transport or "none")[1] += 1
        self.metrics.record_transfer_failure(transport)

    def _tally(self, transport: str) -> list:
        return self._by_transport.setdefault(transport, [0, 0, 0, 0.0])

    def counters(self) -> dict:
        """WorkerStats' transfer fields."""
        rows = self._by_transport.items()
        return dict(
            num_transfers=sum(t[0] for _, t in rows),
            num_transfer_failures=sum(t[1] for _, t in rows),
            num_transfers_verified=self.num_transfers_verified,
            num_transferred_bytes=sum(t[2] for _, t in rows),
            transfer_seconds=sum(t[3] for _, t in rows),
            kv_transports=tuple(KvTransportStats(name, *t) for name, t in sorted(rows)),
        )


class _EngineCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], object]) -> None:
        self.model = model
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        try:
            stats = self.snapshot()
        except Exception as error:  # engine stopped or busy past the timeout: report nothing
            logger.debug("no engine snapshot for a scrape: %r", error)
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name, spec in statistics.declared(EngineStats):
            if spec.metric is None:
                continue
            family = families.get(spec.metric)
            if family is None:
                kind = GaugeMetricFamily if spec.kind == statistics.GAUGE else CounterMetricFamily
                labels = ["model_name"] + ([spec.label[0]] if spec.label else [])
                labels += [spec.index_label] if spec.index_label else []
                family = families[spec.metric] = kind(spec.metric, spec.help.rstrip("."), labels=labels)
            label_values = [self.model] + ([spec.label[1]] if spec.label else [])
            if spec.index_label:  # a count per position, from 1
                for position, count in enumerate(getattr(stats, name), start=1):
                    family.add_metric([*label_values, str(position)], count)
            else:
                family.add_metric(label_values, getattr(stats, name))
        yield from families.values()
        # Ratios of the declared statistics, for dashboards that want them ready-made.
        usage = GaugeMetricFamily("baton_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                  labels=["model_name"])
        usage.add_metric([self.model], stats.num_kv_blocks_used / stats.num_kv_blocks_total
                         if stats.num_kv_blocks_total else 0.0)
        yield usage
        hits = GaugeMetricFamily("baton_prefix_cache_hit_ratio", "Prefix cache hits per query over the last minute "
                                 "of steps", labels=["model_name"])
        hits.add_metric([self.model], stats.recent.prefix_cache_hit_rate)
        yield hits
        if stats.num_speculative_tokens:  # speculative decoding on
            yield from _speculation_ratios(self.model, stats)


def _speculation_ratios(model: str, stats: EngineStats) -> Iterator:
    """Speculative decoding's acceptance and speed-up since start, ready-made (over a window:
    the ratios of the rates of the counters they divide)."""
    acceptance = GaugeMetricFamily("baton_spec_decode_acceptance_ratio", "Proposed tokens accepted per proposed "
                                   "token since start (baton_spec_decode_accepted_tokens over "
                                   "baton_spec_decode_proposed_tokens)", labels=["model_name"])
    acceptance.add_metric([model], stats.spec_acceptance_rate)
    yield acceptance
    speedup = GaugeMetricFamily("baton_spec_decode_speedup", "Speculative decoding's speed-up since start: the plain "
                                "decode steps its emitted tokens would have taken (one a token) over what its checks "
                                "cost in decode steps, by the step-time model: num_emitted / (num_emitted - "
                                "plain_steps_saved), baton_spec_decode_emitted_tokens over "
                                "baton_spec_decode_check_cost_steps (1: break-even; 0: no check yet)",
                                labels=["model_name"])
    speedup.add_metric([model], stats.spec_speedup)
    yield speedup


def engine_snapshot(engine, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> Callable[[], object]:
    """A callable for a scrape thread: the engine's SchedulerStats, taken between steps."""

    def snapshot() -> object:
        call = engine.call(lambda llm: llm.get_metrics(with_queue_times=False))
        return asyncio.run_coroutine_threadsafe(call, loop).result(timeout_s)

    return snapshot


def serve_metrics(registry: CollectorRegistry, port: int, listen: str) -> int:
    """Serve `registry` as Prometheus text on http://host:port/metrics from a daemon
    thread, on the host of the process's gRPC `listen` address; returns the port (port
    0: a free one)."""
    server, _ = start_http_server(port, addr=listen_host(listen), registry=registry)
    return server.server_port
