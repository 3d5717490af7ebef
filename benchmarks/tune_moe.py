"""Tune the fused MoE kernel's tiles (engine/kernels/triton_moe.py) on this GPU and
record them where `moe_config` reads them: one JSON file per (experts, hidden,
intermediate per shard, device, dtype) under engine/kernels/moe_configs/, mapping each
batch-size bucket to the fastest config found (vLLM's `benchmark_moe.py --tune` in
the same format of buckets).

For each batch size every candidate config times one whole `fused_moe` call (routing
alignment, both grouped GEMMs, SiLU-and-mul, the sum over the k slots) with random
weights and a softmax router's top-k; one config serves both GEMMs, as the alignment's
BLOCK_M is shared. Candidates that do not compile on this GPU (shared memory) are
skipped. Needs a CUDA GPU. The full space is a few hundred configs per batch size
at decode sizes and 1536 at the largest, each compiled once; --quick searches 32-128.

    python -m benchmarks.tune_moe --model qwen3-30b-a3b --dtype bfloat16
    python -m benchmarks.tune_moe --model mixtral-8x7b --tp 2 --dtype fp8_w8a8
    python -m benchmarks.tune_moe --experts 64 --top-k 6 --hidden 2048 --intermediate 1408 --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer: `intermediate` is per expert and per tensor-parallel shard."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int


MODELS = {
    "qwen3-30b-a3b": MoeShape(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral-8x7b": MoeShape(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
}
DTYPES = ("bfloat16", "float16", "fp8_w8a8", "fp8_w8a8_block_128x128")
# vLLM's buckets: dense at decode sizes, where the best tiles change fastest.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)

FULL_SPACE = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128, 256), BLOCK_K=(64, 128, 256),
                  GROUP_M=(1, 16, 32, 64), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
QUICK_SPACE = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(64, 128), BLOCK_K=(64, 128), GROUP_M=(1, 16),
                   num_warps=(4, 8), num_stages=(3, 4))


def candidate_configs(num_tokens: int, shape: MoeShape, dtype: str, quick: bool) -> Iterator[dict[str, int]]:
    """The search space, pruned: BLOCK_M at most twice the rows an expert gets on
    average (bigger blocks would be mostly padding), and with block-wise FP8 a BLOCK_K
    that divides the 128-wide scale block."""
    space = QUICK_SPACE if quick else FULL_SPACE
    rows_per_expert = math.ceil(num_tokens * shape.top_k / shape.num_experts)
    max_block_m = max(16, 2 * (1 << (rows_per_expert - 1).bit_length()))
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values))
        if config["BLOCK_M"] > max_block_m:
            continue
        if dtype.startswith("fp8_w8a8_block") and 128 % config["BLOCK_K"] != 0:
            continue
        yield config


@dataclass
class MoeInputs:
    """A layer's weights and one batch's routing, on the GPU."""

    hidden: torch.Tensor  # [M, H]
    topk_weights: torch.Tensor  # [M, k] float32
    topk_ids: torch.Tensor  # [M, k] int32
    weights: dict  # fused_moe's weight arguments: w13, w2 and for FP8 their scales and block_shape


def make_inputs(shape: MoeShape, num_tokens: int, dtype: str, device: torch.device) -> MoeInputs:
    from engine.kernels.triton_moe import FP8_DTYPE

    gen = torch.Generator(device=device).manual_seed(0)
    num_experts, hidden, inter = shape.num_experts, shape.hidden, shape.intermediate
    act_dtype = torch.float16 if dtype == "float16" else torch.bfloat16

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(num_experts, rows, cols, generator=gen, device=device, dtype=act_dtype) / cols**0.5
        return w.to(FP8_DTYPE) if dtype.startswith("fp8") else w

    w13, w2 = weight(2 * inter, hidden), weight(hidden, inter)
    weights: dict = dict(w13=w13, w2=w2)
    if dtype == "fp8_w8a8":
        weights.update(w13_scale=torch.rand(num_experts, 2 * inter, device=device) / 448,
                       w2_scale=torch.rand(num_experts, hidden, device=device) / 448)
    elif dtype.startswith("fp8_w8a8_block"):
        weights.update(
            w13_scale=torch.rand(num_experts, math.ceil(2 * inter / 128), math.ceil(hidden / 128), device=device),
            w2_scale=torch.rand(num_experts, math.ceil(hidden / 128), math.ceil(inter / 128), device=device),
            block_shape=(128, 128),
        )
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    topk_weights, topk_ids = logits.softmax(-1).topk(shape.top_k, dim=-1)
    return MoeInputs(
        hidden=torch.randn(num_tokens, hidden, generator=gen, device=device, dtype=act_dtype),
        topk_weights=topk_weights / topk_weights.sum(-1, keepdim=True),
        topk_ids=topk_ids.to(torch.int32),
        weights=weights,
    )


def time_config(inputs: MoeInputs, config: dict[str, int], iters: int) -> float | None:
    """Median seconds of one fused_moe call with these tiles; None if they do not compile here."""
    from triton.runtime.errors import OutOfResources

    from benchmarks.gpu_bandwidth import time_on_device
    from engine.kernels.triton_moe import fused_moe

    def call() -> torch.Tensor:
        return fused_moe(inputs.hidden, topk_weights=inputs.topk_weights, topk_ids=inputs.topk_ids,
                         config=config, **inputs.weights)

    try:
        call()
    except OutOfResources:
        return None
    return statistics.median(time_on_device(call, inputs.hidden.device, iters))


def tune(shape: MoeShape, dtype: str, batch_sizes: tuple[int, ...], iters: int,
         quick: bool) -> dict[int, tuple[dict[str, int], float]]:
    """Batch size -> (fastest config, its median seconds)."""
    device = torch.device("cuda")
    best: dict[int, tuple[dict[str, int], float]] = {}
    for num_tokens in batch_sizes:
        inputs = make_inputs(shape, num_tokens, dtype, device)
        timed = []
        for config in candidate_configs(num_tokens, shape, dtype, quick):
            seconds = time_config(inputs, config, iters)
            if seconds is not None:
                timed.append((seconds, config))
        if not timed:
            raise RuntimeError(f"no candidate config compiled for batch {num_tokens}")
        seconds, config = min(timed, key=lambda pair: pair[0])
        best[num_tokens] = (config, seconds)
        print(f"batch {num_tokens:5d}: {seconds * 1e6:9.1f} us  {config}  ({len(timed)} configs)", flush=True)
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="a preset shape")
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None, help="per expert, before --tp")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel shards: each holds intermediate / tp")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="comma-separated")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per config")
    parser.add_argument("--quick", action="store_true", help="a small search space (minutes, not an hour)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: engine/kernels/moe_configs")
    args = parser.parse_args(argv)
    preset = MODELS.get(args.model)
    fields = dict(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate)
    values = {name: value if value is not None else (getattr(preset, name) if preset else None)
              for name, value in fields.items()}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        parser.error(f"give --model or every shape flag (missing: {', '.join(missing)})")
    if values["intermediate"] % args.tp != 0:
        parser.error(f"--tp {args.tp} does not divide the intermediate size {values['intermediate']}")
    values["intermediate"] //= args.tp
    args.shape = MoeShape(**values)
    args.batch_sizes = tuple(int(size) for size in args.batch_sizes.split(",") if size)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe times kernels on a CUDA GPU; none is available here")
    from engine.kernels.triton_moe import MOE_CONFIG_DIR, moe_config_file_name

    shape = args.shape
    device_name = torch.cuda.get_device_name()
    print(f"tuning {shape} {args.dtype} on {device_name}", flush=True)
    best = tune(shape, args.dtype, args.batch_sizes, args.iters, args.quick)
    out_dir = args.out_dir or MOE_CONFIG_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / moe_config_file_name(shape.num_experts, shape.hidden, shape.intermediate, args.dtype,
                                          device_name)
    path.write_text(json.dumps({str(size): config for size, (config, _) in sorted(best.items())}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
