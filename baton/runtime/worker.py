"""What the prefill and decode workers share: building and warming the engine, model
info and stats, tracing of a call, and the process's serve-until-SIGTERM lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from baton.runtime import logs, tracing
from baton.runtime.addresses import advertise_address, normalize_address
from baton.runtime.admission import AdmissionLimits, AdmissionQueue, Overloaded
from baton.runtime.metrics import TransferTally, WorkerMetrics, engine_snapshot, serve_metrics
from baton.runtime.server import GrpcServer, install_uvloop
from baton.runtime.settings import WorkerSettings
from baton.wire import convert, stats_convert, status
from baton.wire.records import ErrorDetails, FieldError, ModelInfo, WorkerStats
from engine.async_engine import IDLE_WAIT_S, AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.envs import configure_process
from engine.outputs import KvReceive, RequestOutput
from engine.request import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from engine import statistics
from engine.scheduler import SchedulerStats
from engine.statistics import EngineStats
from engine.calibration import calibrate_step_time
from kvtransfer import KvEndpoint, KvLayoutSpec
from kvtransfer.endpoint import gpu_uuid, local_endpoint

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


def build_engine(config: EngineConfig) -> LLMEngine:
    """Load the model and warm it up: one short request end to end (first-call costs:
    kernel builds, allocator growth, oneDNN primitive creation); then, unless configured
    off, measure its step-time model (engine/runner/step_time.py), published before the first
    request. The engine is nobody else's yet: this thread is its only one."""
    engine = LLMEngine(config)
    engine.add_request([0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    if config.calibrate_step_time:
        calibrate_step_time(engine)
    return engine


def model_info(engine: LLMEngine) -> ModelInfo:
    tokenizer = engine.tokenizer
    return ModelInfo(
        model=engine.model_name,
        max_context_length=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=tuple(engine.eos_token_ids),
        has_chat_template=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)),
        load=engine.model_load,
    )


def worker_stats(stats: SchedulerStats, **fields) -> WorkerStats:
    """A worker's stats: its engine's, as engine/statistics.py declares them, plus the
    worker's own `fields`."""
    return WorkerStats(**statistics.values(stats, EngineStats), recent=stats.recent, **fields)


# A worker's prompt tokens waiting, by default: this many times what its KV cache holds.
QUEUED_CACHES = 4


def worker_limits(settings: WorkerSettings, num_kv_blocks: int, max_model_len: int) -> AdmissionLimits:
    """A worker's own bounds (unless configured): as many requests waiting as its batch
    holds, and prompt tokens waiting worth QUEUED_CACHES caches (at least one longest
    prompt). They are the backstop for several gateways, or a client calling the worker
    directly; one gateway's own limits are tighter, so that a decode worker does not
    refuse a request whose first token its client already has."""
    max_num_seqs = settings.engine.scheduler.max_num_seqs
    cache_tokens = num_kv_blocks * settings.engine.cache.block_size
    return AdmissionLimits(max_num_seqs + (settings.max_queued_requests or max_num_seqs),
                           settings.max_queued_tokens or max(QUEUED_CACHES * cache_tokens, max_model_len))


async def abort_invalid(context, error: ValueError, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    """End a call refused for what its request holds: `code` with the error's words and, for
    a FieldError, a google.rpc.BadRequest naming the field (as the gateway answers its
    clients). Raises, as context.abort does."""
    details = str(error)
    violations = ((error.field, error.description),) if isinstance(error, FieldError) else ()
    await context.abort(code, details, trailing_metadata=status.error_trailers(code, details, ErrorDetails(violations)))


async def abort_refused(context, error: ValueError) -> None:
    """End a Prefill or Decode call whose request was refused, as it was read (a FieldError)
    or by the engine (its add_request raised): as abort_invalid, the engine's
    InvalidRequestError naming its field by the path in the request message, and a prompt
    past the context OUT_OF_RANGE (as the gateway answers it). Raises, as context.abort does."""
    code = grpc.StatusCode.OUT_OF_RANGE if isinstance(error, PromptTooLongError) else grpc.StatusCode.INVALID_ARGUMENT
    field = convert.work_request_field(error.name, error.index) if isinstance(error, InvalidRequestError) else None
    if field is not None:
        error = FieldError(field, str(error))
    await abort_invalid(context, error, code)


def call_deadline(context) -> float | None:
    """The call's gRPC deadline, as time.monotonic() seconds (None: it has none). Read at
    the call's start: the gateway passes its client's deadline on to every worker call."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class WorkerBase:
    """The parts of a worker service that do not depend on its role.

    Registered with the server before the model loads (grpc needs every
    service before it starts); until `load` finishes, calls fail UNAVAILABLE.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.address = settings.listen
        self.llm_engine: LLMEngine | None = None  # the engine thread's; read only what never changes
        self.engine: AsyncEngine | None = None
        self.model_info: ModelInfo | None = None
        self.layout: KvLayoutSpec | None = None
        self.kv_endpoint: KvEndpoint | None = None  # where our cache lives, for choosing KV transports
        self.metrics: WorkerMetrics | None = None  # set by load
        self.transfers: TransferTally | None = None  # set by load
        self.admission: AdmissionQueue | None = None  # set by load
        # Set if the engine thread dies (a step raised): the worker then stops and exits
        # non-zero, so that a supervisor restarts it, instead of staying up unable to serve.
        self.failed = asyncio.Event()
        # SIGTERM: no new requests (GetStats says not serving, so gateways route
        # elsewhere), those in flight finish.
        self.draining = False

    async def load(self, address: str) -> None:
        """Build and warm the engine off the event loop, then start its thread."""
        self.address = address
        llm = await asyncio.to_thread(build_engine, self.settings.engine)
        self.llm_engine = llm
        self.model_info = model_info(llm)
        self.layout = KvLayoutSpec.from_kv_layout(llm.kv_layout)
        device = llm.kv_cache.blocks.device
        self.kv_endpoint = local_endpoint(device.type, self.settings.kv_transport,
                                          gpu_uuid(device) if device.type == "cuda" else "")
        self.metrics = WorkerMetrics(self.model_info.model, self.settings.role)
        self.transfers = TransferTally(self.metrics)
        self.admission = AdmissionQueue(worker_limits(self.settings, llm.kv_cache.num_blocks, llm.max_model_len))
        self.engine = AsyncEngine(llm, on_kv_receive=self._on_kv_receive,
                                  on_last_output=lambda output: self.metrics.record_timings(output.timings),
                                  on_failure=self._on_engine_failure)
        self.engine.start()
        self.metrics.watch_engine(engine_snapshot(self.engine, asyncio.get_running_loop()))

    def _on_engine_failure(self, error: BaseException) -> None:
        logger.error("%s worker %s: the engine failed (%r); stopping", self.settings.role, self.worker_id, error)
        self.failed.set()

    def _on_kv_receive(self, receive: KvReceive) -> None:
        raise AssertionError(f"{self.settings.role} worker got a KV receive")

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()

    async def _require_engine(self, context) -> AsyncEngine:
        """The engine, for a call that brings a request (UNAVAILABLE while the worker
        cannot take one: loading, draining, stopped or failed)."""
        if self.engine is None or not self.engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not ready (model loading or stopped)")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down)")
        return self.engine

    async def accept_call(self, context, request_id: str, num_prompt_tokens: int, attempt: int = 0) -> None:
        """Take a Prefill or Decode call's request on (the caller releases it when the
        call ends), or end the call: RESOURCE_EXHAUSTED with a RetryInfo beyond this
        worker's bounds, INVALID_ARGUMENT naming `request.request_id` if that id is in
        flight here already. Moved work (WorkRequest.attempt > 0: off a lost worker) is
        taken on past the bounds, and counts toward them: refusing it would lose a
        request the gateway already took on, and perhaps streamed tokens of."""
        try:
            self.admission.admit(request_id, num_prompt_tokens, is_exempt=attempt > 0)
        except Overloaded as refusal:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(refusal)
            await context.abort(code, message, trailing_metadata=status.error_trailers(
                code, message, ErrorDetails(retry_after_s=refusal.retry_after_s)))
        except ValueError as error:
            await abort_invalid(context, FieldError(convert.work_request_field("request_id"), str(error)))

    # ------------------------------------------------------------- lifecycle
    def num_in_flight(self) -> int:
        """Requests this worker still owes an answer: their streams are open (a prefill
        worker adds the KV waiting to be pulled)."""
        return self.engine.num_streams if self.engine is not None and self.engine.is_alive else 0

    async def drain(self) -> None:
        """Stop taking requests; return once those in flight are done (the caller bounds
        the wait)."""
        self.draining = True
        logger.info("%s worker %s draining: %d requests in flight", self.settings.role, self.worker_id,
                    self.num_in_flight())
        while self.num_in_flight():
            await asyncio.sleep(DRAIN_POLL_S)

    async def watch_engine_thread(self, server: GrpcServer) -> None:
        """Liveness follows the engine thread: NOT_SERVING (and an error logged) while it
        has not come round its loop for --stall-report-s seconds (a step or a command is
        stuck: restart the worker), SERVING again if it recovers."""
        limit_s = max(self.settings.stall_report_s, 2 * IDLE_WAIT_S)  # an idle thread comes round that often
        stalled = False
        while True:
            await asyncio.sleep(min(1.0, limit_s / 4))
            engine = self.engine
            silent_s = time.monotonic() - engine.heartbeat
            if (engine.is_alive and silent_s > limit_s) != stalled:
                stalled = not stalled
                if stalled:
                    logger.error("%s worker %s: the engine thread has not come round for %.0f s; "
                                 "liveness NOT_SERVING", self.settings.role, self.worker_id, silent_s)
                else:
                    logger.warning("%s worker %s: the engine thread is stepping again", self.settings.role,
                                   self.worker_id)
                await server.set_live(not stalled)

    async def GetModelInfo(self, request, context):
        await self._require_engine(context)
        return convert.model_info_to_pb(self.model_info)

    async def GetStats(self, request, context):
        return stats_convert.worker_stats_to_pb(await self.stats())

    async def stats(self) -> WorkerStats:
        """This worker's stats now; a worker still loading (or stopped) says it is not serving."""
        engine = self.engine
        if engine is None or not engine.is_alive:
            return WorkerStats(worker_id=self.worker_id, role=self.settings.role, serving=False)
        stats = await engine.call(lambda llm: llm.get_metrics(with_queue_times=False))
        scheduler = self.settings.engine.scheduler
        return worker_stats(
            stats,
            worker_id=self.worker_id,
            role=self.settings.role,
            model=self.model_info.model,
            serving=engine.is_alive and not self.draining,
            block_size=self.layout.block_size,
            kv_block_bytes=self.layout.bytes_per_block,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            kv_endpoint=self.kv_endpoint,
            **self.extra_stats(),
        )

    def extra_stats(self) -> dict:
        """The role's own counters, as WorkerStats fields."""
        return {}

    # ----------------------------------------------------------------- tracing
    def _start_span(self, name: str, context, request_id: str, attributes: dict | None = None):
        """A SERVER span for one call, child of the caller's span (None: tracing off); the
        call's log lines name the request and the span from here on (baton/runtime/logs.py)."""
        span = None
        if tracing.enabled():
            span = tracing.start_span(name, tracing.extract(context.invocation_metadata()), tracing.SERVER, {
                "baton.request_id": request_id,
                "baton.worker_id": self.worker_id,
                "gen_ai.request.model": self.model_info.model if self.model_info else "",
                **(attributes or {}),
            })
        logs.bind_request(request_id, span)
        logger.debug("%s call for request %s", name, request_id)
        return span

    @staticmethod
    def _observe(output: RequestOutput, span) -> None:
        """A request's last output here: its timings onto its span (the metrics get them
        from the engine's on_last_output, read or not)."""
        if output.timings is not None and tracing.recording(span):
            tracing.set_timings(span, output.timings)


async def run_worker(settings: WorkerSettings, service: WorkerBase, descriptor: ServiceDescriptor) -> int:
    """Serve one worker until SIGTERM: listen first (health NOT_SERVING), then load and
    warm the model off the event loop, then turn SERVING. Returns the process's exit
    code: 0 after SIGTERM, 1 if the engine failed."""
    # Workers are internal: mTLS with a CA (security.py), plaintext only with no TLS at all.
    credentials = None if settings.tls is None else settings.tls.server_credentials(internal=True)
    server = GrpcServer(settings.listen, [descriptor.full_name], credentials=credentials,
                        health_port=settings.health_port)
    server.add_service(service, descriptor)
    await server.start()
    address = advertise_address(server.address, settings.advertise)  # ValueError: nothing to advertise
    if address != normalize_address(server.address):
        logger.info("%s worker %s advertises %s", settings.role, settings.worker_id, address)
    check_kv_ports(settings.kv_ports)
    logger.info("%s worker %s listening on %s; loading %s", settings.role,
                settings.worker_id, server.address, settings.model)
    await service.load(address)
    if settings.metrics_port is not None:
        port = serve_metrics(service.metrics.registry, settings.metrics_port, settings.listen)
        logger.info("%s worker %s metrics on port %d", settings.role, settings.worker_id, port)
    await server.set_serving(True)
    logger.info("%s worker %s serving on %s", settings.role, settings.worker_id, address)
    watchdog = asyncio.create_task(service.watch_engine_thread(server))
    try:
        await server.serve_until_signal(service.stop, settings.grace_s, service.failed, service.drain)
    finally:
        watchdog.cancel()
    return 1 if service.failed.is_set() else 0


def check_kv_ports(ports: tuple[int, int] | None) -> None:
    """Warn when `--kv-ports` is set but this network namespace's ephemeral ports (where
    Gloo and NCCL listen: they take no port range) fall outside it: a firewall open to
    those ports only would stop every cross-host transfer."""
    if ports is None:
        return
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(part) for part in file.read().split())
    except (OSError, ValueError):
        return
    if not ports[0] <= low <= high <= ports[1]:
        logger.warning("--kv-ports %d-%d: the KV rendezvous listens there, but Gloo and NCCL take ephemeral "
                       "ports, %d-%d here; set net.ipv4.ip_local_port_range to within %d-%d (a pod's "
                       "securityContext.sysctls) or open those too", ports[0], ports[1], low, high, *ports)


def serve_worker(settings: WorkerSettings, service: WorkerBase, descriptor: ServiceDescriptor) -> int:
    """A worker process's entry point: set up the process (its cores, torch threads, huge pages for
    the cache and weights, uvloop, tracing), then serve until SIGTERM; the exit code."""
    configure_process(settings.num_threads, settings.cpus)
    install_uvloop()
    tracing.configure_tracing(f"{settings.role}-worker", settings.worker_id)
    try:
        return asyncio.run(run_worker(settings, service, descriptor))
    finally:
        tracing.shutdown_tracing()
