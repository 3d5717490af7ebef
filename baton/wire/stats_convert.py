"""Worker stats and the deployment status, protobuf to records and back (convert.py's
rule: the only code besides it and status.py that builds or reads protobuf)."""

from __future__ import annotations

from dataclasses import fields

from google.protobuf import json_format

from baton.wire.internal.v1 import admin_pb2, worker_pb2
from baton.wire.kv_convert import kv_endpoint_from_pb, kv_endpoint_to_pb
from baton.wire.records import (AdmissionStatus, DeploymentStatus, KvTransportStats, LatencyStatus, PhaseLatency,
                                WorkerStats, WorkerStatus)
from engine import statistics
from engine.statistics import EngineStats, RecentStats


def _values(source: object, record: type, leave_out: tuple[str, ...] = ()) -> dict:
    """`source`'s attributes named as `record`'s fields (less `leave_out`): a record from a
    message, or a message from a record, field for field."""
    return {f.name: getattr(source, f.name) for f in fields(record) if f.name not in leave_out}


def recent_stats_to_pb(recent: RecentStats) -> worker_pb2.RecentStats:
    values = _values(recent, RecentStats)
    values["seconds_since_last_step"] = min(values["seconds_since_last_step"], 1e12)  # inf: no step yet
    return worker_pb2.RecentStats(**values)


def recent_stats_from_pb(message: worker_pb2.RecentStats) -> RecentStats:
    return RecentStats(**_values(message, RecentStats))


_NESTED = ("recent", "kv_transports", "kv_endpoint")


def worker_stats_to_pb(stats: WorkerStats) -> worker_pb2.WorkerStats:
    values = _values(stats, WorkerStats, _NESTED)
    message = worker_pb2.WorkerStats(**values)
    message.kv_transports.extend(
        worker_pb2.KvTransportStats(**_values(t, KvTransportStats))
        for t in stats.kv_transports
    )
    if stats.recent is not None:
        message.recent.CopyFrom(recent_stats_to_pb(stats.recent))
    if stats.kv_endpoint is not None:
        message.kv_endpoint.CopyFrom(kv_endpoint_to_pb(stats.kv_endpoint))
    return message


_REPEATED = tuple(statistics.repeated(EngineStats))  # counts per position: tuples in the record


def worker_stats_from_pb(message: worker_pb2.WorkerStats) -> WorkerStats:
    values = _values(message, WorkerStats, _NESTED)
    values.update((name, tuple(values[name])) for name in _REPEATED)
    recent = recent_stats_from_pb(message.recent) if message.HasField("recent") else None
    transports = tuple(KvTransportStats(**_values(t, KvTransportStats))
                       for t in message.kv_transports)
    endpoint = None
    if message.HasField("kv_endpoint"):
        try:
            endpoint = kv_endpoint_from_pb(message.kv_endpoint, "kv_endpoint")
        except ValueError:  # a worker of another release: routing treats it as on another host
            endpoint = None
    return WorkerStats(**values, kv_transports=transports, recent=recent, kv_endpoint=endpoint)


def deployment_status_request(latest_requests: int = 0) -> admin_pb2.GetDeploymentStatusRequest:
    return admin_pb2.GetDeploymentStatusRequest(latest_requests=latest_requests)


def deployment_status_to_pb(status: DeploymentStatus) -> admin_pb2.DeploymentStatus:
    workers = []
    for worker in status.workers:
        message = admin_pb2.WorkerStatus(address=worker.address, role=worker.role, reachable=worker.reachable,
                                          error=worker.error, in_rotation=worker.in_rotation)
        if worker.stats is not None:
            message.stats.CopyFrom(worker_stats_to_pb(worker.stats))
        workers.append(message)
    message = admin_pb2.DeploymentStatus(model=status.model, workers=workers)
    if status.latency is not None:
        latency = status.latency
        message.latency.CopyFrom(admin_pb2.LatencyStatus(
            **_values(latency, LatencyStatus, ("phases",)),
            phases=[admin_pb2.PhaseLatency(**_values(p, PhaseLatency))
                    for p in latency.phases]))
    if status.admission is not None:
        message.admission.CopyFrom(admin_pb2.AdmissionStatus(
            **_values(status.admission, AdmissionStatus)))
    return message


def deployment_status_to_json(status: DeploymentStatus) -> dict:
    """The status as protobuf's JSON mapping of DeploymentStatus (proto field names; 64-bit
    counts as strings, fields at their default left out), as `baton status --json` prints it."""
    return json_format.MessageToDict(deployment_status_to_pb(status), preserving_proto_field_name=True)


def deployment_status_from_pb(message: admin_pb2.DeploymentStatus) -> DeploymentStatus:
    admission = None
    if message.HasField("admission"):
        admission = AdmissionStatus(**_values(message.admission, AdmissionStatus))
    return DeploymentStatus(message.model, tuple(
        WorkerStatus(w.address, w.role, w.reachable, w.in_rotation, w.error,
                     worker_stats_from_pb(w.stats) if w.HasField("stats") else None)
        for w in message.workers
    ), admission, _latency_from_pb(message.latency) if message.HasField("latency") else None)


def _latency_from_pb(message: admin_pb2.LatencyStatus) -> LatencyStatus:
    values = _values(message, LatencyStatus, ("phases",))
    phases = tuple(PhaseLatency(**_values(p, PhaseLatency)) for p in message.phases)
    return LatencyStatus(**values, phases=phases)
