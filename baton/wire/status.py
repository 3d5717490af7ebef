"""Error details on the wire: ErrorDetails as the google.rpc.Status a failed call
carries in its trailing metadata (what grpcio-status and other gRPC clients read),
with a google.rpc.BadRequest naming the fields at fault and a google.rpc.RetryInfo
saying when to try again. Like convert.py, the only code that builds or reads these
messages. And requests whose bytes do not parse, answered INVALID_ARGUMENT like any
other bad request (`lenient_parser`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
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


class Undecodable:
    """A request whose bytes do not parse as its message (garbage, a string field that is
    not UTF-8): what `lenient_parser` hands on instead of failing."""

    __slots__ = ("message_name", "error")

    def __init__(self, message_name: str, error: str) -> None:
        self.message_name = message_name
        self.error = error

    def __str__(self) -> str:
        return f"the request is not a valid {self.message_name}: {self.error or 'it does not parse'}"


def lenient_parser(message_class) -> Callable[[bytes], object]:
    """A grpc request deserializer that hands undecodable bytes on as an Undecodable."""
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Undecodable(message_class.DESCRIPTOR.full_name, str(error))
    return parse


def lenient_handlers(servicer, service: ServiceDescriptor) -> dict[str, grpc.RpcMethodHandler]:
    """grpc method handlers for every method of `service`, served by `servicer`'s method of
    the same name as grpc's generated code would, except that a request whose bytes do not
    parse (garbage, a string that is not UTF-8) is answered INVALID_ARGUMENT with what is
    wrong: grpc's own deserializer fails such a call with UNKNOWN. (Unary and
    server-streaming methods: Baton's services have no other kind.)"""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name} streams requests: not supported")
        parse = lenient_parser(message_factory.GetMessageClass(method.input_type))
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _refusing_undecodable_stream(behavior), parse, serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _refusing_undecodable(behavior), parse, serialize)
    return handlers


def _refusing_undecodable(behavior):
    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        return await behavior(request, context)
    return unary


def _refusing_undecodable_stream(behavior):
    async def stream(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        async for response in behavior(request, context):
            yield response
    return stream
