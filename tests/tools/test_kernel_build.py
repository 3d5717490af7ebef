"""Loading the native CPU kernels survives a loader that died while loading: torch's build
lock is a file, and one left behind by a process killed at that moment made every later
Baton process on the machine wait for it forever (engine/kernels/__init__.py). A machine
that cannot build them at all serves on the plain-torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import torch

from baton.cli.local import REPO_ROOT, start_deployment
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from tests.support.tiny_models import hf_greedy, make_tiny_model

LOAD = "from engine.kernels import load_cpu_kernels; load_cpu_kernels(); print('loaded')"


def build_directory() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory("baton_cpu_kernels", verbose=False))


def test_a_lock_left_by_a_killed_loader_does_not_hang_the_next():
    subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, check=True, timeout=600)  # built and cached
    stale = build_directory() / "lock"
    stale.touch()  # what a loader killed inside torch's build leaves
    loaded = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr[-3000:]
    assert "left by a process that died" in loaded.stderr
    assert not stale.exists()


def test_a_machine_without_a_compiler_serves_on_the_torch_path_with_one_warning(tmp_path):
    """No C++ compiler on the PATH and no cached build: `make kernels` goes on, and a
    deployment serves transformers' tokens on the plain-torch path, each worker saying
    once why (README's promise to an operator whose image lacks g++)."""
    model, path = make_tiny_model(tmp_path / "model", dtype=torch.float64)
    bare = {"PATH": str(Path(sys.executable).parent),  # python and ninja, no c++ / g++ / cc
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "CXX": ""}
    env = {key: value for key, value in os.environ.items() if key != "CXX"}
    built = subprocess.run([sys.executable, "-m", "engine.kernels"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=300, env={**env, **bare})
    assert built.returncode == 0, built.stderr[-3000:]
    assert "not built" in built.stdout and built.stderr.count("CPU kernels did not build") == 1, built.stderr
    required = subprocess.run([sys.executable, "-m", "engine.kernels", "--require"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300, env={**env, **bare})
    assert required.returncode == 1  # the images' build: no image ships without them

    deployment = start_deployment(path, tmp_path / "logs", prefill=False, env=bare,
                                  worker_args=["--dtype", "float64", "--block-size", "4"])
    try:
        prompt = list(range(30, 47))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True))
        with grpc.insecure_channel(deployment.gateway) as channel:
            answer = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
        assert list(answer.token_ids) == hf_greedy(model, prompt, 6)
        log = deployment.worker("decode").log()
        assert log.count("CPU kernels did not build") == 1, log[-5000:]
    finally:
        assert deployment.stop() == {"gateway": 0, "decode": 0}, deployment.logs()
