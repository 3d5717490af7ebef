"""Safetensors checkpoints read straight into our parameters, tensor by tensor, on the
engine's device in its dtype: no transformers model is built, and host memory holds at
most the file being read (memory-mapped, and unmapped before the next) beyond the
weights themselves when they live on the CPU.

A checkpoint is `model.safetensors`, shards listed by `model.safetensors.index.json`,
or, with no index, every `*.safetensors` file of the directory. Hugging Face names map
onto ours (engine/model/llama.py's LlamaForCausalLM): q/k/v rows go into one
`qkv_proj`, gate/up rows into one `gate_up_proj`, each copied into its row range of a
parameter allocated once on the device.

Every file's header is read and checked first (`inspect_checkpoint`: names, shapes,
floating-point dtypes, files the index names, complete files), so a bad checkpoint is
one CheckpointError naming the file and the tensor before any weight is read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import first_line
from engine.model.arch import ModelArch, parameter_shapes
from engine.model.fp8 import dequantize_fp8
from engine.model.quantization import Quantization
from engine.outputs import LoadReport, format_bytes

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Safetensors dtype names this loader converts from.
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
FP8_DTYPE_NAME = "F8_E4M3"  # float8_e4m3fn, the FP8 of the checkpoints served (engine/model/quantization.py)
# Static activation scales of FP8 checkpoints: read past (activations are quantized per token).
_ACTIVATION_SCALE = re.compile(r".*\.(input_scale|k_scale|v_scale)")
# Tensors some checkpoints carry that no parameter needs (older Llama exports' rotary tables).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served, in one line naming the file (and the tensor)."""


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: rows [row, row + shape[0]) of our `param`, or of
    its slice `expert` when the parameter stacks a layer's experts."""

    param: str
    row: int
    shape: tuple[int, ...]
    expert: int | None = None

    def target(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows of our parameter this tensor fills."""
        param = state[self.param]
        if self.expert is not None:
            param = param[self.expert]
        return param[self.row:self.row + self.shape[0]]


@dataclass(frozen=True)
class Checkpoint:
    """A checked safetensors checkpoint: each file (in the order read) and its tensors."""

    directory: str
    files: dict[str, tuple[str, ...]]  # path -> the tensor names to read from it
    num_bytes: int  # of the tensors to read
    # An FP8 weight's name -> (the file, the name) of its scale; the checkpoint's quantization.
    scales: dict[str, tuple[str, str]] = field(default_factory=dict)
    quantization: Quantization | None = None


def has_safetensors(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, INDEX_FILE)) or bool(_unindexed_files(directory))


def _unindexed_files(directory: str) -> list[str]:
    """With no index: model.safetensors alone if it is there, else every other *.safetensors
    file but Mistral's own format, which its repositories ship beside the transformers one."""
    if os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        return [SINGLE_FILE]
    return sorted(name for name in os.listdir(directory)
                  if name.endswith(".safetensors") and not name.startswith("consolidated"))


def placements(arch: ModelArch) -> dict[str, Placement]:
    """Hugging Face tensor name -> where it goes among our parameters (parameter_shapes)."""
    hidden, head_dim = arch.hidden_size, arch.head_dim
    q_rows, kv_rows, inter = arch.num_heads * head_dim, arch.num_kv_heads * head_dim, arch.intermediate_size
    plan = {
        "model.embed_tokens.weight": Placement("embed_tokens.weight", 0, (arch.vocab_size, hidden)),
        "model.norm.weight": Placement("norm.weight", 0, (hidden,)),
    }
    if not arch.tie_word_embeddings:
        plan["lm_head.weight"] = Placement("lm_head.weight", 0, (arch.vocab_size, hidden))
    fused = {  # HF module -> (our module, first row, rows, has a bias)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows, arch.attention_bias),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows, arch.attention_bias),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows, arch.attention_bias),
        "self_attn.o_proj": ("self_attn.o_proj", 0, hidden, arch.o_proj_bias),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter, arch.mlp_bias),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter, arch.mlp_bias),
        "mlp.down_proj": ("mlp.down_proj", 0, hidden, arch.mlp_bias),
    }
    in_features = {"self_attn.o_proj": q_rows, "mlp.down_proj": inter}
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{hf}{norm}.weight"] = Placement(f"{ours}{norm}.weight", 0, (hidden,))
        if arch.qk_norm:
            for norm in ("q_norm", "k_norm"):
                plan[f"{hf}self_attn.{norm}.weight"] = Placement(f"{ours}self_attn.{norm}.weight", 0, (head_dim,))
        for module, (target, row, rows, bias) in fused.items():
            if module.startswith("mlp.") and arch.is_sparse(i):
                continue
            columns = in_features.get(module, hidden)
            plan[f"{hf}{module}.weight"] = Placement(f"{ours}{target}.weight", row, (rows, columns))
            if bias:
                plan[f"{hf}{module}.bias"] = Placement(f"{ours}{target}.bias", row, (rows,))
        if arch.is_sparse(i):
            plan.update(_expert_placements(arch, i))
    return plan


# Each architecture's names of a sparse layer's router and of one expert's projections.
_MIXTRAL_MOE = ("block_sparse_moe", "gate", ("w1", "w3", "w2"))
_QWEN_MOE = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))


def _expert_placements(arch: ModelArch, layer: int) -> dict[str, Placement]:
    """A sparse layer's tensors: each expert's gate and up rows into its slice of our
    stacked `experts.gate_up_proj`, its down projection into `experts.down_proj`; the
    router; a shared expert and its gate."""
    moe = arch.moe
    assert moe is not None
    hidden, inter = arch.hidden_size, moe.intermediate_size
    block, router, (gate, up, down) = _MIXTRAL_MOE if arch.model_type == "mixtral" else _QWEN_MOE
    hf, ours = f"model.layers.{layer}.{block}.", f"layers.{layer}.mlp."
    plan = {f"{hf}{router}.weight": Placement(f"{ours}router.weight", 0, (moe.num_experts, hidden))}
    for expert in range(moe.num_experts):
        name = f"{hf}experts.{expert}."
        plan[f"{name}{gate}.weight"] = Placement(f"{ours}experts.gate_up_proj", 0, (inter, hidden), expert)
        plan[f"{name}{up}.weight"] = Placement(f"{ours}experts.gate_up_proj", inter, (inter, hidden), expert)
        plan[f"{name}{down}.weight"] = Placement(f"{ours}experts.down_proj", 0, (hidden, inter), expert)
    if moe.shared_intermediate_size:
        shared = moe.shared_intermediate_size
        plan[f"{hf}shared_expert.gate_proj.weight"] = Placement(
            f"{ours}shared_expert.gate_up_proj.weight", 0, (shared, hidden))
        plan[f"{hf}shared_expert.up_proj.weight"] = Placement(
            f"{ours}shared_expert.gate_up_proj.weight", shared, (shared, hidden))
        plan[f"{hf}shared_expert.down_proj.weight"] = Placement(
            f"{ours}shared_expert.down_proj.weight", 0, (hidden, shared))
        plan[f"{hf}shared_expert_gate.weight"] = Placement(f"{ours}shared_expert_gate.weight", 0, (1, hidden))
    return plan


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of `directory`, as its index names them (checked to be there)."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index_path):
        names = _unindexed_files(directory)
        if not names:
            raise CheckpointError(f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
        return [os.path.join(directory, name) for name in names]
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        if not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError("a weight_map value is not a file name")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_path}: not a safetensors index ({first_line(error, 300)})") from None
    files: dict[str, None] = {}
    for tensor, name in weight_map.items():
        path = os.path.join(directory, name)
        if path not in files:
            if not os.path.isfile(path):
                raise CheckpointError(f"{index_path} puts tensor {tensor} in {name}, which is not there")
            files[path] = None
    return sorted(files)


def inspect_checkpoint(directory: str, arch: ModelArch, quantization: Quantization | None = None) -> Checkpoint:
    """Read every header of `directory`'s checkpoint and check it against `arch`: each
    tensor a parameter needs present once with its shape and a floating-point dtype
    (or FP8 with its scale, when the checkpoint's `quantization` says so), nothing
    unknown, every file complete. Reads no weight."""
    from safetensors import SafetensorError, safe_open

    headers = _Headers(arch, quantization)
    files: dict[str, tuple[str, ...]] = {}
    for path in checkpoint_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                views = {name: f.get_slice(name) for name in f.keys()}
                files[path] = tuple(name for name, view in views.items() if headers.check(path, name, view))
        except SafetensorError as error:
            raise CheckpointError(f"{path}: not a complete safetensors file ({first_line(error, 300)})") from None
        except OSError as error:
            raise CheckpointError(f"{path}: cannot be read ({first_line(error, 300)})") from None
    missing = [name for name in headers.plan if name not in headers.found]
    if missing:
        raise CheckpointError(f"{_where(directory, missing[0])}: checkpoint lacks tensor {missing[0]}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    scales = _match_scales(headers.fp8, headers.scales, quantization) if quantization is not None else {}
    return Checkpoint(directory, files, headers.num_bytes, scales, quantization)


class _Headers:
    """What inspect_checkpoint has seen of the headers so far."""

    def __init__(self, arch: ModelArch, quantization: Quantization | None) -> None:
        self.arch, self.quantization = arch, quantization
        self.plan = placements(arch)
        self.found: dict[str, str] = {}  # HF name -> the file holding it
        self.fp8: dict[str, tuple[str, tuple[int, ...]]] = {}  # FP8 weight -> (its file, its shape)
        self.scales: dict[str, tuple[str, tuple[int, ...]]] = {}  # scale tensor -> (its file, its shape)
        self.suffix = None if quantization is None else f".{quantization.scale_suffix}"
        self.num_bytes = 0

    def check(self, path: str, name: str, view: Any) -> bool:
        """Whether tensor `name` of file `path` is a weight to read; CheckpointError when
        it cannot be one (unknown, twice, of the wrong dtype or shape)."""
        arch, dtype, shape = self.arch, view.get_dtype(), tuple(view.get_shape())
        if self.suffix is not None and name.endswith(self.suffix):
            self.scales[name] = (path, shape)
            self.num_bytes += math.prod(shape) * 4
            return False
        placement = self.plan.get(name)
        if placement is None:
            if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and arch.tie_word_embeddings):
                return False
            if self.quantization is not None and _ACTIVATION_SCALE.fullmatch(name):
                return False
            raise CheckpointError(f"{path}: tensor {name} is not a weight of this {arch.model_type} "
                                  f"model ({arch.num_layers} layers)")
        if name in self.found:
            raise CheckpointError(f"{path}: tensor {name} is also in {self.found[name]}")
        if dtype == FP8_DTYPE_NAME and self.quantization is not None and name.endswith(".weight"):
            self.fp8[name] = (path, shape)
            itemsize = 1
        elif dtype not in _FLOAT_DTYPES:
            expected = " or F8_E4M3 with its scale" if self.quantization is not None else ""
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}; expected a floating-point "
                                  f"one (F16, BF16, F32, F64{expected})")
        else:
            itemsize = _FLOAT_DTYPES[dtype].itemsize
        if shape != placement.shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}; the config "
                                  f"needs {list(placement.shape)}")
        self.found[name] = path
        self.num_bytes += math.prod(shape) * itemsize
        return True


def _where(directory: str, tensor: str) -> str:
    """The file a missing tensor should be in: the index, which names its file, or the one file."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                name = json.load(f)["weight_map"].get(tensor)
            return os.path.join(directory, name) if name else index
        except (OSError, ValueError, KeyError, AttributeError):
            return index
    names = _unindexed_files(directory)
    return os.path.join(directory, names[0]) if len(names) == 1 else directory


def _match_scales(
    fp8: dict[str, tuple[str, tuple[int, ...]]],
    scale_views: dict[str, tuple[str, tuple[int, ...]]],
    quantization: Quantization,
) -> dict[str, tuple[str, str]]:
    """Each FP8 weight's scale, checked to be there with the shape the layout needs."""
    suffix = quantization.scale_suffix
    scales = {}
    for weight, (path, (rows, columns)) in fp8.items():
        scale = weight.removesuffix("weight") + str(suffix)
        if scale not in scale_views:
            raise CheckpointError(f"{path}: tensor {weight} is FP8 but the checkpoint has no {scale}")
        scale_path, shape = scale_views[scale]
        if quantization.block_size is not None:
            block_rows, block_columns = quantization.block_size
            allowed = [(-(-rows // block_rows), -(-columns // block_columns))]
        else:  # per channel, or one per tensor
            allowed = [(rows, 1), (rows,), (1,), ()]
        if tuple(shape) not in allowed:
            raise CheckpointError(f"{scale_path}: scale {scale} has shape {list(shape)}; FP8 tensor {weight} "
                                  f"[{rows}, {columns}] needs {list(allowed[0])}")
        scales[weight] = (scale_path, scale)
    return scales


def load_checkpoint(
    checkpoint: Checkpoint, arch: ModelArch, dtype: torch.dtype, device: torch.device | str
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Our parameters (names as parameter_shapes) on `device` in `dtype`, read from
    `checkpoint` one file and one tensor at a time; and what was read, how fast.

    Each file is memory-mapped (safetensors) and every tensor copied from the mapping
    into its rows of the parameter, converted on the way (on the device, for CUDA). The
    kernel is asked to read the file, and the next one, ahead of the copies, so the disk
    works while the copies run; a file is unmapped before the next is opened."""
    from safetensors import safe_open

    device = torch.device(device)
    plan = placements(arch)
    state = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in parameter_shapes(arch).items()}
    scales = _read_scales(checkpoint, device)
    block_size = checkpoint.quantization.block_size if checkpoint.quantization is not None else None
    progress = _Progress(checkpoint)
    non_blocking = device.type == "cuda"  # pageable memory: returns once staged, converts on the device
    paths = list(checkpoint.files)
    start = time.perf_counter()
    _read_ahead(paths[0])
    for index, path in enumerate(paths):
        if index + 1 < len(paths):
            _read_ahead(paths[index + 1])
        with safe_open(path, framework="pt") as f:
            for name in checkpoint.files[path]:
                placement = plan[name]
                source = f.get_tensor(name)  # memory-mapped: its pages are read as the copy touches them
                if name in scales:  # FP8: dequantized on the device, then converted
                    weight = source.to(device, non_blocking=non_blocking)
                    placement.target(state).copy_(dequantize_fp8(weight, scales[name], block_size))
                    del weight
                else:
                    placement.target(state).copy_(source, non_blocking=non_blocking)
                progress.tensor_done(source.nbytes)
                del source
        del f  # unmaps the file
        progress.file_done(path)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = LoadReport("safetensors", checkpoint.directory, len(checkpoint.files),
                        sum(len(names) for names in checkpoint.files.values()), checkpoint.num_bytes,
                        time.perf_counter() - start)
    progress.close()
    return state, report


def _read_scales(checkpoint: Checkpoint, device: torch.device) -> dict[str, torch.Tensor]:
    """Every FP8 weight's scale (float32, on `device`), read before the weights: a scale
    may sit in another shard than its weight, and all of them are small."""
    from safetensors import safe_open

    by_file: dict[str, list[tuple[str, str]]] = {}
    for weight, (path, scale) in checkpoint.scales.items():
        by_file.setdefault(path, []).append((weight, scale))
    scales = {}
    for path, pairs in by_file.items():
        with safe_open(path, framework="pt") as f:
            for weight, scale in pairs:
                scales[weight] = f.get_tensor(scale).to(device, torch.float32)
    return scales


def _read_ahead(path: str) -> None:
    """Ask the kernel to start reading `path` into the page cache (it returns at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):  # only a hint (and not on every platform)
        pass


class _Progress:
    """A progress bar on a terminal (bytes and tensors, per file); else one log line per file."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.num_files = len(checkpoint.files)
        self.file_index = 0
        self.file_bytes = self.file_tensors = 0
        self.file_start = time.perf_counter()
        self.bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=checkpoint.num_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=f"loading {self.num_files} file(s)", leave=False)

    def tensor_done(self, num_bytes: int) -> None:
        self.file_bytes += num_bytes
        self.file_tensors += 1
        if self.bar is not None:
            self.bar.update(num_bytes)
            self.bar.set_postfix_str(f"file {self.file_index + 1}/{self.num_files}, "
                                     f"{self.file_tensors} tensors", refresh=False)

    def file_done(self, path: str) -> None:
        self.file_index += 1
        if self.bar is None:
            seconds = time.perf_counter() - self.file_start
            logger.info("loaded %s (%d/%d): %d tensors, %s in %.2f s", os.path.basename(path),
                        self.file_index, self.num_files, self.file_tensors, format_bytes(self.file_bytes), seconds)
        self.file_bytes = self.file_tensors = 0
        self.file_start = time.perf_counter()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
