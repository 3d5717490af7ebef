"""FP8 checkpoints and `--quantization fp8`: which weights are FP8, in what layout, and
what the loader does with them.

The two formats people download:

    quant_method         as shipped by                     weight scales                 tensor
    fp8                  Qwen's and DeepSeek's -FP8        one per 128x128 block         <name>.weight_scale_inv
                         (weight_block_size [128, 128])
    compressed-tensors   the -FP8-dynamic / -FP8 releases  one per output channel,       <name>.weight_scale
    (float-quantized)    (llm-compressor)                  or one per tensor

In both the scale MULTIPLIES the float8_e4m3fn value (W = W_fp8 * scale). Which
weights are FP8 is read from the checkpoint itself: a tensor stored as F8_E4M3 must
come with its scale, and every other tensor (the embeddings, norms, the routers, the
modules a config ignores) is 16-bit as usual. The config is read for the layout, by
compressed-tensors' own parser for its format.

Activations are quantized per token on the fly (per token per 128-group for block
weights), whatever the checkpoint says: `input_scale` tensors of static schemes are
read past.

What the loader does (engine/model/loader.py): every FP8 tensor is dequantized as it
is read, into the model's dtype, so CPU serving (and CI) runs the checkpoint's exact
weights in 16 or 32 bits; on CUDA the linear layers and experts are then quantized
back to FP8 in the checkpoint's layout (`Quantization.layout`), which recovers the
checkpoint's values wherever a block's (channel's) largest weight was written as
448 x scale, as quantizers write it. `--quantization fp8` does the same to a 16-bit
checkpoint: per-channel weights, dynamic per-token activations, as vLLM's flag does;
on CPU the weights are quantized and dequantized at load, so the CPU serves the
FP8-rounded model a GPU would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.config import QUANTIZATION_CHOICES

SUPPORTED_QUANT_METHODS = ("fp8", "compressed-tensors")


class QuantizationError(ValueError):
    """A quantization config Baton cannot serve, in one line naming it and what is supported."""


@dataclass(frozen=True)
class Quantization:
    """How a model's linear weights are (or become) FP8."""

    method: str  # "fp8" | "compressed-tensors" | "online" (--quantization fp8)
    layout: Literal["block", "channel"]  # the FP8 layers' scales on CUDA
    block_size: tuple[int, int] | None = None  # (rows, columns) of a block scale
    scale_suffix: str | None = None  # the checkpoint's scale tensors: "weight_scale_inv" or "weight_scale"

    @property
    def from_checkpoint(self) -> bool:
        return self.method != "online"

    def describe(self) -> str:
        shape = f"{self.block_size[0]}x{self.block_size[1]} blocks" if self.block_size else "per channel"
        where = f"{self.method} checkpoint" if self.from_checkpoint else "quantized at load"
        return f"fp8 ({shape}, {where})"


ONLINE_FP8 = Quantization("online", "channel")


def read_quantization(config: Any, requested: str | None = None) -> Quantization | None:
    """The quantization of a transformers `config` (its `quantization_config`), or the
    `requested` one (`--quantization`) for a 16-bit checkpoint; QuantizationError for a
    method, format or scheme not served here."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"unsupported quantization {requested!r}; supported: "
                                + ", ".join(QUANTIZATION_CHOICES))
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return ONLINE_FP8 if requested == "fp8" else None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method == "fp8":
        found = _fp8_config(raw)
    elif method == "compressed-tensors":
        found = _compressed_tensors_config(raw)
    else:
        raise QuantizationError(f"unsupported quant_method {method!r}; supported: "
                                + ", ".join(SUPPORTED_QUANT_METHODS) + " (FP8), or a 16-bit checkpoint")
    # An FP8 checkpoint with --quantization fp8 is served as it is.
    return found


def _fp8_config(raw: dict[str, Any]) -> Quantization:
    """transformers' FineGrainedFP8Config as Qwen and DeepSeek ship it."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 fmt {fmt!r} is not supported; only e4m3 (float8_e4m3fn)")
    block = raw.get("weight_block_size")
    if block is None:  # vLLM's per-tensor serialization: one weight_scale per tensor
        return Quantization("fp8", "channel", None, "weight_scale")
    if len(block) != 2 or not all(isinstance(n, int) and n > 0 for n in block):
        raise QuantizationError(f"fp8 weight_block_size {block!r} is not two positive integers")
    return Quantization("fp8", "block", (block[0], block[1]), "weight_scale_inv")


def _compressed_tensors_config(raw: dict[str, Any]) -> Quantization:
    """compressed-tensors' float-quantized FP8 (W8A8 with dynamic or static activations,
    or FP8 weights alone), parsed by compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        parsed = QuantizationConfig.model_validate(raw)
    except ValueError as error:
        raise QuantizationError(f"compressed-tensors config does not parse: {str(error).splitlines()[0]}") from None
    if parsed.format not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors format {parsed.format!r} is not supported; only "
                                "float-quantized (FP8)")
    layouts = set()
    for name, scheme in parsed.config_groups.items():
        weights = scheme.weights
        if weights is None or weights.type != "float" or weights.num_bits != 8:
            raise QuantizationError(f"compressed-tensors group {name}: only 8-bit float weights (FP8) are supported")
        strategy = str(getattr(weights.strategy, "value", weights.strategy))
        if strategy == "block":
            block = tuple(weights.block_structure or ())
            if len(block) != 2:
                raise QuantizationError(f"compressed-tensors group {name}: block strategy without a 2-D block")
            layouts.add(("block", block))
        elif strategy in ("channel", "tensor"):
            layouts.add(("channel", None))
        else:
            raise QuantizationError(f"compressed-tensors group {name}: weight strategy {strategy!r} is not "
                                    "supported; channel, tensor or block")
        activations = scheme.input_activations
        if activations is not None and (activations.type != "float" or activations.num_bits != 8):
            raise QuantizationError(f"compressed-tensors group {name}: activations must be FP8 or unquantized")
    if len(layouts) != 1:
        raise QuantizationError("compressed-tensors groups of different weight strategies are not supported")
    layout, block = layouts.pop()
    return Quantization("compressed-tensors", layout, block, "weight_scale")


# Our linear layers whose weights are FP8 when a model is (engine/model/arch.py's
# names): every projection of attention, the dense MLPs, the experts and the shared
# expert. The embeddings, the LM head, the routers and the shared expert's gate stay in
# the model's dtype, as the FP8 releases keep them.
_QUANTIZED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                      "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")
_EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_quantized_weight(name: str) -> bool:
    """Whether our parameter `name` is an FP8 weight in a quantized model."""
    return name.endswith(tuple(f"{linear}.weight" for linear in _QUANTIZED_LINEARS)) or name.endswith(_EXPERT_WEIGHTS)


def round_trip_fp8(state: dict, quantization: Quantization) -> int:
    """`--quantization fp8` on a CPU: each weight that would be FP8 quantized (per
    channel, or in the layout's blocks) and dequantized in place, so the CPU serves the
    weights a GPU multiplies by. Returns how many tensors changed."""
    import torch

    from engine.model.fp8 import dequantize_fp8, quantize_fp8

    strategy = "block" if quantization.layout == "block" else "channel"
    block = quantization.block_size or (128, 128)
    count = 0
    for name, tensor in state.items():
        if not is_quantized_weight(name):
            continue
        rows = tensor.reshape(-1, tensor.shape[-1]) if strategy == "channel" else None
        if rows is not None:  # per channel: an expert's rows are channels like any other
            weight_fp8, scale = quantize_fp8(rows, "channel")
            tensor.copy_(dequantize_fp8(weight_fp8, scale).view(tensor.shape))
        else:
            for matrix in tensor.view(-1, *tensor.shape[-2:]):
                weight_fp8, scale = quantize_fp8(matrix, "block", block)
                matrix.copy_(dequantize_fp8(weight_fp8, scale, block))
        count += 1
        del rows
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return count


def quantize_model(model: Any, quantization: Quantization) -> int:
    """On CUDA: every linear layer `is_quantized_weight` names becomes an Fp8Linear, and
    every layer's experts FP8 with their scales (the fused-MoE kernel reads them), in the
    quantization's layout. Only names are held while replacing, so each 16-bit weight is
    freed once its FP8 copy replaces it. Returns how many tensors became FP8."""
    from torch import nn

    from engine.model.fp8 import Fp8Linear, quantize_fp8
    from engine.model.mlp import Experts

    block = quantization.block_size if quantization.layout == "block" else None
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and is_quantized_weight(f"{name}.weight")]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        if block is None:
            layer = Fp8Linear.quantize(child.weight, child.bias)
        else:
            weight_fp8, scale = quantize_fp8(child.weight.detach(), "block", block)
            layer = Fp8Linear.from_weights(weight_fp8, scale, child.bias, block)
        setattr(parent, child_name, layer)
        del child
    experts = [module for module in model.modules() if isinstance(module, Experts)]
    for module in experts:
        module.quantize_fp8(block)
    return len(names) + 2 * len(experts)
