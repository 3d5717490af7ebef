"""The one way a request fails in the gateway: with a gRPC status, a message and,
where they help the caller, details (the field at fault, when to retry)."""

from __future__ import annotations

import grpc

from baton.wire import status
from baton.wire.records import ErrorDetails, FieldError


class RequestError(Exception):
    """A request fails with this gRPC status (raised before or while it runs).

    `field`: the request field at fault, sent as a google.rpc.BadRequest;
    `retry_after_s`: when the caller may try again, sent as a google.rpc.RetryInfo.
    """

    def __init__(self, code: grpc.StatusCode, details: str, *, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.error_details = ErrorDetails(((field, details),) if field is not None else (), retry_after_s)

    @classmethod
    def invalid(cls, error: FieldError | ValueError, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                ) -> RequestError:
        """A ValueError raised reading or checking a request, as INVALID_ARGUMENT (naming
        the field when it is a FieldError)."""
        if isinstance(error, FieldError):
            return cls(code, str(error), field=error.field)
        return cls(code, str(error))

    @classmethod
    def from_worker(cls, error: grpc.aio.AioRpcError, fallback: str) -> RequestError:
        """A worker call's failure as the client's: its code, its message and its retry
        hint (an overloaded worker's RESOURCE_EXHAUSTED stays that, with its RetryInfo)."""
        details = status.error_details_from_trailers(error.trailing_metadata())
        return cls(error.code(), error.details() or fallback, retry_after_s=details.retry_after_s)
