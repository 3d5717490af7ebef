"""One source of settings: each default written once, flags over environment over
defaults, --help that shows them, and one-line errors for bad values."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from baton.cli.local import REPO_ROOT
from baton.cli.main import build_parser
from baton.runtime.settings import (
    DecodeWorkerSettings,
    GatewaySettings,
    PrefillWorkerSettings,
    SettingsError,
    add_flags,
    from_args,
)
from baton.runtime.values import (
    format_cpu_list,
    format_size,
    is_bare_size,
    parse_cpu_list,
    parse_size,
)
from engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig


def parse(cls, argv: list[str], env: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(argv), env or {})


def test_worker_defaults_are_the_engine_configs():
    decode = parse(DecodeWorkerSettings, [])
    # A decode worker's cache is shareable: prefill workers on its host copy KV into it (ipc).
    assert decode.engine == EngineConfig(
        model=DEFAULT_MODEL, cache=CacheConfig(shareable=True), scheduler=SchedulerConfig(), attention_backend="auto")
    prefill = parse(PrefillWorkerSettings, [])
    assert prefill.engine.scheduler.max_num_batched_tokens == 512  # a prefill worker's own budget
    assert prefill.engine.cache == CacheConfig()
    assert not parse(DecodeWorkerSettings, ["--kv-transport", "gloo"]).engine.cache.shareable


def test_a_kv_transport_of_no_name_is_refused():
    with pytest.raises(SettingsError, match="'tcp' is not one of auto, ipc, nccl, gloo"):
        parse(DecodeWorkerSettings, [], {"BATON_KV_TRANSPORT": "tcp"})


def test_flag_over_environment_over_default():
    env = {"BATON_MAX_NUM_SEQS": "64", "BATON_BLOCK_SIZE": "8", "BATON_VERIFY_KV": "true",
           "BATON_KV_CACHE_MEMORY": "512M"}
    settings = parse(DecodeWorkerSettings, ["--block-size", "32"], env)
    assert settings.block_size == 32  # the flag
    assert settings.max_num_seqs == 64 and settings.verify_kv  # the environment
    assert settings.engine.cache.kv_cache_memory_bytes == 512 * 2**20
    assert settings.lease_s == 30.0  # the default
    assert parse(DecodeWorkerSettings, ["--no-verify-kv"], env).verify_kv is False
    gateway = parse(GatewaySettings, [], {"BATON_DECODE_WORKERS": "a:1, b:2", "BATON_PREFILL_WORKERS": ""})
    assert gateway.decode_workers == ("a:1", "b:2") and gateway.prefill_workers == ()


def test_an_explicit_block_count_sizes_the_cache_alone():
    settings = parse(DecodeWorkerSettings, ["--num-kv-blocks", "100", "--kv-cache-memory", "2G"])
    assert (settings.engine.cache.num_kv_blocks, settings.engine.cache.kv_cache_memory_bytes) == (100, None)


@pytest.mark.parametrize("env, argv, message", [
    ({"BATON_THREADS": "abc"}, [], "BATON_THREADS='abc': not an integer"),
    ({"BATON_VERIFY_KV": "maybe"}, [], "BATON_VERIFY_KV='maybe': not a boolean"),
    ({"BATON_SWAP_SPACE": "lots"}, [], "BATON_SWAP_SPACE='lots': not a size"),
    ({}, ["--max-num-seqs", "0"], "max_num_seqs must be positive"),
    ({"BATON_PREEMPTION_MODE": "sometimes"}, [], "'sometimes' is not one of auto, recompute, swap"),
    ({"BATON_DTYPE": "int3"}, [], "'int3' is not one of auto, float32, fp32, bfloat16, bf16, float16, fp16, half, float64, fp64"),
    ({}, ["--lease-s", "0"], "lease_s must be positive"),
    ({"BATON_ALLOWED_PREFILL_WORKERS": "10.0.0.2"}, [], "--allowed-prefill-workers: '10.0.0.2' is not host:port"),
    ({}, ["--allowed-prefill-workers", "::1:50061"], "an IPv6 address goes in brackets"),
    ({}, ["--allowed-prefill-workers", "a:1,b:99999"], "'b:99999': the port must be a number in 1-65535"),
    ({"BATON_CPUS": "3-1"}, [], "BATON_CPUS='3-1': not a CPU list"),
    ({"BATON_CPUS": "0,x"}, [], "BATON_CPUS='0,x': not a CPU list"),
    ({}, ["--cpus", "100000"], "cpus 100000 are not available to this process"),
])
def test_bad_values_are_one_line_errors(env, argv, message):
    with pytest.raises(SettingsError) as error:
        parse(DecodeWorkerSettings, argv, env)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_decode_worker_lists_the_prefill_workers_it_pulls_from():
    """--allowed-prefill-workers (BATON_ALLOWED_PREFILL_WORKERS): empty, no address a KV
    handle names is dialled (closed: a forged handle made a worker started alone dial any
    host:port); '*', any (open); else only a listed one, compared as normalized host:port
    and dialled as listed."""
    closed = parse(DecodeWorkerSettings, []).prefill_allowlist
    assert closed.is_closed and not closed.is_open and closed.dial_address("127.0.0.1:50061") is None
    opened = parse(DecodeWorkerSettings, ["--allowed-prefill-workers", "*"]).prefill_allowlist
    assert opened.is_open and not opened.is_closed
    assert opened.dial_address("anything, unchecked") == "anything, unchecked"
    settings = parse(DecodeWorkerSettings,
                     ["--allowed-prefill-workers", " Prefill-0.Baton:50061, [0:0::1]:050062,,10.0.0.2:7 "])
    assert settings.allowed_prefill_workers == ("Prefill-0.Baton:50061", "[0:0::1]:050062", "10.0.0.2:7")
    allowlist = settings.prefill_allowlist
    assert allowlist.addresses == {"prefill-0.baton:50061", "[::1]:50062", "10.0.0.2:7"}
    assert allowlist.dial_address(" PREFILL-0.baton:50061") == "prefill-0.baton:50061"
    assert allowlist.dial_address("[::0001]:50062") == "[::1]:50062"
    for other in ("prefill-1.baton:50061", "prefill-0.baton:50062", "localhost:50062", "127.0.0.1:50062",
                  "10.0.0.2:7/x", "dns:///10.0.0.2:7", "ipv4:10.0.0.2:7", "10.0.0.2", "", "[::1]"):
        assert allowlist.dial_address(other) is None, other
    from_env = parse(DecodeWorkerSettings, [], {"BATON_ALLOWED_PREFILL_WORKERS": "a:1,b:2"})
    assert from_env.prefill_allowlist.addresses == {"a:1", "b:2"}
    assert not hasattr(parse(PrefillWorkerSettings, []), "allowed_prefill_workers")
    # The gateway's variable names them as the gateway dials them: not the decode worker's list.
    assert parse(DecodeWorkerSettings, [], {"BATON_PREFILL_WORKERS": "dns:///p:1"}).prefill_allowlist.is_closed


def test_a_worker_runs_on_the_cores_it_is_given():
    """--cpus (a Linux CPU list) binds the worker's threads, a thread per core unless
    --threads says otherwise; without it, half the cores and no binding."""
    assert parse_cpu_list(" 0-3, 8,2 ") == (0, 1, 2, 3, 8) and format_cpu_list((8, 0, 1, 2, 3)) == "0-3,8"
    assert format_cpu_list([5]) == "5" and parse_cpu_list(format_cpu_list([0, 2, 3, 4, 9])) == (0, 2, 3, 4, 9)
    first = min(os.sched_getaffinity(0))
    bound = parse(DecodeWorkerSettings, ["--cpus", str(first)])
    assert bound.cpus == (first,) and bound.num_threads == 1
    assert parse(DecodeWorkerSettings, ["--cpus", str(first), "--threads", "3"]).num_threads == 3
    unbound = parse(PrefillWorkerSettings, [])
    assert unbound.cpus == () and unbound.num_threads == max(1, len(os.sched_getaffinity(0)) // 2)
    assert parse(PrefillWorkerSettings, [], {"BATON_CPUS": ""}).cpus == ()
    # In a process of its own: binding covers the threads it already has, and those it starts later.
    script = ("import os, threading; from engine.envs import configure_process\n"
              "early = threading.Thread(target=lambda: __import__('time').sleep(1)); early.start()\n"
              f"configure_process(1, [{first}])\n"
              "tasks = [int(t) for t in os.listdir('/proc/self/task')]\n"
              "late = []; t = threading.Thread(target=lambda: late.append(os.sched_getaffinity(0))); t.start(); t.join()\n"
              "print(sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tasks}), sorted(late[0]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[({first},)]", f"[{first}]"], out


def test_a_local_deployment_splits_the_cores_between_its_roles():
    from baton.cli.local import split_cpus

    assert split_cpus([0, 1], prefill=True) == ([0], [[1]])
    assert split_cpus([0, 1, 2, 3, 4], prefill=True) == ([0, 1], [[2, 3, 4]])
    assert split_cpus([0, 1], prefill=False) == ([], [[0, 1]])
    assert split_cpus(list(range(8)), prefill=True, num_decode=3) == ([0, 1, 2, 3], [[4, 5], [6], [7]])
    assert split_cpus([0, 1, 2], prefill=True, num_decode=2) == ([0], [[1], [2]])
    for cpus, prefill, num_decode in (([0], True, 1), ([0, 1], True, 2), ([0], False, 2)):
        with pytest.raises(ValueError):
            split_cpus(cpus, prefill, num_decode)


def test_sizes():
    assert parse_size("512M") == 512 * 2**20 and parse_size("2GiB") == 2 * 2**30 and parse_size("1048576") == 2**20
    with pytest.raises(ValueError):
        parse_size("big")


def test_help_shows_every_default_and_variable():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    decode_help = commands["decode-worker"].format_help()
    assert "(default: 16; env BATON_BLOCK_SIZE)" in " ".join(decode_help.split())
    assert "(default: 2048; env BATON_MAX_NUM_BATCHED_TOKENS)" in " ".join(decode_help.split())
    assert "(default: 512; env BATON_MAX_NUM_BATCHED_TOKENS)" in " ".join(commands["prefill-worker"].format_help()
                                                                           .split())
    assert ("(default: 1G on CPU, from --gpu-memory-utilization on CUDA; env BATON_KV_CACHE_MEMORY)"
            in " ".join(decode_help.split()))
    assert "(default: auto; env BATON_DTYPE)" in " ".join(decode_help.split())
    assert "(default: cpu; env BATON_DEVICE)" in " ".join(decode_help.split())
    for name, command in commands.items():
        for action in command._actions:
            if action.option_strings and action.dest not in ("help", "chat", "stream", "json", "stop", "prompt"):
                assert "default:" in (action.help or ""), f"{name} {action.option_strings} shows no default"


def run_baton(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "baton.cli", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_the_command_reports_bad_values_in_one_line():
    result = run_baton("decode-worker", "--listen", "127.0.0.1:1", env={"BATON_THREADS": "abc"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "baton decode-worker: error: BATON_THREADS='abc': not an integer: 'abc'"]
    result = run_baton("prefill-worker", "--max-num-seqs", "many")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "argument --max-num-seqs: not an integer: 'many'" in result.stderr
    result = run_baton("gateway")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "baton gateway: error: the gateway needs at least one decode worker (--decode-workers)"]
    # A variable of another command is not read: `baton status` never parses BATON_THREADS.
    result = run_baton("status", "--gateway", "127.0.0.1:1", "--timeout-s", "1", env={"BATON_THREADS": "abc"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("baton status: gateway 127.0.0.1:1: UNAVAILABLE")


def test_baton_up_lays_the_workers_out_on_gpus():
    """`baton up --device cuda`: both workers on one GPU split its memory, the prefill worker
    first with its share; `--devices 0,1` gives each a GPU of its own; KV goes over ipc (one
    host) unless --kv-transport says otherwise."""
    from baton.cli.launcher import UpSettings, role_args

    def flags(args: list[str], name: str) -> list[str]:
        return [args[i + 1] for i, flag in enumerate(args) if flag == name]

    shared = parse(UpSettings, ["--device", "cuda", "--gpu-memory-utilization", "0.8",
                                "--prefill-memory-fraction", "0.25", "--max-model-len", "4096"])
    assert shared.shares_a_gpu
    roles = role_args(shared)
    assert flags(roles.worker, "--kv-transport") == ["auto"]
    assert flags(roles.worker + roles.prefill, "--gpu-memory-utilization")[-1] == "0.2000"  # 0.25 of 0.8
    assert flags(roles.worker + roles.decode, "--gpu-memory-utilization")[-1] == "0.6000"  # the rest of 0.8
    assert flags(roles.prefill, "--device") == flags(roles.decode, "--device") == ["cuda"]
    assert flags(roles.worker, "--max-model-len") == ["4096"]

    split = parse(UpSettings, ["--device", "cuda", "--devices", "0,1", "--kv-transport", "nccl"])
    assert not split.shares_a_gpu
    roles = role_args(split)
    assert (flags(roles.prefill, "--device"), flags(roles.decode, "--device")) == (["cuda:0"], ["cuda:1"])
    assert flags(roles.worker, "--kv-transport") == ["nccl"] and "--gpu-memory-utilization" not in roles.prefill
    assert not parse(UpSettings, ["--device", "cuda", "--colocated"]).shares_a_gpu
    assert not parse(UpSettings, []).shares_a_gpu  # CPU

    for bad, message in ((["--devices", "0,1"], "--devices needs --device cuda"),
                         (["--device", "cuda", "--devices", "0"], "two GPU indices"),
                         (["--prefill-memory-fraction", "1.5"], "must lie in"),
                         (["--max-model-len", "0"], "--max-model-len must be positive")):
        with pytest.raises(SettingsError, match=message):
            parse(UpSettings, bad)
    with pytest.raises(SettingsError, match="BATON_KV_TRANSPORT='tcp': 'tcp' is not one of auto, ipc, nccl, gloo"):
        parse(UpSettings, [], {"BATON_KV_TRANSPORT": "tcp"})


def test_speculative_decoding_is_the_decode_workers_and_baton_up_passes_it_to_them():
    from baton.cli.launcher import UpSettings, role_args

    decode = parse(DecodeWorkerSettings, ["--speculative", "ngram", "--num-speculative-tokens", "3"])
    assert decode.speculative == "ngram"
    assert decode.engine.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert parse(DecodeWorkerSettings, [], {"BATON_SPECULATIVE": "ngram"}).engine.speculative.method == "ngram"
    off = parse(DecodeWorkerSettings, ["--speculative", "none"], {"BATON_SPECULATIVE": "ngram"})
    assert off.speculative is None and off.engine.speculative == SpeculativeConfig()  # "none" is off
    assert parse(DecodeWorkerSettings, []).engine.speculative.method is None  # off by default
    with pytest.raises(SettingsError, match="num_speculative_tokens must be positive, got 0"):
        parse(DecodeWorkerSettings, ["--speculative", "ngram", "--num-speculative-tokens", "0"])
    # A prefill worker only prefills: it has no such setting, and reads no such variable.
    assert parse(PrefillWorkerSettings, [], {"BATON_SPECULATIVE": "ngram"}).engine.speculative.method is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill-worker", "--speculative", "ngram"])

    roles = role_args(parse(UpSettings, ["--speculative", "ngram", "--num-speculative-tokens", "6"]))
    assert roles.decode[-4:] == ["--speculative", "ngram", "--num-speculative-tokens", "6"]
    assert "--speculative" not in roles.worker + roles.prefill + roles.gateway
    assert "--speculative" not in role_args(parse(UpSettings, ["--speculative", "none"])).decode
    with pytest.raises(SettingsError, match="--num-speculative-tokens must be positive"):
        parse(UpSettings, ["--num-speculative-tokens", "-1"])
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("decode-worker", "up"):
        text = " ".join(commands[command].format_help().split())
        assert "--speculative {none,ngram,draft}" in text and "(default: off; env BATON_SPECULATIVE)" in text
        assert "--num-speculative-tokens N" in text and "--draft-model TEXT" in text
    # A draft model: named on the decode worker, passed by baton up.
    draft = parse(DecodeWorkerSettings, ["--speculative", "draft", "--draft-model", "/models/draft"], {})
    assert draft.engine.speculative == SpeculativeConfig(method="draft", draft_model="/models/draft")
    with pytest.raises(ValueError, match="draft model"):
        parse(DecodeWorkerSettings, ["--speculative", "draft"], {})
    up = role_args(parse(UpSettings, ["--speculative", "draft", "--draft-model", "/models/draft"]))
    assert up.decode[-2:] == ["--draft-model", "/models/draft"]


# ------------------------------------------------------------------ choices, sizes, --version
CHOICES = {  # flag: (a valid value, spelled loosely, as read; a value of no name; the names listed)
    "--device": ("CUDA:01", "cuda:1", "gpu", "cpu, cuda, cuda:N"),
    "--dtype": ("Half", "half", "double", "auto, float32, fp32, bfloat16, bf16, float16, fp16, half, float64, fp64"),
    "--kv-transport": ("IPC", "ipc", "tcp", "auto, ipc, nccl, gloo"),
    "--attention-backend": ("Torch", "torch", "flash", "auto, cpu, torch, triton"),
    "--preemption-mode": (" swap ", "swap", "never", "auto, recompute, swap"),
    "--log-level": ("debug", "DEBUG", "verbose", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    "--speculative": ("NGram", "ngram", "eagle", "none, ngram, draft"),
}


@pytest.mark.parametrize("flag", CHOICES)
def test_a_setting_of_fixed_choices_checks_flag_and_variable_alike(flag, capsys):
    loose, read, bad, names = CHOICES[flag]
    name, variable = flag[2:].replace("-", "_"), "BATON_" + flag[2:].replace("-", "_").upper()
    assert getattr(parse(DecodeWorkerSettings, [], {variable: loose}), name) == read
    with pytest.raises(SettingsError) as error:
        parse(DecodeWorkerSettings, [], {variable: bad})
    assert str(error.value) == f"{variable}={bad!r}: {bad!r} is not one of {names}"
    parser = build_parser()
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["decode-worker", flag, bad])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"baton decode-worker: error: argument {flag}: {bad!r} is not one of {names} "
        f"(see baton decode-worker --help)"]


def test_help_shows_the_choices_and_what_a_bare_size_means():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("decode-worker", "up"):
        text = " ".join(commands[command].format_help().split())
        assert "--device {cpu,cuda,cuda:N}" in text and "--log-level {DEBUG,INFO,WARNING,ERROR,CRITICAL}" in text
        assert "--kv-transport {auto,ipc,nccl,gloo}" in text
        assert "--dtype {auto,float32,fp32,bfloat16,bf16,float16,fp16,half,float64,fp64}" in text
        assert "--kv-cache-memory SIZE" in text and "a bare number is read as bytes" in text
    text = " ".join(commands["decode-worker"].format_help().split())
    assert "--swap-space SIZE CPU swap pool for swap preemption; a size with a unit" in text
    assert "a bare number is read as GiB (default: 256M; env BATON_SWAP_SPACE)" in text


def test_sizes_with_units_and_bare_numbers():
    assert parse_size("4GiB") == parse_size("4 G") == parse_size("4g") == 4 * 2**30
    assert parse_size("1.5G") == 3 * 2**29 and parse_size("4096K") == 4 * 2**20 and parse_size("1048576B") == 2**20
    assert parse_size("4", bare_unit=2**30) == 4 * 2**30 and parse_size("4B", bare_unit=2**30) == 4
    assert is_bare_size(" 4 ") and is_bare_size("1.5") and not is_bare_size("4B") and not is_bare_size("4M")
    for bad in ("-1", "4X", "G", "4 GB B", "inf", "", "٤G"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    # What a launcher passes on always has a unit, whatever a bare number means to its reader.
    assert format_size(1000) == "1000B" and format_size(3 * 2**29) == "1536M" and format_size(0) == "0B"
    assert parse_size(format_size(1000), bare_unit=2**30) == 1000


def test_a_bare_swap_space_is_gib_as_in_vllm_and_warned_once(monkeypatch, caplog):
    from baton.runtime import settings_base

    monkeypatch.setattr(settings_base, "_WARNED_BARE_SIZES", set())
    with caplog.at_level("WARNING"):
        assert parse(DecodeWorkerSettings, ["--swap-space", "4"]).swap_space == 4 * 2**30
        assert parse(DecodeWorkerSettings, [], {"BATON_SWAP_SPACE": "2"}).swap_space == 2 * 2**30
        assert parse(DecodeWorkerSettings, ["--swap-space", "512M"]).swap_space == 512 * 2**20
        assert parse(DecodeWorkerSettings, ["--swap-space", "0"]).swap_space == 0  # 0 in any unit
    assert [r.getMessage() for r in caplog.records] == [
        "--swap-space (BATON_SWAP_SPACE) 4 has no unit: read as 4GiB; write the unit to say so"]
    caplog.clear()
    with caplog.at_level("WARNING"):  # the KV cache's bare number keeps its meaning, bytes, warned too
        assert parse(DecodeWorkerSettings, ["--kv-cache-memory", "1073741824"]).kv_cache_memory == 2**30
    assert [r.getMessage() for r in caplog.records] == [
        "--kv-cache-memory (BATON_KV_CACHE_MEMORY) 1073741824 has no unit: read as 1073741824B; "
        "write the unit to say so"]


def test_baton_up_serves_the_gateways_metrics_on_its_port(tmp_path):
    from baton.cli.launcher import UpSettings, metrics_banner, role_args
    from baton.cli.local import Deployment, Process, spawn

    def flags(args: list[str]) -> list[str]:
        return [args[i + 1] for i, flag in enumerate(args) if flag == "--metrics-port"]

    assert flags(role_args(parse(UpSettings, ["--metrics-port", "9400"])).gateway) == ["9400"]
    assert int(flags(role_args(parse(UpSettings, ["--metrics-port", "0"])).gateway)[0]) > 0  # named in the banner
    roles = role_args(parse(UpSettings, []))
    assert flags(roles.gateway + roles.worker) == []
    assert role_args(parse(UpSettings, ["--kv-cache-memory", "1000"])).worker[-2:] == ["--kv-cache-memory", "1000B"]
    # The gateway's own port comes after the free one every process gets: the last wins, as in argparse.
    gateway = spawn("gateway", ["gateway", "--listen", "127.0.0.1:1", "--metrics-port", "5", "--metrics-port", "9400"],
                    tmp_path, {}, wrap=lambda argv: ["true"])
    gateway.popen.wait()
    worker = Process("decode", "127.0.0.1:2", gateway.popen, None, 9401)
    assert gateway.metrics_port == 9400
    assert metrics_banner(Deployment("127.0.0.1:1", [worker, gateway])) == (
        "  metrics: gateway http://127.0.0.1:9400/metrics, decode http://127.0.0.1:9401/metrics\n")


def test_baton_version(capsys, monkeypatch):
    import importlib.metadata
    import tomllib

    from baton.cli import main

    with pytest.raises(SystemExit) as exit:
        main.main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"baton {importlib.metadata.version('baton')}\n"

    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert main.version() == pyproject["project"]["version"]


def test_the_ports_picked_for_a_deployment_are_all_different():
    """A deployment's ports are picked before any process binds one: no two picks in a
    process may be the same port (a gateway given one port for --listen and --admin-listen
    refused to start)."""
    from baton.cli.local import LOWEST_PORT, free_port

    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports) and min(ports) >= LOWEST_PORT
