"""One source of settings: each default written once, flags over environment over
defaults, --help that shows them, and one-line errors for bad values."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from baton.cli.main import build_parser
from baton.runtime.settings import (
    DecodeWorkerSettings,
    GatewaySettings,
    PrefillWorkerSettings,
    SettingsError,
    add_flags,
    from_args,
    parse_size,
)
from engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig


def parse(cls, argv: list[str], env: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(argv), env or {})


def test_worker_defaults_are_the_engine_configs():
    decode = parse(DecodeWorkerSettings, [])
    assert decode.engine == EngineConfig(
        model=DEFAULT_MODEL, cache=CacheConfig(), scheduler=SchedulerConfig(), attention_backend="auto")
    prefill = parse(PrefillWorkerSettings, [])
    assert prefill.engine.scheduler.max_num_batched_tokens == 512  # a prefill worker's own budget
    assert prefill.engine.cache == decode.engine.cache


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
    ({}, ["--preemption-mode", "sometimes"], "preemption_mode must be"),
    ({}, ["--dtype", "int3"], "unsupported dtype"),
    ({}, ["--lease-s", "0"], "lease_s must be positive"),
])
def test_bad_values_are_one_line_errors(env, argv, message):
    with pytest.raises(SettingsError) as error:
        parse(DecodeWorkerSettings, argv, env)
    assert message in str(error.value) and "\n" not in str(error.value)


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
