"""Loading a sharded safetensors checkpoint: time and host memory, direct against today's
transformers path, beside reading the files once.

A random Llama-shaped model (about 2 GB in float32, untied, saved as shards of about
400 MB with an index: the layout `save_pretrained` writes) is written once into --dir.
Each measurement runs in a fresh process, repeated --rounds times in turn (A, B, C, A,
...), each process's best round counting:

    read          read every file once (16 MiB reads into one buffer): the disk's floor.
    direct        engine.model.load_model: every tensor copied from the memory-mapped shard
                  into its parameter on the target device (engine/model/checkpoint.py).
    transformers  AutoModelForCausalLM.from_pretrained, then our model assembled from it
                  (engine.model.load_from_hf_model): the path before direct loading.

Page cache: --cold drops it (writes /proc/sys/vm/drop_caches: root) before every process,
so each reads the disk; otherwise the files stay cached after the first read.

Peak host memory is the process's VmHWM (reset just before loading, torch and
transformers imported) less its RSS then, against the weights' size and the largest shard. Targets: direct
load time >= 0.5x of reading the files (read seconds / load seconds), and peak above the
baseline within the weights plus one shard on the CPU.

    python -m benchmarks.checkpoint_load                     # CPU, warm page cache
    python -m benchmarks.checkpoint_load --cold              # every process reads the disk
    python -m benchmarks.checkpoint_load --device cuda       # onto a GPU: peak within about one shard
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.load import reset_peak_rss, rss_bytes

# hidden 2048, 8 layers, 32k vocabulary, untied: 542M parameters, 2.17 GB in float32.
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "hidden_act": "silu",
}
SHARD_BYTES = 400 * 1024 * 1024


def make_checkpoint(directory: str) -> None:
    """CONFIG's weights, random, in shards of about SHARD_BYTES and an index (skipped when there)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from engine.model.checkpoint import INDEX_FILE, placements
    from engine.model.arch import ModelArch

    if os.path.isfile(os.path.join(directory, INDEX_FILE)):
        return
    os.makedirs(directory, exist_ok=True)
    config = AutoConfig.for_model(**CONFIG)
    config.save_pretrained(directory)
    plan = placements(ModelArch.from_hf_config(config))
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, placement in plan.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) >= SHARD_BYTES:
            shards.append({})
        shards[-1][name] = torch.empty(placement.shape).normal_(0.0, 0.02)
    weight_map = {}
    for index, tensors in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
    total = sum(t.nbytes for shard in shards for t in shard.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def measure(variant: str, directory: str, device: str) -> dict:
    """One measurement, in this (fresh) process."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, as by both loaders)

    from engine.model import load_from_hf_model, load_model

    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    reset_peak_rss(os.getpid())
    baseline = rss_bytes(os.getpid())
    start = time.perf_counter()
    if variant == "read":
        buffer = bytearray(16 << 20)
        view = memoryview(buffer)
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
    elif variant == "direct":
        loaded = load_model(directory, torch.float32, device=device)
    else:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
        loaded = load_from_hf_model(hf_model, None, torch.float32, directory, device=device)
        del hf_model
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"variant": variant, "seconds": seconds,
            "peak_above_baseline_bytes": rss_bytes(os.getpid(), "VmHWM") - baseline,
            "model_on_device": variant == "read" or next(loaded.model.parameters()).device.type == device.split(":")[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/baton-checkpoint-2gb")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every process")
    parser.add_argument("--variants", default="read,direct,transformers")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: run this variant
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.dir, args.device)))
        return
    make_checkpoint(args.dir)
    files = [os.path.join(args.dir, n) for n in os.listdir(args.dir) if n.endswith(".safetensors")]
    weights, largest = sum(map(os.path.getsize, files)), max(map(os.path.getsize, files))
    best: dict[str, dict] = {}
    for round_index in range(args.rounds):
        for variant in args.variants.split(","):
            if args.cold:
                subprocess.run(["sync"], check=True)
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            out = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_load", "--one", variant,
                                  "--dir", args.dir, "--device", args.device],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_index + 1} {variant:13s} {result['seconds']:6.2f} s  peak +"
                  f"{result['peak_above_baseline_bytes'] / 1e9:.2f} GB", flush=True)
            if variant not in best or result["seconds"] < best[variant]["seconds"]:
                best[variant] = result
    summary = {"device": args.device, "cold": args.cold, "weights_bytes": weights, "largest_shard_bytes": largest,
               "num_files": len(files), "best": best}
    print(f"\n{len(files)} files, {weights / 1e9:.2f} GB, largest shard {largest / 1e9:.2f} GB; "
          f"page cache {'dropped before each process' if args.cold else 'warm'}; device {args.device}")
    read = best.get("read", {}).get("seconds")
    for variant, result in best.items():
        peak = result["peak_above_baseline_bytes"]
        line = (f"  {variant:13s} {result['seconds']:6.2f} s ({weights / result['seconds'] / 1e9:.2f} GB/s)"
                f"  peak +{peak / 1e9:.2f} GB = weights x {peak / weights:.2f}, weights + {(peak - weights) / largest:+.2f} shards")
        if read and variant != "read":
            line += f"  read/load {read / result['seconds']:.2f}x"
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
