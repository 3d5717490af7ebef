"""Checkpoints as users keep them: safetensors files (one, or shards and an index) read
straight into our parameters, by path and by hub id from the local Hugging Face cache's
layout, with no network; a model that is not there, or a broken checkpoint, is one line
naming the file (and tensor) and exit 2, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from baton.cli.local import REPO_ROOT
from engine import LLM, SamplingParams
from engine.dummy_models import DummyModel
from engine.model.arch import ModelArch
from engine.model.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    inspect_checkpoint,
    load_checkpoint,
)
from engine.model.loader import _state_dict_from_hf, read_config
from engine.tokenizer import dummy_tokenizer, resolve_source
from tests.support.tiny_models import hf_greedy, make_tiny_model


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


# ---------------------------------------------------------------- direct safetensors loading
def save_checkpoint(model, directory, shards: int) -> str:
    """`model` saved by transformers into `directory`: one model.safetensors, or `shards`
    files and their index."""
    if shards == 1:
        model.save_pretrained(directory)
    else:
        total = sum(tensor.nbytes for tensor in model.state_dict().values())
        model.save_pretrained(directory, max_shard_size=int(total / (shards - 0.5)))
    files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    assert len(files) == shards and (shards == 1) != os.path.isfile(os.path.join(directory, INDEX_FILE)), files
    return str(directory)


def hf_state(directory: str, dtype: torch.dtype, arch: ModelArch) -> dict[str, torch.Tensor]:
    """Our parameters as transformers loads the checkpoint (q/k/v, gate/up concatenated)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    return _state_dict_from_hf(hf_model, arch, dtype, "cpu")


CHECKPOINTS = [  # arch, tied, shards
    ("llama", True, 1),
    ("llama", False, 3),
    ("qwen2", True, 3),  # q/k/v biases
    ("mistral", False, 1),
    ("qwen3", False, 1),  # q_norm, k_norm
    ("qwen3_moe", False, 3),  # per-expert tensors into stacked parameters, across shards
    ("mixtral", True, 1),  # block_sparse_moe.experts.N.w1/w2/w3
    ("qwen2_moe", False, 3),  # a shared expert and its gate
]
# What each architecture's tiny model needs beyond make_tiny_model's defaults.
EXTRA = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40},
}


@pytest.mark.parametrize("arch, tied, shards", CHECKPOINTS)
def test_safetensors_load_equals_transformers_bit_for_bit(tmp_path, arch, tied, shards):
    model, _ = make_tiny_model(tmp_path / "made", arch, 4, 2, 16, tied, dtype=torch.float32, **EXTRA.get(arch, {}))
    directory = save_checkpoint(model, tmp_path / "ckpt", shards)
    source = resolve_source(directory)
    _, model_arch = read_config(source)
    checkpoint = inspect_checkpoint(directory, model_arch)
    assert len(checkpoint.files) == shards
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # converted as transformers does
        state, report = load_checkpoint(checkpoint, model_arch, dtype, "cpu")
        expected = hf_state(directory, dtype, model_arch)
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert state[name].dtype == dtype and torch.equal(state[name], tensor), name
        assert report.format == "safetensors" and report.num_files == shards
        assert report.num_bytes == sum(tensor.numel() for tensor in expected.values()) * 4  # read as saved: float32


@pytest.mark.parametrize("arch, tied, shards", CHECKPOINTS)
def test_greedy_parity_by_path_and_by_hub_id(tmp_path, hub_cache, arch, tied, shards):
    model, _ = make_tiny_model(tmp_path / "made", arch, 4, 2, 16, tied, dtype=torch.float64, **EXTRA.get(arch, {}))
    snapshot = cache_snapshot(hub_cache, f"acme/tiny-{arch}")
    prompt = [5, 9, 17, 33, 60, 7, 101]
    expected = hf_greedy(model, prompt, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    save_checkpoint(model, snapshot, shards)
    for name in (save_checkpoint(model, tmp_path / "ckpt", shards), f"acme/tiny-{arch}"):
        llm = LLM(name, dtype="float64", block_size=4)
        assert llm.engine.model_load.format == "safetensors" and llm.engine.model_load.num_files == shards
        assert llm.generate([prompt], [params])[0].token_ids == expected, name


def test_revision_tokenizer_and_served_name(tmp_path, hub_cache):
    """A hub id at a revision other than main, the tokenizer from its own directory, and the
    name clients see."""
    model, _ = make_tiny_model(tmp_path / "made", "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=300)
    old = cache_snapshot(hub_cache, "acme/tiny", revision="a" * 40)
    save_checkpoint(model, old, 1)
    other, _ = make_tiny_model(tmp_path / "other", "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=300,
                               seed=1)
    refs = hub_cache / "models--acme--tiny" / "refs"
    (refs / "v2").write_text("b" * 40)
    new = hub_cache / "models--acme--tiny" / "snapshots" / ("b" * 40)
    new.mkdir()
    save_checkpoint(other, new, 1)
    tokenizer_dir = tmp_path / "tokenizer"
    dummy_tokenizer(DummyModel("llama", {"vocab_size": 300, "eos_token_id": 2})).save_pretrained(tokenizer_dir)
    prompt = [5, 9, 17, 33]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for revision, reference in ((None, model), ("v2", other), ("b" * 40, other)):
        llm = LLM("acme/tiny", revision=revision, tokenizer=str(tokenizer_dir), served_model_name="tiny-chat",
                  dtype="float64", block_size=4)
        assert llm.engine.model_name == "tiny-chat"
        assert llm.engine.tokenizer is not None and llm.engine.tokenizer.decode([104, 105]) == "hi"
        assert llm.generate([prompt], [params])[0].token_ids == hf_greedy(reference, prompt, 6), revision


PEAK_SCRIPT = """
import json, sys, torch
from engine.model.checkpoint import inspect_checkpoint, load_checkpoint
from engine.model.loader import read_config
from engine.tokenizer import resolve_source

def rss_bytes(field):  # /proc read here: this process imports no more than the loader needs
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":")) * 1024

directory, dtype = sys.argv[1], getattr(torch, sys.argv[2])
_, arch = read_config(resolve_source(directory))
checkpoint = inspect_checkpoint(directory, arch)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: not a peak reached while importing
baseline = rss_bytes("VmRSS")
state, report = load_checkpoint(checkpoint, arch, dtype, "cpu")
print(json.dumps({"peak": rss_bytes("VmHWM") - baseline, "weights": sum(t.nbytes for t in state.values())}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_holds_the_weights_and_at_most_one_shard_more(tmp_path, dtype):
    """Host memory while loading, measured in a fresh process: above its baseline the peak
    is the weights plus at most one shard (the file mapped while its tensors are copied),
    whether they are copied as saved (float32) or converted (bfloat16). The checkpoint:
    ~160 MB of float32 in 4 shards."""
    model, _ = make_tiny_model(tmp_path / "made", "llama", 8, 4, 64, False, dtype=torch.float32,
                               hidden_size=512, num_layers=8, vocab_size=20000)
    directory = save_checkpoint(model, tmp_path / "ckpt", 4)
    model_state = [t for name, t in model.state_dict().items()]
    shard = max(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
                if name.endswith(".safetensors"))
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, directory, dtype], capture_output=True, text=True,
                            timeout=300, cwd=REPO_ROOT, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["weights"] == sum(t.numel() for t in model_state) * getattr(torch, dtype).itemsize
    # The interpreter's and allocator's own memory while loading: under 1 MiB here, 8.05 MiB
    # on the CI machine (two runs); a second mapped shard or a second copy of the weights,
    # the faults this test is for, would add 42 MiB or 150 MiB.
    slack = 16 << 20
    assert slack < shard / 2
    assert measured["peak"] <= measured["weights"] + shard + slack, (measured, shard)


def test_what_published_checkpoints_carry_beside_the_weights(tmp_path):
    """A tied model that stores lm_head anyway, older exports' rotary inv_freq tensors, and
    Mistral's consolidated.safetensors beside model.safetensors: all skipped, output unchanged."""
    from safetensors.torch import load_file, save_file

    model, _ = make_tiny_model(tmp_path / "made", "llama", 4, 2, 16, True, dtype=torch.float64)
    directory = save_checkpoint(model, tmp_path / "ckpt", 1)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, os.path.join(directory, "consolidated.safetensors"))
    prompt = [5, 9, 17, 33, 60]
    llm = LLM(directory, dtype="float64", block_size=4)
    out = llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])[0]
    assert out.token_ids == hf_greedy(model, prompt, 8) and llm.engine.model_load.num_files == 1


def test_the_gateway_needs_only_the_tokenizer(tmp_path, hub_cache, capsys):
    """A quantized checkpoint is refused by name for the workers; the gateway, which never
    reads weights, starts its checks from --tokenizer alone, without the model's files."""
    from baton.cli.main import main
    from baton.cli.preflight import check_model
    from baton.runtime.settings import SettingsError

    model, _ = make_tiny_model(tmp_path / "made", "llama", 4, 2, 16, True, dtype=torch.float32)
    directory = save_checkpoint(model, tmp_path / "ckpt", 1)
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    capsys.readouterr()
    assert main(["decode-worker", "--model", directory]) == 2
    error = capsys.readouterr().err.strip()
    assert "quant_method 'gptq'" in error and "config.json" in error and len(error.splitlines()) == 1
    tokenizer_dir = tmp_path / "tokenizer"
    dummy_tokenizer(DummyModel("llama", {"vocab_size": 300, "eos_token_id": 2})).save_pretrained(tokenizer_dir)
    check_model("acme/not-here", tokenizer=str(tokenizer_dir), weights=False)  # no model files needed
    check_model("acme/not-here", tokenizer="dummy:llama-3.2-1b", weights=False)
    with pytest.raises(SettingsError, match="acme/not-here"):
        check_model("acme/not-here", weights=False)


# ---------------------------------------------------------------- bad checkpoints
def _broken(tmp_path, how: str) -> tuple[str, str]:
    """A 3-shard checkpoint broken `how`; returns it and what the error must name."""
    from safetensors.torch import load_file, save_file

    model, _ = make_tiny_model(tmp_path / "made", "llama", 4, 2, 16, False, dtype=torch.float32)
    directory = save_checkpoint(model, tmp_path / how, 3)
    shard = os.path.join(directory, "model-00002-of-00003.safetensors")
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    if how == "missing-shard":
        os.remove(shard)
        return directory, "model-00002-of-00003.safetensors"
    if how == "missing-shard-no-index":
        os.remove(shard)
        os.remove(os.path.join(directory, INDEX_FILE))
        return directory, "lacks tensor model.layers."
    if how == "wrong-shape":
        tensors[name] = tensors[name][:-1]
        save_file(tensors, shard, metadata={"format": "pt"})
        return shard, name
    if how == "wrong-dtype":
        tensors[name] = tensors[name].to(torch.int32)
        save_file(tensors, shard, metadata={"format": "pt"})
        return shard, name
    if how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 100)
        return shard, "not a complete safetensors file"
    if how == "index-names-nothing":
        index = json.loads(open(os.path.join(directory, INDEX_FILE)).read())
        index["weight_map"][name] = "model-00009-of-00003.safetensors"
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump(index, f)
        return "model-00009-of-00003.safetensors", name
    assert how == "unknown-architecture"
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config["model_type"] = "gpt2"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return os.path.join(directory, "config.json"), "gpt2"


BROKEN = ["missing-shard", "missing-shard-no-index", "wrong-shape", "wrong-dtype", "truncated",
          "index-names-nothing", "unknown-architecture"]


@pytest.mark.parametrize("how", BROKEN)
def test_a_bad_checkpoint_is_one_line_naming_file_and_tensor_and_exit_2(tmp_path, capsys, how):
    """Before anything starts: every role that loads weights, and `baton up`."""
    from baton.cli.main import main

    directory = str(tmp_path / how)
    must_name = _broken(tmp_path, how)
    capsys.readouterr()  # what saving the checkpoint printed
    for command in (["decode-worker"], ["prefill-worker"], ["up"]):
        assert main([*command, "--model", directory]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(part in lines[0] for part in must_name), lines
    with pytest.raises((CheckpointError, FileNotFoundError)):
        LLM(directory, dtype="float32")
