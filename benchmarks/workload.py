"""Synthetic request workloads shared by the benchmarks.

A workload is a fixed-seed list of requests: random prompt token ids (above the
special-token range) and a requested output length per request. Every system
under test gets the same list, ignores EOS, and decodes greedily, so each one
does exactly the same amount of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of a synthetic workload. Bounds are inclusive."""

    num_requests: int = 64
    min_prompt_len: int = 16
    max_prompt_len: int = 512
    min_output_len: int = 8
    max_output_len: int = 256
    # Ids below this are left out of prompts: small ids are the special tokens
    # (bos/eos/pad, chat markers) in the Llama-family vocabularies we serve.
    min_token_id: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests <= 0:
            raise ValueError("num_requests must be positive")
        if not 0 < self.min_prompt_len <= self.max_prompt_len:
            raise ValueError("need 0 < min_prompt_len <= max_prompt_len")
        if not 0 < self.min_output_len <= self.max_output_len:
            raise ValueError("need 0 < min_output_len <= max_output_len")
        if self.min_token_id < 0:
            raise ValueError("min_token_id must be >= 0")


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(vocab_size: int, config: WorkloadConfig = WorkloadConfig()) -> list[BenchRequest]:
    """Draw `config.num_requests` requests.

    Prompt lengths are uniform integers in [min_prompt_len, max_prompt_len];
    prompt ids are uniform in [min_token_id, vocab_size); output lengths are
    log-uniform in [min_output_len, max_output_len], rounded to integers, so
    short answers are common and long ones rare, as in chat traffic.
    """
    if vocab_size <= config.min_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above {config.min_token_id}")
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    prompt_lens = rng.integers(config.min_prompt_len, config.max_prompt_len, size=n, endpoint=True)
    log_lens = rng.uniform(math.log(config.min_output_len), math.log(config.max_output_len), size=n)
    output_lens = np.clip(np.rint(np.exp(log_lens)), config.min_output_len, config.max_output_len)
    requests = []
    for i in range(n):
        prompt = rng.integers(config.min_token_id, vocab_size, size=int(prompt_lens[i]))
        requests.append(
            BenchRequest(
                request_id=f"req-{i}",
                prompt_token_ids=[int(t) for t in prompt],
                max_tokens=int(output_lens[i]),
            )
        )
    return requests


def total_output_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.max_tokens for r in requests)


def total_prompt_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.num_prompt_tokens for r in requests)
