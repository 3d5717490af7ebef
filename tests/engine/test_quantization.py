"""FP8 checkpoints, as the two formats people download ship them, written here in code:
block-wise FP8 (`quant_method: fp8`, `weight_block_size`, `*.weight_scale_inv`: Qwen's and
DeepSeek's -FP8 releases) and compressed-tensors FP8 (per-channel or per-tensor
`*.weight_scale`: the -FP8-dynamic releases). On a CPU each loads dequantized: its logits
equal transformers' on the dequantized weights and its greedy tokens are the same.
`--quantization fp8` rounds a 16-bit checkpoint's weights through FP8 at load. Bad
quantized checkpoints are one line naming the file and tensor, exit 2."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model import load_model
from engine.model.checkpoint import CheckpointError
from engine.model.fp8 import dequantize_fp8, quantize_fp8
from engine.model.mlp import SparseMoE
from tests.engine.test_model import PagedRunner
from tests.support.tiny_models import hf_greedy, make_tiny_model

# The linear weights an FP8 release stores in FP8: attention, dense MLPs, experts, the
# shared expert; not the embeddings, the LM head, norms, routers or the shared expert's gate.
_FP8_TENSOR = re.compile(r".*\.((q|k|v|o|gate|up|down)_proj|w1|w2|w3)\.weight")
BLOCK = (32, 32)  # Qwen's are 128x128; tiny models need smaller blocks to have several, and partial ones
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True}

FORMATS = {  # name -> (quantization_config, weight strategy, scale suffix)
    "block-fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(BLOCK)}, "block", "weight_scale_inv"),
    "compressed-tensors-channel": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                   "symmetric": True}}}},
        "channel", "weight_scale"),
    "compressed-tensors-tensor": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                   "symmetric": True}}}},
        "tensor", "weight_scale"),
}


def write_fp8_checkpoint(model, directory, fmt: str) -> str:
    """`model` saved with its linear weights in FP8 as format `fmt` ships them, and beside
    it (`directory`-dequantized) the same model with the dequantized weights in 16/32 bits."""
    config, strategy, suffix = FORMATS[fmt]
    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not _FP8_TENSOR.fullmatch(name):
            quantized[name] = dequantized[name] = tensor
            continue
        weight_fp8, scale = quantize_fp8(tensor, strategy, BLOCK)
        if strategy == "channel":
            scale = scale[:, None]  # compressed-tensors writes [N, 1]
        quantized[name], quantized[f"{name.removesuffix('weight')}{suffix}"] = weight_fp8, scale
        if strategy == "tensor":  # static activation scales, which Baton reads past
            quantized[f"{name.removesuffix('weight')}input_scale"] = torch.tensor([0.05])
        dequantized[name] = dequantize_fp8(weight_fp8, scale, BLOCK if strategy == "block" else None).to(tensor.dtype)
    save_file(quantized, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**saved, "quantization_config": config}, f)
    reference = f"{directory}-dequantized"
    model.save_pretrained(reference)
    save_file(dequantized, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def reference_model(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(f"{directory}-dequantized", dtype=torch.float32,
                                                experts_implementation="eager", local_files_only=True).eval()


ARCHS = {"llama": ("llama", {}), "qwen3": ("qwen3", {}), "qwen3_moe": ("qwen3_moe", MOE)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp8_checkpoint_logits_equal_the_dequantized_model(tmp_path, fmt, arch):
    model_type, extra = ARCHS[arch]
    model, _ = make_tiny_model(tmp_path / "made", model_type, 4, 2, 16, False, dtype=torch.float32,
                               intermediate_size=80, **extra)
    directory = write_fp8_checkpoint(model, tmp_path / fmt, fmt)
    reference = reference_model(directory)
    loaded = load_model(directory, torch.float32)
    assert loaded.quantization is not None and loaded.quantization.from_checkpoint
    assert loaded.load.num_bytes < sum(t.numel() for t in reference.state_dict().values()) * 4  # FP8 read

    tokens = [5, 9, 17, 33, 60, 7, 101, 3, 44]
    runner = PagedRunner(loaded, dtype=torch.float32)
    logits = runner.step([], [("a", tokens)])
    with torch.no_grad():  # the dequantized model in float64: the exact sums ours round
        expected = reference.double()(torch.tensor([tokens])).logits[0]
    # float32 summation order alone (oneDNN and the experts kernel): 1e-5, absolute and relative.
    torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)

    llm = LLM(directory, dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert llm.generate([tokens], [params])[0].token_ids == hf_greedy(reference, tokens, 10)


def test_online_fp8_rounds_a_16_bit_checkpoint_through_fp8(tmp_path, monkeypatch):
    """`--quantization fp8`: per-channel weights; on a CPU the weights served are the
    FP8-rounded ones (what a GPU multiplies by), and the model serves."""
    _, directory = make_tiny_model(tmp_path / "bf16", "qwen3_moe", 4, 2, 16, False, dtype=torch.float32, **MOE)
    with monkeypatch.context() as patch:  # the experts in their checkpoint layout, not the CPU kernel's panels
        patch.setattr(SparseMoE, "pack_experts", lambda self: False)
        plain = load_model(directory, torch.float32)
        rounded = load_model(directory, torch.float32, quantization="fp8")
    assert rounded.quantization is not None and not rounded.quantization.from_checkpoint
    ours = dict(rounded.model.named_parameters())
    for name, tensor in plain.model.named_parameters():
        if name.endswith(("qkv_proj.weight", "o_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
            rows = tensor.reshape(-1, tensor.shape[-1])
            expected = dequantize_fp8(*quantize_fp8(rows, "channel")).view(tensor.shape)
            assert torch.equal(ours[name], expected) and not torch.equal(ours[name], tensor), name
        elif name.endswith(("norm.weight", "router.weight", "embed_tokens.weight")):
            assert torch.equal(ours[name], tensor), name
    llm = LLM(directory, dtype="float32", quantization="fp8", block_size=4)
    out = llm.generate([[5, 9, 17]], [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)])[0]
    assert len(out.token_ids) == 6


# ---------------------------------------------------------------- bad quantized checkpoints
def _broken(tmp_path, how: str) -> tuple[str, list[str]]:
    """A checkpoint broken `how`; returns it and what the one-line error must name."""
    model, _ = make_tiny_model(tmp_path / "made", "qwen3_moe", 4, 2, 16, False, dtype=torch.float32, **MOE)
    directory = str(tmp_path / how)
    path = os.path.join(directory, "model.safetensors")
    if how == "missing-expert":
        model.save_pretrained(directory)
        tensors = load_file(path)
        del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
        save_file(tensors, path, metadata={"format": "pt"})
        return directory, [path, "model.layers.1.mlp.experts.2.up_proj.weight"]
    write_fp8_checkpoint(model, directory, "block-fp8")
    if how == "missing-scale":
        tensors = load_file(path)
        del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
        save_file(tensors, path, metadata={"format": "pt"})
        return directory, [path, "model.layers.0.self_attn.k_proj.weight", "weight_scale_inv"]
    if how == "wrong-scale-shape":
        tensors = load_file(path)
        name = "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"
        tensors[name] = tensors[name][:1]
        save_file(tensors, path, metadata={"format": "pt"})
        return directory, [path, name]
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    if how == "unsupported-quant-method":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        must_name = [config_path, "'gptq'", "fp8", "compressed-tensors"]
    else:
        assert how == "compressed-tensors-int4"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                             "strategy": "group", "group_size": 128}}}}
        must_name = [config_path, "pack-quantized"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    return directory, must_name


@pytest.mark.parametrize("how", ["missing-expert", "missing-scale", "wrong-scale-shape", "unsupported-quant-method",
                                 "compressed-tensors-int4"])
def test_a_bad_quantized_or_moe_checkpoint_is_one_line_and_exit_2(tmp_path, capsys, how):
    from baton.cli.main import main

    directory, must_name = _broken(tmp_path, how)
    capsys.readouterr()
    for command in (["decode-worker"], ["up"]):
        assert main([*command, "--model", directory]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(part in lines[0] for part in must_name), lines
    with pytest.raises(CheckpointError):
        load_model(directory, torch.float32)


def test_an_unsupported_model_type_is_one_line_naming_what_is_supported(tmp_path, capsys):
    from transformers import GPT2Config

    from baton.cli.main import main

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["up", "--model", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'gpt2'" in lines[0], lines
    assert all(name in lines[0] for name in ("qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "llama")), lines
