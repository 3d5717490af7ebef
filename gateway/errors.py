"""The one way a request fails in the gateway: with a gRPC status and a message."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request fails with this gRPC status (raised before or while it runs)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
