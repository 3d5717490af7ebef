"""A pytest plugin for the GPU check's test phases: each test's outcome as a `Check`, written
as the test ends (and a STARTED line as it begins), to the file named by
BATON_GPU_CHECK_RECORDS. With pytest-xdist the controlling process writes every worker's
reports and the workers write nothing, so one process writes the file. Loaded with
`-p benchmarks.gpu_check.pytest_records`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.gpu_check.records import FAIL, PASS, PHASE_ENV, RECORDS_ENV, SKIP, CheckLog

DETAIL_CHARS = 1500


def _log() -> CheckLog | None:
    """The phase's log; None where nothing is recorded: no file named, or a pytest-xdist
    worker (the controller gets every worker's reports and records them)."""
    path = os.environ.get(RECORDS_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return CheckLog(Path(path), os.environ.get(PHASE_ENV, "tests"))


def _name(nodeid: str) -> str:
    return nodeid.removeprefix("tests/")


def pytest_runtest_logstart(nodeid, location):
    log = _log()
    if log is not None:
        log.start(_name(nodeid))


def pytest_runtest_logreport(report):
    log = _log()
    if log is None:
        return
    name = _name(report.nodeid)
    if report.failed:  # in setup, the call or teardown
        where = "" if report.when == "call" else f" (in {report.when})"
        text = report.longreprtext.strip()
        log.add(name, FAIL, detail=(text[-DETAIL_CHARS:] + where), seconds=report.duration)
    elif report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        log.add(name, SKIP, detail=str(reason).removeprefix("Skipped: "))
    elif report.passed and report.when == "call":
        log.add(name, PASS, seconds=report.duration)


def pytest_collectreport(report):
    """A test module that does not import is a failed check of its own (it used to stop
    the whole collection on the GPU machine)."""
    log = _log()
    if log is not None and report.failed:
        log.add(f"collect {_name(report.nodeid)}", FAIL, detail=report.longreprtext.strip()[-DETAIL_CHARS:])


def pytest_collection_finish(session):
    """How many tests the phase has, so a phase cut short shows how far it got. Under
    pytest-xdist the controller collects nothing itself: its workers report (below)."""
    log = _log()
    if log is not None and not session.config.pluginmanager.hasplugin("dsession"):
        _collected(log, len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    log = _log()
    if log is not None:
        _collected(log, len(ids))


def _collected(log: CheckLog, num_tests: int) -> None:
    log.add("collected", PASS, value=num_tests, unit="tests")
