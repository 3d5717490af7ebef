"""What every Baton gRPC process shares: a grpc.aio server with health and reflection,
uvloop, and a graceful shutdown on SIGTERM/SIGINT; channels to other Baton processes,
over TLS when configured (security.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from baton.runtime.security import TlsConfig
from baton.wire.status import lenient_handlers

logger = logging.getLogger(__name__)

# Prompts of token ids and KV handles are small; this only lifts grpc's 4 MB default
# so a long prompt or a 128k-token usage report never trips it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive, both sides of every channel between Baton processes. A client pings an
# idle channel every KEEPALIVE_TIME_MS so a dead peer is noticed within seconds, not
# at the next request. A server must accept those pings: by default it allows one
# every 5 minutes and only during a call, counts faster ones as abuse and, after two,
# closes the channel with GOAWAY "too_many_pings" (an idle decode-to-prefill channel
# was closed so about 30 s after its last handoff). So servers permit pings without
# calls, down to half the client's interval.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS (the name does not say "recv").
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    # The server pings its clients too (a gateway that vanished mid-stream), less often.
    ("grpc.keepalive_time_ms", 3 * KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]
# A peer that went away is dialled again at most RECONNECT_BACKOFF_MS after a failed
# attempt: gRPC's default backoff grows to 120 s, so a worker back after a restart
# rejoined only seconds to minutes later (docs/operations.md, Keepalive).
RECONNECT_BACKOFF_MS = 1_000
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 4),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def open_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to another Baton process, with the options above; with `tls`,
    the server is verified against its CA and our certificate goes as the client's."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.channel_options()
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def open_blocking_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel to a Baton process (the command line, tests), TLS as above."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + tls.channel_options()
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def listen_host(listen: str) -> str:
    """The host part of a listen address ("[::]:50051" -> "::"; ":50051" -> "0.0.0.0")."""
    return listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"


def install_uvloop() -> None:
    """Use uvloop for the process's event loops (falls back to asyncio's if absent)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        logger.warning("uvloop not installed; using the default asyncio loop")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# grpc.health.v1 answers for this service name whether the process is alive (its
# engine steps, its loop turns), apart from whether it takes requests: a Kubernetes
# liveness probe asks for it (restart the process), a readiness probe for "" (route
# to it). A worker loading its model or draining is alive but not ready.
LIVENESS_SERVICE = "liveness"


# Server reflection, as grpc.reflection.v1 (what grpcurl and current clients ask first) and
# as v1alpha (older ones). grpcio-reflection serves only v1alpha, whose messages are v1's
# byte for byte (v1 renamed the package, nothing else), so its servicer answers both.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both."""
    _add_reflection_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, REFLECTION_V1, reflection.SERVICE_NAME))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


def _add_reflection_v1_descriptor() -> None:
    """v1's descriptor (v1alpha's, renamed) in the default pool, so that reflection
    describes the v1 service it lists (`grpcurl describe`), as it does every other."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    alpha.ClearField("options")  # v1alpha's: its languages' packages, and deprecated
    v1 = text_format.Parse(text_format.MessageToString(alpha).replace(".grpc.reflection.v1alpha.",
                                                                      ".grpc.reflection.v1."),
                           descriptor_pb2.FileDescriptorProto())
    v1.name, v1.package = REFLECTION_V1_FILE, "grpc.reflection.v1"
    pool.AddSerializedFile(v1.SerializeToString())


class GrpcServer:
    """A grpc.aio server exposing `service_names`, grpc.health.v1 and server reflection;
    a request message over `max_receive_bytes` is refused (RESOURCE_EXHAUSTED).

    Readiness (health of "" and of every service) starts NOT_SERVING; call
    `set_serving(True)` once the model is loaded and warm. Liveness
    (LIVENESS_SERVICE) starts SERVING; `set_live(False)` when the process is stuck.
    With `credentials` the port speaks TLS only.
    """

    def __init__(self, address: str, service_names: Sequence[str], *,
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_receive_bytes: int = MAX_MESSAGE_BYTES,
                 health_port: int | None = None) -> None:
        options = [(key, max_receive_bytes if key == "grpc.max_receive_message_length" else value)
                   for key, value in SERVER_OPTIONS]
        self.server = grpc.aio.server(options=options, interceptors=tuple(interceptors) or None)
        self.service_names = tuple(service_names)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(
            self.server, (*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"could not listen on {address}")
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"
        # Health alone, in plaintext, on a port of its own: Kubernetes' gRPC probes speak no
        # TLS, so with TLS on the service port they would fail. It tells only what health
        # tells on the service port (the same servicer), to anyone who can reach it.
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
            if self.health_port == 0:
                raise OSError(f"could not listen on {host}:{health_port} (--health-port)")

    def add_service(self, servicer, service: ServiceDescriptor) -> None:
        """Serve `service` (its descriptor, from the generated module) with `servicer`, as
        the generated add_*Servicer_to_server does, except that a request whose bytes do
        not parse is answered INVALID_ARGUMENT, not UNKNOWN (baton.wire.status)."""
        handlers = lenient_handlers(servicer, service)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        self.server.add_registered_method_handlers(service.full_name, handlers)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.set_live(True)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        """Readiness: whether this process takes requests."""
        for name in ("", *self.service_names):
            await self.health.set(name, _health_status(serving))

    async def set_live(self, live: bool) -> None:
        """Liveness: whether this process works at all (False: restart it)."""
        await self.health.set(LIVENESS_SERVICE, _health_status(live))

    async def serve_until_signal(
        self, on_shutdown: Callable[[], Awaitable[None]], grace_s: float,
        failed: asyncio.Event | None = None, drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Serve until SIGTERM or SIGINT (or until `failed` is set), then shut down gracefully.

        Health turns NOT_SERVING (load balancers stop routing here). `drain`
        then stops the service taking requests and returns once those in flight
        are done, within `grace_s` seconds; the calls still running after that
        are cancelled (which aborts their requests: a gateway moves a decode
        worker's elsewhere), and `on_shutdown` frees the rest. Without `drain`,
        new calls are refused at once and in-flight ones get `grace_s`. A
        failed service gets no grace.
        """
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        waits = [asyncio.ensure_future(event.wait()) for event in (stop, failed) if event is not None]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        await self.health.enter_graceful_shutdown()
        if failed is not None and failed.is_set():
            logger.error("shutting down: the service failed")
            grace_s = 0.0
        elif drain is not None:
            logger.info("draining: %.1f s grace for in-flight requests", grace_s)
            try:
                async with asyncio.timeout(grace_s):
                    await drain()
            except TimeoutError:
                logger.warning("grace period over; cancelling the calls still in flight")
            grace_s = 0.0
        else:
            logger.info("shutting down: %.1f s grace for in-flight calls", grace_s)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await on_shutdown()
        logger.info("stopped")


def _health_status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
