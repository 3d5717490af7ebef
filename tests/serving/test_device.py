"""Device-generic engine pieces that CPU tests can check: the device and dtype
options, random-weight `dummy:` models at real shapes, the one-buffer step
upload, and the fused ops chosen by device."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from baton.cli.local import REPO_ROOT, free_port
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine import LLM, SamplingParams
from engine.config import EngineConfig, engine_config
from engine.dummy_models import DUMMY_MODELS, dummy_model
from engine.model.dummy import random_state_dict
from engine.model.arch import parameter_shapes
from engine.model.arch import ModelArch
from engine.model.ops import select_ops
from engine.tokenizer import load_tokenizer


def test_device_and_dtype_options():
    assert EngineConfig().device == "cpu" and EngineConfig().dtype == torch.float32
    assert EngineConfig(device="cuda").dtype == torch.bfloat16, "auto is bfloat16 on CUDA"
    assert EngineConfig(device="cuda:1", dtype="fp16").dtype == torch.float16
    assert engine_config("m", device="cuda", dtype="float32").dtype == torch.float32
    for device in ("gpu", "cuda:x", "cpu:0", ""):
        with pytest.raises(ValueError, match="unknown device"):
            EngineConfig(device=device)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config("m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="unknown attention backend"):
        EngineConfig(attention_backend="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        LLM("dummy:smollm2-135m", device="cuda")


@pytest.mark.parametrize("name", sorted(DUMMY_MODELS))
def test_dummy_architectures_match_transformers_parameter_for_parameter(name):
    """Our parameter list of each dummy architecture holds exactly the numbers of
    transformers' model of the same config (built on the meta device: no memory)."""
    spec = DUMMY_MODELS[name]
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    hf_count = sum(p.numel() for p in hf_model.parameters())
    shapes = parameter_shapes(ModelArch.from_hf_config(config))
    ours = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert ours == hf_count
    if name == "llama-3.1-8b":
        assert ours == 8_030_261_248, "Llama-3.1-8B's published parameter count"


def test_dummy_model_serves_text_with_reproducible_random_weights():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = LLM("dummy:smollm2-135m", max_model_len=128, num_kv_blocks=64, seed=1)
    out = first.generate(["hello there"], params)[0]
    assert len(out.token_ids) == 6 and out.text == first.get_tokenizer().decode(out.token_ids)
    again = LLM("dummy:smollm2-135m", max_model_len=128, num_kv_blocks=64, seed=1)
    assert again.generate(["hello there"], params)[0].token_ids == out.token_ids
    other = random_state_dict(first.engine.runner.model.arch, torch.float32, "cpu", seed=2)
    assert not torch.equal(other["embed_tokens.weight"], first.engine.runner.model.embed_tokens.weight)


def test_dummy_tokenizer_round_trips_text_and_names_every_id():
    tokenizer = load_tokenizer("dummy:llama-3.1-8b")
    text = "Paged KV, 64-bit offsets: ünïcode too."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer) == DUMMY_MODELS["llama-3.1-8b"].vocab_size
    assert tokenizer.decode([1000, 128255]) == " w1000 w128255"
    assert tokenizer.eos_token_id == DUMMY_MODELS["llama-3.1-8b"].eos_token_id
    with pytest.raises(ValueError, match="unknown dummy model"):
        dummy_model("dummy:gpt-5")


def test_step_inputs_are_views_of_one_buffer():
    llm = LLM("dummy:smollm2-135m", max_model_len=128, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3))
    engine.step()  # the prompt
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    from engine.runner.forward_batch import prepare_forward_batch

    batch = prepare_forward_batch(engine.scheduler.schedule(), engine.kv_manager)
    batch.attn.check_integrity(engine.kv_layout.block_size)
    tensors = [batch.input_ids, batch.positions, batch.sample_indices, batch.attn.slot_mapping,
               batch.attn.query_start, batch.attn.seq_lens, batch.attn.block_tables]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert batch.attn.query_start.tolist() == [0, 1, 4]  # one decode, then a chunk of 3
    assert batch.input_ids.tolist()[1:] == [5, 6, 7]


def test_fused_ops_follow_the_device():
    from engine.kernels import cpu_kernels_available

    assert select_ops("cpu").name == ("cpu" if cpu_kernels_available() else "torch")
    llm = LLM("dummy:smollm2-135m", max_model_len=64, num_kv_blocks=16, attention_backend="torch")
    assert llm.engine.runner.model.ops.name == select_ops("cpu").name, "chosen by device, not backend"


def test_float16_on_cpu_takes_the_torch_paths():
    """The native CPU kernels have no float16: "auto" then picks the torch backend and ops."""
    llm = LLM("dummy:smollm2-135m", dtype="float16", max_model_len=64, num_kv_blocks=16)
    runner = llm.engine.runner
    assert (runner.backend.name, runner.model.ops.name, llm.engine.kv_cache.blocks.dtype) == (
        "torch", "torch", torch.float16)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 49152 for t in out.token_ids)
    with pytest.raises(ValueError, match="no torch.float16 kernels"):
        LLM("dummy:smollm2-135m", dtype="float16", attention_backend="cpu", max_model_len=64, num_kv_blocks=16)


def test_backend_choice_by_device_and_dtype():
    """float64 on CUDA (exact parity runs) takes the torch backend: the Triton kernels
    have no float64 dots. Neither choice touches a GPU, so this runs anywhere."""
    from engine.attention import get_attention_backend

    assert get_attention_backend("auto", "cuda", torch.float64).name == "torch"
    with pytest.raises(ValueError, match="not torch.float64"):
        get_attention_backend("triton", "cuda", torch.float64)
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        get_attention_backend("cpu", "cuda", torch.float32)


def baton_up_streams_text(tmp_path, args: list[str], colocated: bool = True) -> str:
    """`baton up` (`--colocated` unless told otherwise) with `args` serves a streamed text
    request, then stops cleanly; returns what `baton status` printed meanwhile.

    `baton up` and the processes it starts form a process group of their own: whatever of it
    is left when this returns or fails (a launcher that did not stop, a worker it left
    behind) is killed, so that nothing holds the GPU, the CPUs or a port into the next test."""
    port, http_port, admin_port = free_port(), free_port(), free_port()
    log_path = tmp_path / "baton-up.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "up", "--port", str(port), "--http-port", str(http_port),
             "--admin-port", str(admin_port),
             *(["--colocated"] if colocated else []),
             *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while "Baton is serving" not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(0.5)
        # What it prints: how it serves, and where each client sends its requests.
        while "Ctrl-C stops it." not in log_path.read_text():  # the banner's last line
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(0.1)
        banner = log_path.read_text()
        assert ("(colocated)" if colocated else "(disaggregated, KV over ipc)") in banner, banner
        assert f"baton generate --gateway 127.0.0.1:{port}" in banner, banner
        assert f"base_url http://127.0.0.1:{http_port}/v1" in banner, banner
        assert f"baton status --gateway 127.0.0.1:{admin_port}" in banner, banner
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                text="Tell me about GPUs.", sampling=pb.SamplingParams(temperature=0.0, max_tokens=12)
            )
            messages = list(stub.GenerateStream(request, timeout=300))
        assert len(messages) > 1, "tokens are streamed one message at a time"
        assert "".join(m.text for m in messages), "the dummy tokenizer decodes every id"
        assert messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        status = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--gateway",
                                 f"127.0.0.1:{admin_port}"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert status.returncode == 0, status.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=120)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # nothing of the group is left: the usual case
                pass
            process.wait()
    assert code == 0, log_path.read_text()[-5000:]
    return status.stdout


@pytest.mark.timeout(900)
def test_baton_up_serves_a_dummy_model_as_text(tmp_path):
    """A dummy model end to end on CPU: the gateway tokenizes with the dummy tokenizer,
    the worker builds the random model, text streams back."""
    baton_up_streams_text(tmp_path, ["--model", "dummy:llama-3.2-1b", "--kv-cache-memory", "64M", "--threads", "2",
                                     "--dtype", "bfloat16"])


@pytest.mark.timeout(900)
def test_baton_up_serves_a_dummy_model_disaggregated_over_ipc(tmp_path):
    """`baton up` with its prefill worker: the prompt's KV handed to the decode worker over
    ipc (shared memory on CPU, CUDA IPC on a GPU: tests/gpu/test_gpu_handoff.py), text streamed."""
    status = baton_up_streams_text(tmp_path, ["--model", "dummy:tiny", "--kv-cache-memory", "16M", "--threads", "1"],
                                   colocated=False)
    assert re.search(r"KV ipc +[1-9][0-9]* transfers, 0 failed", status), status
    assert "KV channel refused" not in status and re.search(r"refused +none", status), status
