"""What the prefill and decode workers share: settings, building and warming the engine,
model info and stats, and the process's serve-until-SIGTERM lifecycle."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import torch

from baton.runtime import tracing
from baton.wire.internal.v1 import worker_pb2
from baton.runtime.metrics import WorkerMetrics, engine_snapshot, serve_metrics
from baton.runtime.server import GrpcServer
from baton.wire.v1 import generation_pb2 as pb
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer import KvLayoutSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    """One worker process: where it listens, what it serves, how its engine is sized."""

    role: str  # "prefill" | "decode"
    listen: str = "127.0.0.1:0"
    # The address peers use to reach this worker; default: the listen address.
    advertise: str | None = None
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    engine: EngineConfig = field(default_factory=EngineConfig)
    # KV handoff.
    lease_s: float = 30.0  # prefill: held KV is freed if not pulled within this
    transfer_timeout_s: float = 30.0  # every rendezvous and block transfer
    verify_kv: bool = False  # compare per-block checksums on both sides of every transfer
    transfer_host: str = "127.0.0.1"  # decode: where it hosts the rendezvous store
    grace_s: float = 10.0  # SIGTERM: seconds in-flight requests get to finish
    metrics_port: int | None = None  # Prometheus /metrics on the listen host; None: off

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        for name in ("lease_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def engine_config(
    model: str,
    *,
    dtype: str = "float32",
    max_model_len: int | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    num_threads: int | None = None,
    attention_backend: str = "auto",
    preemption_mode: str = "auto",
    swap_space_bytes: int = 256 * 1024**2,
    seed: int = 0,
) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        cache=CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            swap_space_bytes=swap_space_bytes,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
        ),
        num_threads=num_threads,
        attention_backend=attention_backend,
        seed=seed,
    )


def build_engine(config: EngineConfig) -> LLMEngine:
    """Load the model and warm it up: one short request end to end (first-call costs:
    kernel builds, allocator growth, oneDNN primitive creation)."""
    engine = LLMEngine(config)
    engine.add_request([0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def model_info(engine: LLMEngine) -> pb.ModelInfo:
    tokenizer = engine.tokenizer
    return pb.ModelInfo(
        model=engine.model_name,
        max_context_length=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=list(engine.eos_token_ids),
        has_chat_template=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)),
    )


def kv_layout_spec(engine: LLMEngine) -> KvLayoutSpec:
    return KvLayoutSpec.from_kv_layout(engine.kv_layout)


def layout_to_pb(spec: KvLayoutSpec) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(
        num_layers=spec.num_layers,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
    )


def layout_from_pb(message: worker_pb2.KvLayout) -> KvLayoutSpec:
    return KvLayoutSpec(
        num_layers=message.num_layers,
        block_size=message.block_size,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        dtype=message.dtype,
    )


class WorkerBase:
    """The parts of a worker service that do not depend on its role.

    Registered with the server before the model loads (grpc needs every
    service before it starts); until `load` finishes, calls fail UNAVAILABLE.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.address = settings.listen
        self.llm: LLMEngine | None = None
        self.engine: AsyncEngine | None = None
        self._model_info: pb.ModelInfo | None = None
        self.metrics: WorkerMetrics | None = None  # set by load

    async def load(self, address: str) -> None:
        """Build and warm the engine off the event loop, then start its thread."""
        self.address = address
        llm = await asyncio.to_thread(build_engine, self.settings.engine)
        self.llm = llm
        self._model_info = model_info(llm)
        self.metrics = WorkerMetrics(self._model_info.model, self.settings.role)
        self.engine = AsyncEngine(llm, on_kv_receive=self._on_kv_receive,
                                  on_last_output=lambda output: self.metrics.record_timings(output.timings))
        self.engine.start()
        self.metrics.watch_engine(engine_snapshot(self.engine, asyncio.get_running_loop()))

    def _on_kv_receive(self, receive) -> None:
        raise AssertionError(f"{self.settings.role} worker got a KV receive")

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()

    async def _require_engine(self, context) -> AsyncEngine:
        import grpc

        if self.engine is None or not self.engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not ready (model loading or stopped)")
        return self.engine

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        await self._require_engine(context)
        return self._model_info

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        from baton.wire.convert import worker_stats_to_pb

        engine = self.engine
        if engine is None or not engine.is_alive:  # loading or stopped: answer, but not serving
            return worker_pb2.WorkerStats(worker_id=self.worker_id, role=self.settings.role, serving=False)
        stats = await engine.call(lambda llm: llm.get_metrics(with_queue_times=False))
        return worker_stats_to_pb(
            stats,
            worker_id=self.worker_id,
            role=self.settings.role,
            model=self._model_info.model,
            serving=engine.is_alive,
            max_num_seqs=self.settings.engine.scheduler.max_num_seqs,
            max_num_batched_tokens=self.settings.engine.scheduler.max_num_batched_tokens,
            kv_block_bytes=self.llm.kv_layout.bytes_per_block,
            **self.extra_stats(),
        )

    def extra_stats(self) -> dict:
        return {}

    # ----------------------------------------------------------------- tracing
    def _start_span(self, name: str, context, request_id: str, attributes: dict | None = None):
        """A SERVER span for one call, child of the caller's span (None: tracing off)."""
        if not tracing.enabled():
            return None
        return tracing.start_span(name, tracing.extract(context.invocation_metadata()), tracing.SERVER, {
            "baton.request_id": request_id,
            "baton.worker_id": self.worker_id,
            "gen_ai.request.model": self._model_info.model if self._model_info else "",
            **(attributes or {}),
        })

    def _observe(self, output, span) -> None:
        """A request's last output here: its timings onto its span (the metrics get them
        from the engine's on_last_output, read or not)."""
        timings = output.timings
        if timings is None:
            return
        if tracing.recording(span):
            if timings.queue_time is not None:
                span.set_attribute("baton.queue_time_s", timings.queue_time)
            if timings.prefill_time is not None:
                span.set_attribute("baton.prefill_time_s", timings.prefill_time)
            span.set_attribute("baton.num_preemptions", timings.num_preemptions)


async def run_worker(settings: WorkerSettings, service: WorkerBase, add_service, service_name: str) -> None:
    """Serve one worker until SIGTERM: listen first (health NOT_SERVING), then load and
    warm the model off the event loop, then turn SERVING."""
    server = GrpcServer(settings.listen, [service_name])
    add_service(service, server.server)
    await server.start()
    address = settings.advertise or server.address
    logger.info("%s worker %s listening on %s; loading %s", settings.role,
                settings.worker_id, server.address, settings.engine.model)
    await service.load(address)
    if settings.metrics_port is not None:
        host = settings.listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        port = serve_metrics(service.metrics.registry, settings.metrics_port, host)
        logger.info("%s worker %s metrics on port %d", settings.role, settings.worker_id, port)
    await server.set_serving(True)
    logger.info("%s worker %s serving on %s", settings.role, settings.worker_id, address)
    await server.serve_until_signal(service.stop, settings.grace_s)
