"""Statistics are declared once (engine/statistics.py) and every layer reads the
declarations: a worker's GetStats record and its wire message, the Prometheus families,
and `baton status --json`. These tests run over whatever is declared, so a statistic
added there is checked here with nothing else to list."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from prometheus_client import CollectorRegistry

from baton.cli.status import to_json
from baton.devtools import protogen
from baton.runtime.metrics import WorkerMetrics
from baton.runtime.worker import worker_stats
from baton.wire import stats_convert
from baton.wire.records import DeploymentStatus, WorkerStatus
from engine import statistics
from engine.scheduler.stats import SchedulerStats
from engine.statistics import COUNTER, GAUGE, EngineStats, RecentStats, stat


def distinct_values(cls: type) -> dict[str, object]:
    """A value for every field of `cls`, each declared statistic's its own."""
    hints = typing.get_type_hints(cls)
    made: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(cls), start=1):
        kind = hints[f.name]
        made[f.name] = True if kind is bool else i + 0.5 if kind is float else i if kind is int else None
        if kind == tuple[int, ...]:  # a count per position
            made[f.name] = (i, i + 1, i + 2)
    return made


def scheduler_stats() -> SchedulerStats:
    engine = {k: v for k, v in distinct_values(SchedulerStats).items() if v is not None}
    return SchedulerStats(**{**engine, "queue_times": (), "recent": RecentStats(**distinct_values(RecentStats))})


def test_every_statistic_is_declared_once_with_a_wire_number_of_its_own():
    for cls in (EngineStats, RecentStats):
        numbers = [spec.number for _, spec in statistics.declared(cls)]
        assert len(numbers) == len(set(numbers)), cls
        assert len(statistics.declared(cls)) == len(dataclasses.fields(cls))  # no field left undeclared
    families = {}
    for name, spec in statistics.declared(EngineStats):
        assert spec.kind in (GAUGE, COUNTER) and spec.help.endswith(".")
        if spec.metric is not None:  # a family's members share its kind and each has its label
            assert spec.metric.startswith("baton_")  # a counter's _total is the exposition's
            assert not (spec.kind == COUNTER and spec.metric.endswith("_total")), name
            families.setdefault(spec.metric, []).append(spec)
    for metric, members in families.items():
        assert len({s.kind for s in members}) == 1, metric
        assert len(members) == 1 or len({s.label for s in members}) == len(members) and None not in {
            s.label for s in members}, metric


def test_every_declared_statistic_reaches_get_stats_metrics_and_status():
    """SchedulerStats (the engine) -> WorkerStats (GetStats) -> its protobuf and back (the
    gateway) -> `baton status --json`; and the same snapshot through the Prometheus collector."""
    engine = scheduler_stats()
    record = worker_stats(engine, worker_id="w", role="decode", serving=True)
    declared = statistics.values(engine, EngineStats)
    assert statistics.values(record, EngineStats) == declared
    assert record.recent == engine.recent

    over_the_wire = stats_convert.worker_stats_from_pb(stats_convert.worker_stats_to_pb(record))
    assert over_the_wire == record

    shown = json.loads(to_json(DeploymentStatus("m", (WorkerStatus("a:1", "decode", True, True, "", record),)), []))
    worker = shown["status"]["workers"][0]["stats"]
    for name, value in declared.items():
        if isinstance(value, tuple):
            value = [str(v) for v in value]
        assert worker[name] in (value, str(value)), name  # 64-bit integers are strings in protobuf's JSON
    for name, value in statistics.values(engine.recent, RecentStats).items():
        assert worker["recent"][name] in (value, str(value)), name

    metrics = WorkerMetrics("m", "decode", CollectorRegistry())
    metrics.watch_engine(lambda: engine)
    for name, spec in statistics.declared(EngineStats):
        if spec.metric is None:
            continue
        sample = spec.metric + ("_total" if spec.kind == COUNTER else "")
        labels = {"model_name": "m", **dict([spec.label] if spec.label else [])}
        if spec.index_label:  # a series per position, from 1
            for position, count in enumerate(declared[name], start=1):
                assert metrics.registry.get_sample_value(
                    sample, {**labels, spec.index_label: str(position)}) == float(count), (name, position)
            continue
        assert metrics.registry.get_sample_value(sample, labels) == float(declared[name]), name


def test_a_statistic_declared_in_python_is_written_into_the_wire_message(monkeypatch):
    """protogen writes the declared fields, help as their comments, into worker.proto; and
    the committed worker.proto is what the declarations write (else the check names it)."""

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class WithOneMore(EngineStats):
        num_widgets: int = stat(GAUGE, "Widgets now.", 99, "baton_widgets")

    assert WithOneMore(num_widgets=3).num_widgets == 3
    proto = (protogen.PROTO_ROOT / "baton/internal/v1/worker.proto").read_text()
    assert protogen.declared_proto(proto) == proto
    monkeypatch.setattr(statistics, "EngineStats", WithOneMore)
    written = protogen.declared_proto(proto)
    assert "  // Widgets now.\n  uint64 num_widgets = 99;\n  // END EngineStats\n" in written
    assert written.replace("  // Widgets now.\n  uint64 num_widgets = 99;\n", "") == proto
    assert protogen.write_declared(check_only=True) == ["protos/baton/internal/v1/worker.proto"]


@pytest.mark.parametrize("cls", [EngineStats, RecentStats])
def test_the_wire_message_has_each_declared_field_by_its_number(cls):
    from baton.wire.internal.v1 import worker_pb2

    message = worker_pb2.WorkerStats if cls is EngineStats else worker_pb2.RecentStats
    by_name = message.DESCRIPTOR.fields_by_name
    for name, spec in statistics.declared(cls):
        assert by_name[name].number == spec.number, name
