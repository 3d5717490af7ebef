from baton.wire.internal.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetDeploymentStatusRequest(_message.Message):
    __slots__ = ("latest_requests",)
    LATEST_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    latest_requests: int
    def __init__(self, latest_requests: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "reachable", "error", "stats", "in_rotation")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    IN_ROTATION_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    reachable: bool
    error: str
    stats: _worker_pb2.WorkerStats
    in_rotation: bool
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., stats: _Optional[_Union[_worker_pb2.WorkerStats, _Mapping]] = ..., in_rotation: _Optional[bool] = ...) -> None: ...

class DeploymentStatus(_message.Message):
    __slots__ = ("model", "workers", "admission", "latency")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    admission: AdmissionStatus
    latency: LatencyStatus
    def __init__(self, model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., admission: _Optional[_Union[AdmissionStatus, _Mapping]] = ..., latency: _Optional[_Union[LatencyStatus, _Mapping]] = ...) -> None: ...

class LatencyStatus(_message.Message):
    __slots__ = ("num_requests", "phases", "ttft_p50_s", "ttft_p90_s", "ttst_p50_s", "ttst_p90_s", "largest")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    TTST_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTST_P90_S_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    phases: _containers.RepeatedCompositeFieldContainer[PhaseLatency]
    ttft_p50_s: float
    ttft_p90_s: float
    ttst_p50_s: float
    ttst_p90_s: float
    largest: str
    def __init__(self, num_requests: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[PhaseLatency, _Mapping]]] = ..., ttft_p50_s: _Optional[float] = ..., ttft_p90_s: _Optional[float] = ..., ttst_p50_s: _Optional[float] = ..., ttst_p90_s: _Optional[float] = ..., largest: _Optional[str] = ...) -> None: ...

class PhaseLatency(_message.Message):
    __slots__ = ("phase", "p50_s", "p90_s", "mean_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    P50_S_FIELD_NUMBER: _ClassVar[int]
    P90_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_S_FIELD_NUMBER: _ClassVar[int]
    phase: str
    p50_s: float
    p90_s: float
    mean_s: float
    def __init__(self, phase: _Optional[str] = ..., p50_s: _Optional[float] = ..., p90_s: _Optional[float] = ..., mean_s: _Optional[float] = ...) -> None: ...

class AdmissionStatus(_message.Message):
    __slots__ = ("max_concurrent_requests", "max_queue_wait_s", "num_in_flight", "num_admitted", "num_refused_concurrency", "num_refused_queue_wait", "num_refused_deadline", "num_deadline_misses", "num_met_deadlines", "forecast_known", "forecast_queue_wait_s", "mean_forecast_ttft_s", "mean_observed_ttft_s", "decode_scale", "decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_context_token_s")
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_QUEUE_WAIT_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_MET_DEADLINES_FIELD_NUMBER: _ClassVar[int]
    FORECAST_KNOWN_FIELD_NUMBER: _ClassVar[int]
    FORECAST_QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_FORECAST_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_OBSERVED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_SCALE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_BASE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_PER_CONTEXT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    max_concurrent_requests: int
    max_queue_wait_s: float
    num_in_flight: int
    num_admitted: int
    num_refused_concurrency: int
    num_refused_queue_wait: int
    num_refused_deadline: int
    num_deadline_misses: int
    num_met_deadlines: int
    forecast_known: bool
    forecast_queue_wait_s: float
    mean_forecast_ttft_s: float
    mean_observed_ttft_s: float
    decode_scale: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_context_token_s: float
    def __init__(self, max_concurrent_requests: _Optional[int] = ..., max_queue_wait_s: _Optional[float] = ..., num_in_flight: _Optional[int] = ..., num_admitted: _Optional[int] = ..., num_refused_concurrency: _Optional[int] = ..., num_refused_queue_wait: _Optional[int] = ..., num_refused_deadline: _Optional[int] = ..., num_deadline_misses: _Optional[int] = ..., num_met_deadlines: _Optional[int] = ..., forecast_known: _Optional[bool] = ..., forecast_queue_wait_s: _Optional[float] = ..., mean_forecast_ttft_s: _Optional[float] = ..., mean_observed_ttft_s: _Optional[float] = ..., decode_scale: _Optional[float] = ..., decode_step_base_s: _Optional[float] = ..., decode_step_per_seq_s: _Optional[float] = ..., decode_step_per_context_token_s: _Optional[float] = ...) -> None: ...
