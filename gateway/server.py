"""Run the gateway: listen at once (health NOT_SERVING), learn the model from the
workers, load its tokenizer, then serve baton.v1.Generation.

The API key guards every call on the public port but health and reflection.
GatewayAdmin (`baton status`, which lists every worker's address) is off unless
asked for: with --admin-listen on a port of its own with the workers' transport
(mutual TLS when there is a CA, the client certificate then the credential, else
the API key), or with `--admin-listen public` on the public port behind the key."""

from __future__ import annotations

import asyncio
import logging

from baton.runtime.metrics import GatewayMetrics, serve_metrics
from baton.runtime.security import ApiKeyInterceptor
from baton.runtime.server import GrpcServer, install_uvloop
from baton.runtime.settings import ADMIN_ON_PUBLIC_PORT, GatewaySettings
from baton.runtime.tracing import configure_tracing, shutdown_tracing
from baton.wire.internal.v1 import admin_pb2
from baton.wire.limits import MAX_REQUEST_BYTES
from baton.wire.v1 import generation_pb2
from engine.tokenizer import load_tokenizer
from gateway.admin import GatewayAdminService
from gateway.admission import GatewayAdmission, GatewayLimits
from gateway.service import GenerationService
from gateway.workers import POLL_INTERVAL_S, RoutingPolicy, WorkerPool

logger = logging.getLogger(__name__)

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE_NAME = GENERATION.full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"]
ADMIN_SERVICE_NAME = ADMIN.full_name


async def run_gateway(settings: GatewaySettings) -> None:
    pool = WorkerPool(list(settings.prefill_workers), list(settings.decode_workers),
                      RoutingPolicy.from_settings(settings), settings.tls, settings.stall_timeout_s,
                      settings.discovery_interval_s)
    admission = GatewayAdmission(pool, GatewayLimits.from_settings(settings))
    service = GenerationService(pool, max_migrations=settings.max_migrations, admission=admission,
                                max_messages_per_s=settings.max_stream_messages_per_s)
    admin = GatewayAdminService(pool, admission, service.latency)
    server, admin_server = _servers(settings)
    server.add_service(service, GENERATION)
    if admin_server is not None:
        admin_server.add_service(admin, ADMIN)
    http = _http_server(settings, service, pool)
    await _start_listening(settings, server, admin_server, http)
    tokenizer = await asyncio.to_thread(load_tokenizer, settings.tokenizer or settings.model,
                                        None if settings.tokenizer else settings.revision)
    info = await _wait_for_workers(settings, pool)
    if settings.metrics_port is not None:
        service.metrics = GatewayMetrics(info.model)
        port = serve_metrics(service.metrics.registry, settings.metrics_port, settings.listen)
        logger.info("gateway metrics on port %d", port)
    service.load(tokenizer, info)
    admin.model = info.model
    await server.set_serving(True)
    if admin_server not in (None, server):
        await admin_server.set_serving(True)
    logger.info("gateway serving %s on %s (prefill: %s; decode: %s)", info.model, server.address,
                ", ".join(settings.prefill_workers) or "none, colocated", ", ".join(settings.decode_workers))
    health = asyncio.create_task(_follow_decode_workers(pool, server))
    try:
        await server.serve_until_signal(pool.close, settings.grace_s, drain=service.drain)
    finally:
        health.cancel()
        if http is not None:
            await http.stop()
        if admin_server not in (None, server):
            await admin_server.server.stop(None)


async def _start_listening(settings: GatewaySettings, server, admin_server, http) -> None:
    """Open the gRPC port (and the admin and HTTP ports, with theirs), not serving yet."""
    tls = " (TLS)" if settings.tls is not None else ""
    await server.start()
    if http is not None:
        await http.start()
        logger.info("gateway OpenAI HTTP API on %s:%d%s", server.address.rsplit(":", 1)[0], http.port, tls)
    if admin_server not in (None, server):
        await admin_server.start()
        logger.info("gateway admin on %s", admin_server.address)
    elif admin_server is None:
        logger.info("gateway admin off (--admin-listen ADDR serves it, for baton status)")
    logger.info("gateway listening on %s%s%s; waiting for workers", server.address, tls,
                " (API key)" if settings.bearer_key else "")


async def _wait_for_workers(settings: GatewaySettings, pool: WorkerPool):
    """The served model's info, once a decode worker is up; TimeoutError (the process
    exits with it) if none is within --startup-timeout-s."""
    waiting_for = "any worker to answer GetModelInfo"
    try:
        async with asyncio.timeout(settings.startup_timeout_s):
            info = await pool.model_info()
            waiting_for = f"a decode worker to serve ({', '.join(settings.decode_workers)})"
            await pool.start()
    except TimeoutError:
        raise TimeoutError(f"gave up after {settings.startup_timeout_s:.0f} s waiting for {waiting_for}") from None
    return info


def _http_server(settings: GatewaySettings, service: GenerationService, pool: WorkerPool):
    """The OpenAI HTTP API (gateway/http), with --http-port; None without."""
    if settings.http_port is None:
        return None
    try:
        from gateway.http.app import create_app
        from gateway.http.server import HttpServer
    except ImportError as error:  # a host without the HTTP stack (the lent GPU machines): gRPC only
        logger.error("--http-port %d: the OpenAI HTTP API needs fastapi and uvicorn (%s); serving gRPC only",
                     settings.http_port, error)
        return None

    app = create_app(service, served_model_name=settings.served_model_name, api_key=settings.bearer_key,
                     ready=lambda: any(worker.routable for worker in pool.decode))
    host = settings.listen.rsplit(":", 1)[0].strip("[]")
    return HttpServer(app, host, settings.http_port, certfile=settings.tls_cert if settings.tls else None,
                      keyfile=settings.tls_key if settings.tls else None)


def _servers(settings: GatewaySettings) -> tuple[GrpcServer, GrpcServer | None]:
    """The public server, and GatewayAdmin's: none without --admin-listen (it lists every
    worker's address: not for whoever reaches the public port), the public one with
    --admin-listen public."""
    tls = settings.tls
    interceptors = [] if settings.bearer_key is None else [ApiKeyInterceptor(settings.bearer_key)]
    public = None if tls is None else tls.server_credentials(internal=False)
    if settings.admin_listen == ADMIN_ON_PUBLIC_PORT:
        server = GrpcServer(settings.listen, [SERVICE_NAME, ADMIN_SERVICE_NAME], credentials=public,
                            max_receive_bytes=MAX_REQUEST_BYTES, interceptors=interceptors,
                            health_port=settings.health_port)
        return server, server
    server = GrpcServer(settings.listen, [SERVICE_NAME], credentials=public, interceptors=interceptors,
                        max_receive_bytes=MAX_REQUEST_BYTES, health_port=settings.health_port)
    if settings.admin_listen is None:
        return server, None
    internal = None if tls is None else tls.server_credentials(internal=True)
    # A verified client certificate is the credential there; without a CA, the API key.
    mutual = tls is not None and tls.is_mutual
    return server, GrpcServer(settings.admin_listen, [ADMIN_SERVICE_NAME], credentials=internal,
                              interceptors=[] if mutual else interceptors)


async def _follow_decode_workers(pool: WorkerPool, server: GrpcServer) -> None:
    """The gateway's health follows its decode workers: NOT_SERVING while none is up
    (a load balancer then sends clients to another gateway), SERVING again when one is.
    (Once shutdown has begun, health stays NOT_SERVING whatever this sets.)"""
    serving = True
    while True:
        await asyncio.sleep(POLL_INTERVAL_S)
        any_up = any(worker.routable for worker in pool.decode)
        if any_up != serving:
            serving = any_up
            logger.warning("gateway %s: %s", "serving again" if serving else "NOT_SERVING: no decode worker is up",
                           ", ".join(worker.address for worker in pool.decode))
            await server.set_serving(serving)


def serve(settings: GatewaySettings) -> None:
    """The gateway process's entry point: uvloop, tracing, then serve until SIGTERM."""
    install_uvloop()
    configure_tracing("gateway")
    try:
        asyncio.run(run_gateway(settings))
    finally:
        shutdown_tracing()
