"""Error details on the wire: ErrorDetails as the google.rpc.Status a failed call
carries in its trailing metadata (what grpcio-status and other gRPC clients read),
with a google.rpc.BadRequest naming the fields at fault and a google.rpc.RetryInfo
saying when to try again. Like convert.py, the only code that builds or reads these
messages."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from baton.wire.records import ErrorDetails

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_trailers(code: grpc.StatusCode, message: str, details: ErrorDetails) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries `details` as a google.rpc.Status with the call's
    code and message (what grpcio-status clients read); empty when there are none."""
    if not details:
        return ()
    status = status_pb2.Status(code=code.value[0], message=message)
    if details.field_violations:
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
            for field, description in details.field_violations
        ]))
    if details.retry_after_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(round(details.retry_after_s * 1e9))
        status.details.add().Pack(retry)
    return rpc_status.to_status(status).trailing_metadata


def error_details_from_trailers(metadata) -> ErrorDetails:
    """The details a failed call's trailing metadata carries (none: empty details)."""
    for key, value in metadata or ():
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        violations: list[tuple[str, str]] = []
        retry_after_s = None
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.extend((v.field, v.description) for v in bad.field_violations)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
        return ErrorDetails(tuple(violations), retry_after_s)
    return ErrorDetails()
