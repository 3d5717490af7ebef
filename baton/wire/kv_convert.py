"""The KV handoff's control messages to records and back (convert.py's rules): the
handle, its layout and endpoint, and the calls between decode and prefill workers
(ReleaseKv, OpenKvChannel, SendKv)."""

from __future__ import annotations

from baton.wire.internal.v1 import worker_pb2
from baton.wire.records import (
    FieldError,
    KvChannelOpened,
    KvHandle,
    OpenKvChannel,
    ReleaseKv,
    SendKv,
    SendKvAccepted,
    SendKvDone,
)
from kvtransfer.endpoint import TRANSPORTS as KV_TRANSPORTS, KvEndpoint
from kvtransfer.layout import KvLayoutSpec
from kvtransfer.transport import Rendezvous

# A kv_token is 128 random bits in hex; anything much longer is not one.
MAX_KV_TOKEN_LENGTH = 128


def check_kv_token(kv_token: str, field: str) -> None:
    if not kv_token or len(kv_token) > MAX_KV_TOKEN_LENGTH:
        raise FieldError(field, f"a kv_token of 1 to {MAX_KV_TOKEN_LENGTH} characters is required")


def layout_to_pb(spec: KvLayoutSpec) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(num_layers=spec.num_layers, block_size=spec.block_size,
                               num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype)


def layout_from_pb(message: worker_pb2.KvLayout) -> KvLayoutSpec:
    """KvLayoutMismatchError if no cache could have it."""
    return KvLayoutSpec(num_layers=message.num_layers, block_size=message.block_size,
                        num_kv_heads=message.num_kv_heads, head_dim=message.head_dim, dtype=message.dtype)


def kv_endpoint_to_pb(endpoint: KvEndpoint) -> worker_pb2.KvEndpoint:
    return worker_pb2.KvEndpoint(hostname=endpoint.hostname, host_id=endpoint.host_id, device=endpoint.device,
                                 gpu_uuid=endpoint.gpu_uuid, kv_transport=endpoint.transport)


def kv_endpoint_from_pb(message: worker_pb2.KvEndpoint, field: str) -> KvEndpoint:
    """FieldError naming `field` if the endpoint is missing or malformed."""
    if len(message.hostname) > 255 or len(message.host_id) > 255 or len(message.gpu_uuid) > 255:
        raise FieldError(field, "a KV endpoint's names have at most 255 characters")
    try:
        return KvEndpoint(message.hostname, message.host_id, message.device, message.gpu_uuid,
                          message.kv_transport or "auto")
    except ValueError as error:
        raise FieldError(field, str(error)) from None


def kv_handle_to_pb(handle: KvHandle) -> worker_pb2.KvHandle:
    message = worker_pb2.KvHandle(
        prefill_worker_id=handle.prefill_worker_id,
        prefill_address=handle.prefill_address,
        request_id=handle.request_id,
        num_tokens=handle.num_tokens,
        num_blocks=handle.num_blocks,
        layout=layout_to_pb(handle.layout),
        lease_ms=round(handle.lease_s * 1000),
        kv_token=handle.kv_token,
    )
    if handle.prefill_endpoint is not None:
        message.prefill_endpoint.CopyFrom(kv_endpoint_to_pb(handle.prefill_endpoint))
    return message


def kv_handle_from_pb(message: worker_pb2.KvHandle, field: str = "kv_handle") -> KvHandle:
    """FieldError (naming `field`.prefill_endpoint) for a malformed endpoint; the handle's
    other fields are checked by decode_request_from_pb."""
    endpoint = None
    if message.HasField("prefill_endpoint"):
        endpoint = kv_endpoint_from_pb(message.prefill_endpoint, f"{field}.prefill_endpoint")
    return KvHandle(
        prefill_worker_id=message.prefill_worker_id,
        prefill_address=message.prefill_address,
        request_id=message.request_id,
        num_tokens=message.num_tokens,
        num_blocks=message.num_blocks,
        layout=layout_from_pb(message.layout),
        lease_s=message.lease_ms / 1000,
        kv_token=message.kv_token,
        prefill_endpoint=endpoint,
    )


def release_kv_to_pb(request: ReleaseKv) -> worker_pb2.ReleaseKvRequest:
    return worker_pb2.ReleaseKvRequest(request_id=request.request_id, kv_token=request.kv_token)


def release_kv_from_pb(message: worker_pb2.ReleaseKvRequest) -> ReleaseKv:
    return ReleaseKv(message.request_id, message.kv_token)


def released_to_pb(released: bool) -> worker_pb2.ReleaseKvResponse:
    return worker_pb2.ReleaseKvResponse(released=released)


def released_from_pb(message: worker_pb2.ReleaseKvResponse) -> bool:
    return message.released


# ------------------------------------------------------- the KV handoff's control
def open_kv_channel_to_pb(request: OpenKvChannel) -> worker_pb2.OpenKvChannelRequest:
    rendezvous = request.rendezvous
    return worker_pb2.OpenKvChannelRequest(
        channel_id=rendezvous.channel_id,
        store_host=rendezvous.host,
        store_port=rendezvous.port,
        layout=layout_to_pb(request.layout),
        decode_worker_id=request.decode_worker_id,
        timeout_seconds=rendezvous.timeout_s,
        secret=rendezvous.secret,
        transport=rendezvous.transport,
        ipc_socket=rendezvous.socket,
        decode_endpoint=kv_endpoint_to_pb(request.decode_endpoint),
        request_id=request.request_id,
        kv_token=request.kv_token,
    )


# Longest rendezvous wait a peer may ask for (torch.distributed takes it as a timedelta).
MAX_RENDEZVOUS_TIMEOUT_S = 3600.0
MAX_CHANNEL_ID_LENGTH = 256
MIN_CHANNEL_SECRET_BYTES, MAX_CHANNEL_SECRET_BYTES = 16, 256
MAX_IPC_SOCKET_LENGTH = 100  # an abstract Unix socket's name fits in 107 bytes


def open_kv_channel_from_pb(message: worker_pb2.OpenKvChannelRequest, default_timeout_s: float) -> OpenKvChannel:
    """KvLayoutMismatchError for a malformed layout, ValueError for a malformed rendezvous;
    no timeout given: `default_timeout_s`."""
    timeout_s = message.timeout_seconds or default_timeout_s
    if not 0.0 < timeout_s <= MAX_RENDEZVOUS_TIMEOUT_S:  # also NaN
        raise FieldError("timeout_seconds",
                         f"timeout_seconds must lie in (0, {MAX_RENDEZVOUS_TIMEOUT_S:g}], got {timeout_s}")
    if message.transport not in KV_TRANSPORTS:
        raise FieldError("transport", f"transport must be one of {', '.join(KV_TRANSPORTS)}, got "
                                      f"{message.transport[:32]!r}")
    if message.transport == "ipc":
        if not 0 < len(message.ipc_socket) <= MAX_IPC_SOCKET_LENGTH:
            raise FieldError("ipc_socket", f"ipc_socket must have 1 to {MAX_IPC_SOCKET_LENGTH} characters")
    else:
        if not 0 < message.store_port < 65536:
            raise FieldError("store_port", f"store_port must lie in [1, 65535], got {message.store_port}")
        if not message.store_host:
            raise FieldError("store_host", "store_host is empty")
    if not message.channel_id or len(message.channel_id) > MAX_CHANNEL_ID_LENGTH:
        raise FieldError("channel_id", f"channel_id must have 1 to {MAX_CHANNEL_ID_LENGTH} characters")
    if not MIN_CHANNEL_SECRET_BYTES <= len(message.secret) <= MAX_CHANNEL_SECRET_BYTES:
        raise FieldError("secret", f"secret must have {MIN_CHANNEL_SECRET_BYTES} to {MAX_CHANNEL_SECRET_BYTES} bytes")
    if not message.HasField("decode_endpoint"):
        raise FieldError("decode_endpoint", "the decode worker's endpoint is missing")
    endpoint = kv_endpoint_from_pb(message.decode_endpoint, "decode_endpoint")
    rendezvous = Rendezvous(message.channel_id, message.store_host, message.store_port, timeout_s, message.secret,
                            message.transport, message.ipc_socket)
    return OpenKvChannel(rendezvous, layout_from_pb(message.layout), message.decode_worker_id, endpoint,
                         message.request_id, message.kv_token)


def kv_channel_opened_to_pb(opened: KvChannelOpened) -> worker_pb2.OpenKvChannelResponse:
    return worker_pb2.OpenKvChannelResponse(prefill_worker_id=opened.prefill_worker_id, backend=opened.backend)


def kv_channel_opened_from_pb(message: worker_pb2.OpenKvChannelResponse) -> KvChannelOpened:
    return KvChannelOpened(message.prefill_worker_id, message.backend)


def send_kv_to_pb(request: SendKv) -> worker_pb2.SendKvRequest:
    return worker_pb2.SendKvRequest(channel_id=request.channel_id, request_id=request.request_id, tag=request.tag,
                                    num_blocks=request.num_blocks, verify=request.verify,
                                    block_ids=request.block_ids, kv_token=request.kv_token,
                                    first_block=request.first_block)


def send_kv_from_pb(message: worker_pb2.SendKvRequest) -> SendKv:
    return SendKv(message.channel_id, message.request_id, message.tag, message.num_blocks,
                  list(message.block_ids), message.verify, message.kv_token, message.first_block)


def send_kv_event_to_pb(event: SendKvAccepted | SendKvDone) -> worker_pb2.SendKvEvent:
    if isinstance(event, SendKvAccepted):
        return worker_pb2.SendKvEvent(
            accepted=worker_pb2.SendKvAccepted(num_blocks=len(event.block_ids), block_ids=event.block_ids)
        )
    return worker_pb2.SendKvEvent(done=worker_pb2.SendKvDone(
        block_checksums=event.block_checksums, num_bytes=event.num_bytes, seconds=event.seconds,
    ))


def send_kv_event_from_pb(message: worker_pb2.SendKvEvent) -> SendKvAccepted | SendKvDone | None:
    """The event, or None for a message that is neither (a sender of another version)."""
    which = message.WhichOneof("event")
    if which == "accepted":
        return SendKvAccepted(list(message.accepted.block_ids))
    if which == "done":
        done = message.done
        return SendKvDone(list(done.block_checksums), done.num_bytes, done.seconds)
    return None
