"""Channels between Baton processes: a peer that comes back on its address is reached
again within about a second, however long it was down."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.cli.local import free_port
from baton.runtime.server import GrpcServer, open_channel

DOWN_S = 20.0  # long enough for gRPC's default backoff to have grown past 5 s


def test_a_peer_back_on_its_address_is_reached_within_2_s():
    async def scenario() -> float:
        address = f"127.0.0.1:{free_port()}"
        server = GrpcServer(address, [])
        await server.start()
        channel = open_channel(address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await server.server.stop(0)
            down_until = time.monotonic() + DOWN_S
            while time.monotonic() < down_until:  # the gateway's polls keep failing meanwhile
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
            server = GrpcServer(address, [])
            await server.start()
            back = time.monotonic()
            while True:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    return time.monotonic() - back
                except grpc.aio.AioRpcError:
                    assert time.monotonic() - back < 30, "the peer was never reached again"
                    await asyncio.sleep(0.1)
        finally:
            await channel.close()
            await server.server.stop(0)

    rejoined_after = asyncio.run(scenario())
    assert rejoined_after < 2.0, f"reached again {rejoined_after:.1f} s after it was back"
