from baton.wire.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "num_generated_tokens", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    num_generated_tokens: int
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "kv_token")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request: WorkRequest
    kv_token: str
    def __init__(self, request: _Optional[_Union[WorkRequest, _Mapping]] = ..., kv_token: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "finish_reason", "kv_handle", "num_cached_tokens", "num_host_cached_tokens", "prompt_logprobs", "moments_ns")
    class MomentsNsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_NS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _generation_pb2.TokenLogprob
    finish_reason: _generation_pb2.FinishReason
    kv_handle: KvHandle
    num_cached_tokens: int
    num_host_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    moments_ns: _containers.ScalarMap[str, int]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., num_host_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., moments_ns: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("prefill_worker_id", "prefill_address", "request_id", "num_tokens", "num_blocks", "layout", "lease_ms", "kv_token", "prefill_endpoint")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    prefill_address: str
    request_id: str
    num_tokens: int
    num_blocks: int
    layout: KvLayout
    lease_ms: int
    kv_token: str
    prefill_endpoint: KvEndpoint
    def __init__(self, prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lease_ms: _Optional[int] = ..., kv_token: _Optional[str] = ..., prefill_endpoint: _Optional[_Union[KvEndpoint, _Mapping]] = ...) -> None: ...

class KvEndpoint(_message.Message):
    __slots__ = ("hostname", "host_id", "device", "gpu_uuid", "kv_transport")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    host_id: str
    device: str
    gpu_uuid: str
    kv_transport: str
    def __init__(self, hostname: _Optional[str] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., kv_transport: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id", "kv_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_token: str
    def __init__(self, request_id: _Optional[str] = ..., kv_token: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class OpenKvChannelRequest(_message.Message):
    __slots__ = ("channel_id", "store_host", "store_port", "layout", "decode_worker_id", "timeout_seconds", "secret", "transport", "ipc_socket", "decode_endpoint", "request_id", "kv_token")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    IPC_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    store_host: str
    store_port: int
    layout: KvLayout
    decode_worker_id: str
    timeout_seconds: float
    secret: bytes
    transport: str
    ipc_socket: str
    decode_endpoint: KvEndpoint
    request_id: str
    kv_token: str
    def __init__(self, channel_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., secret: _Optional[bytes] = ..., transport: _Optional[str] = ..., ipc_socket: _Optional[str] = ..., decode_endpoint: _Optional[_Union[KvEndpoint, _Mapping]] = ..., request_id: _Optional[str] = ..., kv_token: _Optional[str] = ...) -> None: ...

class OpenKvChannelResponse(_message.Message):
    __slots__ = ("prefill_worker_id", "backend")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    backend: str
    def __init__(self, prefill_worker_id: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("channel_id", "request_id", "tag", "num_blocks", "verify", "block_ids", "kv_token", "first_block")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    request_id: str
    tag: int
    num_blocks: int
    verify: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_token: str
    first_block: int
    def __init__(self, channel_id: _Optional[str] = ..., request_id: _Optional[str] = ..., tag: _Optional[int] = ..., num_blocks: _Optional[int] = ..., verify: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., kv_token: _Optional[str] = ..., first_block: _Optional[int] = ...) -> None: ...

class SendKvEvent(_message.Message):
    __slots__ = ("accepted", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: SendKvAccepted
    done: SendKvDone
    def __init__(self, accepted: _Optional[_Union[SendKvAccepted, _Mapping]] = ..., done: _Optional[_Union[SendKvDone, _Mapping]] = ...) -> None: ...

class SendKvAccepted(_message.Message):
    __slots__ = ("num_blocks", "block_ids")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SendKvDone(_message.Message):
    __slots__ = ("block_checksums", "num_bytes", "seconds")
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    seconds: float
    def __init__(self, block_checksums: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "first_token_id", "kv_handle", "max_messages_per_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_PER_S_FIELD_NUMBER: _ClassVar[int]
    request: WorkRequest
    first_token_id: int
    kv_handle: KvHandle
    max_messages_per_s: float
    def __init__(self, request: _Optional[_Union[WorkRequest, _Mapping]] = ..., first_token_id: _Optional[int] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., max_messages_per_s: _Optional[float] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "num_cached_tokens", "num_host_cached_tokens", "prompt_logprobs", "moments_ns")
    class MomentsNsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_NS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finish_reason: _generation_pb2.FinishReason
    stop_token_id: int
    num_cached_tokens: int
    num_host_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    moments_ns: _containers.ScalarMap[str, int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_host_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., moments_ns: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "model", "serving", "max_num_seqs", "max_num_batched_tokens", "kv_block_bytes", "block_size", "num_transfers", "num_transfer_failures", "num_transfers_verified", "num_transferred_bytes", "transfer_seconds", "num_leases_expired", "kv_transports", "kv_channel_refusal", "kv_endpoint", "recent", "num_running", "num_waiting", "num_swapped", "num_kv_handoffs_pending", "num_queued_prefill_tokens", "oldest_queued_seconds", "num_kv_blocks_total", "num_kv_blocks_used", "num_kv_blocks_free", "num_kv_blocks_fenced", "num_steps", "num_tokens_scheduled_total", "mean_seqs_per_step", "num_finished", "num_preemptions_recompute", "num_preemptions_swap", "prefix_caching", "num_kv_blocks_cached", "num_kv_blocks_evictable", "num_kv_blocks_evicted", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_received_blocks", "prefix_cache_reused_blocks", "num_kv_offload_blocks_total", "num_kv_offload_blocks_cached", "prefix_cache_host_hit_tokens", "prefix_cache_host_reused_blocks", "kv_offload_written_blocks", "kv_offload_reloaded_bytes", "kv_offload_reload_seconds", "num_kv_offload_evicted", "kv_copy_bytes_per_s", "num_kv_landed", "decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_context_token_s", "prefill_s_per_token", "num_speculative_tokens", "spec_num_checks", "spec_num_proposed", "spec_num_accepted", "spec_num_emitted", "spec_check_cost_steps", "spec_proposed_by_position", "spec_accepted_by_position")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_CHANNEL_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HANDOFFS_PENDING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FENCED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_SCHEDULED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEAN_SEQS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RECEIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_OFFLOAD_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_OFFLOAD_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_RELOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_RELOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_OFFLOAD_EVICTED_FIELD_NUMBER: _ClassVar[int]
    KV_COPY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LANDED_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_BASE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_PER_CONTEXT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_CHECKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_EMITTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_CHECK_COST_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    serving: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_block_bytes: int
    block_size: int
    num_transfers: int
    num_transfer_failures: int
    num_transfers_verified: int
    num_transferred_bytes: int
    transfer_seconds: float
    num_leases_expired: int
    kv_transports: _containers.RepeatedCompositeFieldContainer[KvTransportStats]
    kv_channel_refusal: str
    kv_endpoint: KvEndpoint
    recent: RecentStats
    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_handoffs_pending: int
    num_queued_prefill_tokens: int
    oldest_queued_seconds: float
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_kv_blocks_fenced: int
    num_steps: int
    num_tokens_scheduled_total: int
    mean_seqs_per_step: float
    num_finished: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_caching: bool
    num_kv_blocks_cached: int
    num_kv_blocks_evictable: int
    num_kv_blocks_evicted: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_received_blocks: int
    prefix_cache_reused_blocks: int
    num_kv_offload_blocks_total: int
    num_kv_offload_blocks_cached: int
    prefix_cache_host_hit_tokens: int
    prefix_cache_host_reused_blocks: int
    kv_offload_written_blocks: int
    kv_offload_reloaded_bytes: int
    kv_offload_reload_seconds: float
    num_kv_offload_evicted: int
    kv_copy_bytes_per_s: float
    num_kv_landed: int
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_context_token_s: float
    prefill_s_per_token: float
    num_speculative_tokens: int
    spec_num_checks: int
    spec_num_proposed: int
    spec_num_accepted: int
    spec_num_emitted: int
    spec_check_cost_steps: float
    spec_proposed_by_position: _containers.RepeatedScalarFieldContainer[int]
    spec_accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., serving: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., num_transfers: _Optional[int] = ..., num_transfer_failures: _Optional[int] = ..., num_transfers_verified: _Optional[int] = ..., num_transferred_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., num_leases_expired: _Optional[int] = ..., kv_transports: _Optional[_Iterable[_Union[KvTransportStats, _Mapping]]] = ..., kv_channel_refusal: _Optional[str] = ..., kv_endpoint: _Optional[_Union[KvEndpoint, _Mapping]] = ..., recent: _Optional[_Union[RecentStats, _Mapping]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_kv_handoffs_pending: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., oldest_queued_seconds: _Optional[float] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., num_kv_blocks_fenced: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_tokens_scheduled_total: _Optional[int] = ..., mean_seqs_per_step: _Optional[float] = ..., num_finished: _Optional[int] = ..., num_preemptions_recompute: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., num_kv_blocks_cached: _Optional[int] = ..., num_kv_blocks_evictable: _Optional[int] = ..., num_kv_blocks_evicted: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_received_blocks: _Optional[int] = ..., prefix_cache_reused_blocks: _Optional[int] = ..., num_kv_offload_blocks_total: _Optional[int] = ..., num_kv_offload_blocks_cached: _Optional[int] = ..., prefix_cache_host_hit_tokens: _Optional[int] = ..., prefix_cache_host_reused_blocks: _Optional[int] = ..., kv_offload_written_blocks: _Optional[int] = ..., kv_offload_reloaded_bytes: _Optional[int] = ..., kv_offload_reload_seconds: _Optional[float] = ..., num_kv_offload_evicted: _Optional[int] = ..., kv_copy_bytes_per_s: _Optional[float] = ..., num_kv_landed: _Optional[int] = ..., decode_step_base_s: _Optional[float] = ..., decode_step_per_seq_s: _Optional[float] = ..., decode_step_per_context_token_s: _Optional[float] = ..., prefill_s_per_token: _Optional[float] = ..., num_speculative_tokens: _Optional[int] = ..., spec_num_checks: _Optional[int] = ..., spec_num_proposed: _Optional[int] = ..., spec_num_accepted: _Optional[int] = ..., spec_num_emitted: _Optional[int] = ..., spec_check_cost_steps: _Optional[float] = ..., spec_proposed_by_position: _Optional[_Iterable[int]] = ..., spec_accepted_by_position: _Optional[_Iterable[int]] = ...) -> None: ...

class KvTransportStats(_message.Message):
    __slots__ = ("transport", "num_transfers", "num_failures", "num_transferred_bytes", "transfer_seconds")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    num_transfers: int
    num_failures: int
    num_transferred_bytes: int
    transfer_seconds: float
    def __init__(self, transport: _Optional[str] = ..., num_transfers: _Optional[int] = ..., num_failures: _Optional[int] = ..., num_transferred_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...

class RecentStats(_message.Message):
    __slots__ = ("window_seconds", "seconds", "seconds_since_last_step", "num_steps", "mean_batch_size", "mean_tokens_per_step", "mean_kv_usage", "mean_num_waiting", "num_admissions", "num_preemptions_recompute", "num_preemptions_swap", "num_swapped_blocks_out", "num_queued", "mean_queue_seconds", "num_steps_kv_blocked", "num_steps_seq_capped", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "busy_seconds")
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEAN_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    MEAN_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_BLOCKS_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MEAN_QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_KV_BLOCKED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_SEQ_CAPPED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    window_seconds: float
    seconds: float
    seconds_since_last_step: float
    num_steps: int
    mean_batch_size: float
    mean_tokens_per_step: float
    mean_kv_usage: float
    mean_num_waiting: float
    num_admissions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_blocks_out: int
    num_queued: int
    mean_queue_seconds: float
    num_steps_kv_blocked: int
    num_steps_seq_capped: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    busy_seconds: float
    def __init__(self, window_seconds: _Optional[float] = ..., seconds: _Optional[float] = ..., seconds_since_last_step: _Optional[float] = ..., num_steps: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., mean_tokens_per_step: _Optional[float] = ..., mean_kv_usage: _Optional[float] = ..., mean_num_waiting: _Optional[float] = ..., num_admissions: _Optional[int] = ..., num_preemptions_recompute: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., num_swapped_blocks_out: _Optional[int] = ..., num_queued: _Optional[int] = ..., mean_queue_seconds: _Optional[float] = ..., num_steps_kv_blocked: _Optional[int] = ..., num_steps_seq_capped: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., busy_seconds: _Optional[float] = ...) -> None: ...
