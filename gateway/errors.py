"""The one way a request fails in the gateway: with a gRPC status, a message and,
where they help the caller, details (the field at fault, when to retry)."""

from __future__ import annotations

import logging

import grpc

from baton.wire import status
from baton.wire.records import ErrorDetails, FieldError

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request fails with this gRPC status (raised before or while it runs).

    `field`: the request field at fault, sent as a google.rpc.BadRequest;
    `retry_after_s`: when the caller may try again, sent as a google.rpc.RetryInfo;
    `reason`: why admission refused it (gateway/forecast.py), for the metrics.
    """

    def __init__(self, code: grpc.StatusCode, details: str, *, field: str | None = None,
                 retry_after_s: float | None = None, error_details: ErrorDetails | None = None,
                 reason: str | None = None) -> None:
        """`error_details`, when given, stands for `field` and `retry_after_s` (a worker's,
        several fields perhaps)."""
        super().__init__(details)
        self.code = code
        self.details = details
        self.reason = reason
        if error_details is None:
            error_details = ErrorDetails(((field, details),) if field is not None else (), retry_after_s)
        self.error_details = error_details

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
        """A worker call's failure as the client's: its code, its message, its retry hint
        (an overloaded worker's RESOURCE_EXHAUSTED stays that, with its RetryInfo) and the
        fields it names, still by their paths in the worker's request (`for_client`)."""
        return cls(error.code(), error.details() or fallback,
                   error_details=status.error_details_from_trailers(error.trailing_metadata()))

    def for_client(self, prompt_field: str) -> RequestError:
        """This error as the client should see it: each field a worker named put as the
        client's request names it (`request.sampling.max_tokens` is `sampling.max_tokens`,
        in the message too; the prompt's token ids are `prompt_field`, the client's
        prompt). A refusal that names only fields of the workers' own messages (a KV
        handle's) is no fault of the client's: INTERNAL, its words left to the gateway's
        log. A client's own paths are left as they are."""
        violations = self.error_details.field_violations
        details, mapped = self.details, []
        for field, description in violations:
            client = _client_field(field, prompt_field)
            if client is not None:
                details = details.replace(field, client, 1)
                mapped.append((client, description))
        if violations and not mapped:
            logger.warning("a worker refused what this gateway sent it: %s", self.details)
            return RequestError(grpc.StatusCode.INTERNAL, "a worker refused the request's handoff (a deployment "
                                "fault, not the request's: see the gateway's log)")
        return RequestError(self.code, details,
                            error_details=ErrorDetails(tuple(mapped), self.error_details.retry_after_s))


_WORKER_REQUEST = "request."
_WORKER_PROMPT = "request.prompt_token_ids"


def _client_field(field: str, prompt_field: str) -> str | None:
    if not field.startswith(_WORKER_REQUEST):
        return field if not field.startswith(("kv_handle", "kv_token", "first_token_id")) else None
    if field.startswith(_WORKER_PROMPT):
        index = field[len(_WORKER_PROMPT):]  # "[5]" or ""
        return prompt_field + index if prompt_field == "token_ids.ids" else prompt_field
    if field.startswith(_WORKER_REQUEST + "sampling."):
        return field[len(_WORKER_REQUEST):]
    return None  # the request id and priority are the gateway's to set
