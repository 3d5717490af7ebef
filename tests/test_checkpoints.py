"""Models named by hub id, from the local Hugging Face cache's layout, with no network; a
model that is not there is one line and exit 2, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from baton.cli.local import REPO_ROOT
from engine import LLM, SamplingParams
from engine.tokenizer import resolve_source
from tests.tiny_models import hf_greedy, make_tiny_model


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache that huggingface_hub resolves in, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_snapshot(cache, repo_id: str, revision: str = "0123abcd") -> str:
    """The directory of a snapshot of `repo_id` laid out as the hub cache keeps it, with
    refs/main naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return str(snapshot)


def test_a_hub_id_loads_from_the_local_cache_with_no_network(hub_cache):
    snapshot = cache_snapshot(hub_cache, "acme/tiny-llama")
    model, _ = make_tiny_model(snapshot, "llama", 4, 2, 16, False, dtype=torch.float64)
    assert resolve_source("acme/tiny-llama").directory == snapshot
    llm = LLM("acme/tiny-llama", dtype="float64", block_size=4)
    prompt = [5, 9, 17, 33, 60]
    out = llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])[0]
    assert out.token_ids == hf_greedy(model, prompt, 8)


def test_a_model_that_is_not_there_is_one_line_and_exit_2(hub_cache):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    for command in (["decode-worker"], ["prefill-worker"], ["up"]):
        result = subprocess.run([sys.executable, "-m", "baton.cli", *command, "--model", "acme/missing"],
                                capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "acme/missing" in lines[0] and str(hub_cache) in lines[0], result.stderr
    with pytest.raises(FileNotFoundError, match="hub id"):
        resolve_source("not a model")
