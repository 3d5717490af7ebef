"""Error details survive the wire: a real grpc.aio server aborts with them, a client reads them."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_status import rpc_status

from baton.wire import status
from baton.wire.records import ErrorDetails


def test_details_round_trip_through_trailers():
    details = ErrorDetails((("params.temperature", "must be finite"), ("messages[1].role", "unknown")), 0.25)
    trailers = status.error_trailers(grpc.StatusCode.INVALID_ARGUMENT, "bad request", details)
    assert status.error_details_from_trailers(trailers) == details
    assert status.error_trailers(grpc.StatusCode.INVALID_ARGUMENT, "bad", ErrorDetails()) == ()
    assert status.error_details_from_trailers(()) == ErrorDetails()


def test_a_real_call_carries_them_to_a_grpcio_status_client():
    details = ErrorDetails((), retry_after_s=1.5)

    async def abort(request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                            trailing_metadata=status.error_trailers(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                                                                    details))

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Svc", {"Call": grpc.unary_unary_rpc_method_handler(abort)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await channel.unary_unary("/test.Svc/Call")(b"", timeout=10)
        finally:
            await server.stop(None)
        return error.value

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status.error_details_from_trailers(error.trailing_metadata()) == details
    # Other clients read the same google.rpc.Status (here grpcio-status's reader).
    assert rpc_status.from_call(_Call(error)).message == "full"


class _Call:
    """What rpc_status.from_call reads of a finished call."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self._error = error

    def trailing_metadata(self):
        return self._error.trailing_metadata()

    def code(self):
        return self._error.code()

    def details(self):
        return self._error.details()
