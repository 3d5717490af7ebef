"""`make gpu-check` on CPU (benchmarks/gpu_check): every phase runs, a phase made to hang is
killed at its deadline and reported TIMEOUT while the later phases still run, summary.json
is whole JSON whenever it is read, and OUT never holds more than 8 files. Also its parts: the
pytest plugin's records, a check cut short by a kill, and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from baton.cli.local import REPO_ROOT
from benchmarks.gpu_check.phases import HANG_ENV, PHASE_NAMES, PLANTED_SERVER
from benchmarks.gpu_check.records import FAIL, PASS, SKIP, TIMEOUT, Check, CheckLog, read_checks
from benchmarks.gpu_check.runner import KILL_GRACE_S, MAX_OUT_FILES
from benchmarks.gpu_check.table import render

# A CPU run takes about 2 minutes on 2 idle cores; the budget leaves room for CI's shared
# cores (the other phases' deadlines are shares of it). The hung phase waits out a deadline
# of its own (--deadline-s), not a share of the budget (about 60 s): the planted hang is
# reached a second or so after the phase starts.
BUDGET_S = 420
HUNG = "kernels"
HUNG_DEADLINE_S = 10  # the shortest deadline a phase runs in (2x the runner's kill grace)


@pytest.mark.timeout(600)
def test_cpu_gpu_check_runs_every_phase_and_survives_a_hung_one(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, HANG_ENV: HUNG, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--budget-s",
                                str(BUDGET_S), "--deadline-s", f"{HUNG}={HUNG_DEADLINE_S}", "--out", str(out)],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, dict] = {}  # summary.json's contents as read while the run went on
    while process.poll() is None:
        path = out / "summary.json"
        if path.exists():
            text = path.read_text()
            seen.setdefault(text, json.loads(text))  # whole JSON whenever it is read
            assert len([p for p in out.rglob("*") if p.is_file()]) <= MAX_OUT_FILES
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    output = process.stdout.read()
    final = (out / "summary.json").read_text()
    seen.setdefault(final, json.loads(final))
    assert process.returncode == 1, output  # the planted hang is a TIMEOUT: not a clean run
    assert elapsed <= BUDGET_S + 15, output

    summary = json.loads((out / "summary.json").read_text())
    phases = {phase["name"]: phase for phase in summary["phases"]}
    assert list(phases) == list(PHASE_NAMES)
    statuses = {name: phase["status"] for name, phase in phases.items()}
    assert statuses == {name: TIMEOUT if name == HUNG else PASS for name in PHASE_NAMES}, (
        statuses, (out / "summary.txt").read_text())
    hung = phases[HUNG]
    assert hung["deadline_s"] == HUNG_DEADLINE_S
    assert hung["seconds"] <= hung["deadline_s"] + KILL_GRACE_S + 5
    assert not running(HUNG), "the hung phase left a process behind"
    assert [(c["name"], c["status"]) for c in hung["checks"]] == [("planted hang", TIMEOUT)]
    # The summary was rewritten as the run went: after each phase at least.
    done = {sum(p["status"] not in ("PENDING", "RUNNING") for p in s["phases"]) for s in seen.values()}
    assert done >= set(range(1, len(PHASE_NAMES) + 1)), done

    checks = {c["name"]: c for phase in summary["phases"] for c in phase["checks"]}
    assert checks["imports"]["status"] == PASS and checks["imports"]["value"] > 100
    assert summary["environment"]["torch"] and summary["environment"]["device"] == "cpu"
    engine_tests = [c for c in phases["engine"]["checks"] if "::" in c["name"]]
    assert engine_tests and all(c["status"] == PASS for c in engine_tests)
    assert any("test_kv_ipc.py" in name for name in checks) and any("disaggregated" in name for name in checks)
    for name in ("copy bandwidth", "decode-batch1-vs-hbm-floor", "offline-mixed-vs-baton-static", "handoff-serving",
                 "handoff-no-held-blocks"):
        assert checks[name]["status"] == PASS and checks[name]["value"] > 0, checks[name]
    # Measured, not judged, on CPU; what only a GPU has is skipped, not faked.
    assert checks["graphs-vs-eager"]["status"] == SKIP and checks["graphs-vs-eager"]["value"] is None

    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == sorted(["summary.json", "summary.txt", *(f"{i}-{n}.log" for i, n in enumerate(PHASE_NAMES, 1))])
    table = (out / "summary.txt").read_text()
    assert f"{HUNG.upper():<12} TIMEOUT" in table and "planted hang" in table
    assert table.strip() in output


def test_a_run_stopped_from_outside_kills_its_phase_and_says_what_it_had(tmp_path):
    """SIGTERM (a caller's time limit) while a phase runs: the phase's process group dies with
    the run, and summary.json says the phase was stopped."""
    out = tmp_path / "out"
    env = {**os.environ, HANG_ENV: "environment"}
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--out", str(out),
                                "--phases", "environment,kernels"], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "1-environment.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "hanging until killed" in log.read_text()):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    process.terminate()
    assert process.wait(timeout=60) != 0
    summary = json.loads((out / "summary.json").read_text())
    environment, kernels = summary["phases"]
    assert environment["status"] == TIMEOUT and kernels["status"] == "PENDING"
    assert {c["name"]: c["status"] for c in environment["checks"]} == {"planted hang": TIMEOUT,
                                                                      "environment phase": TIMEOUT}
    assert not running("environment"), "a process of the phase is left running"


def running(phase: str) -> bool:
    """Whether a process of a planted hang is left: the phase, or the 'server' it started in
    a session of its own."""
    return any(subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0
               for pattern in (f"benchmarks.gpu_check.phase {phase}", PLANTED_SERVER))


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_the_pytest_plugin_records_each_test_as_it_ends(tmp_path, workers):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'wrong'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_cases(n): assert n == 1\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module\n")
    records = tmp_path / "records.jsonl"
    env = {**os.environ, "BATON_GPU_CHECK_RECORDS": str(records), "BATON_GPU_CHECK_PHASE": "sample",
           "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                    "benchmarks.gpu_check.pytest_records", "--continue-on-collection-errors", *workers,
                    "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                   env=env, cwd=tmp_path, capture_output=True, timeout=120)
    checks = {c.name.split("/")[-1]: c for c in read_checks(records, "sample", killed=False)}
    assert {name: c.status for name, c in checks.items()} == {
        "collect test_broken.py": FAIL, "test_sample.py::test_ok": PASS, "test_sample.py::test_bad": FAIL,
        "test_sample.py::test_skipped": SKIP, "test_sample.py::test_cases[1]": PASS,
        "test_sample.py::test_cases[2]": FAIL, "collected": PASS}
    assert checks["collected"].value == 5
    assert "wrong" in checks["test_sample.py::test_bad"].detail
    assert "no_such_module" in checks["collect test_broken.py"].detail
    assert checks["test_sample.py::test_skipped"].detail == "not here"
    # A line as each test starts and one as it ends, written by one process (xdist: the
    # controller), the import failure, and what was collected (with xdist, as each worker says).
    num_collected = int(workers[1]) if workers else 1
    assert len(records.read_text().splitlines()) == 2 * 5 + 1 + num_collected


def test_a_check_cut_short_is_a_timeout_if_killed_and_a_failure_if_it_crashed(tmp_path):
    log = CheckLog(tmp_path / "phase.jsonl", "engine")
    log.add("done", PASS, seconds=1.0)
    log.start("running")
    with open(log.path, "a") as out:
        out.write('{"phase": "engine", "name": "half a li')  # the kill cut the last line short
    killed = {c.name: c.status for c in read_checks(log.path, "engine", killed=True)}
    assert killed == {"done": PASS, "running": TIMEOUT}
    crashed = {c.name: c.status for c in read_checks(log.path, "engine", killed=False)}
    assert crashed == {"done": PASS, "running": FAIL}


def test_the_table_folds_a_test_functions_cases_and_lists_failures():
    checks = [Check("kernels", f"test_k.py::test_attention[{i}]", PASS if i else FAIL, detail="E  max error 0.5")
              for i in range(3)]
    checks.append(Check("figures", "copy bandwidth", PASS, value=2950.0, unit="GB/s"))
    summary = {"device": "cuda", "budget_s": 480, "elapsed_s": 400, "environment": {"gpu": "NVIDIA H100"},
               "phases": [{"name": "kernels", "title": "t", "status": FAIL, "seconds": 60, "deadline_s": 70,
                           "checks": [c.to_json() for c in checks]}]}
    table = render(summary)
    assert "on NVIDIA H100" in table
    assert "test_k.py::test_attention" in table and "1/3 pass" not in table and "2/3 pass" in table
    assert "2.95e+03 GB/s" in table
    assert "kernels/test_k.py::test_attention[0]: E  max error 0.5" in table
