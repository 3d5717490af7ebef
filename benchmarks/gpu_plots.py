"""PNG plots of a benchmarks/gpu.py payload (gpu.json), with matplotlib's Agg backend.

matplotlib is optional (the GPU machine may lack it): without it no plot is drawn
and a note says so.
"""

from __future__ import annotations

from pathlib import Path


def write_plots(payload: dict, out_dir: Path) -> list[Path]:
    """Draw what the payload's sections allow; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (gpu.json has every figure)", flush=True)
        return []
    sections = payload["sections"]
    title = f"{payload['model']} on {payload['environment']['device_name']}"
    written = []
    for name, draw in (("decode", _decode), ("roofline", _roofline), ("offline", _offline)):
        if not sections.get(name):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, sections[name])
        ax.set_title(f"{title}\n{ax.get_title()}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"gpu_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _decode(ax, section: dict) -> None:
    points = section["points"]
    batches = [p["batch_size"] for p in points]
    ax.plot(batches, [p["ms_per_token"] for p in points], "o-", label="ms per token")
    ax.plot(batches, [p["ms_per_step"] for p in points], "s--", label="ms per step")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("milliseconds")
    ax.set_title(f"decode time vs batch size, context ~{section['context_len']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _roofline(ax, section: dict) -> None:
    copy_gb_per_s = section["copy_gb_per_s"]
    for context in sorted({p["context_len"] for p in section["points"]}):
        points = [p for p in section["points"] if p["context_len"] == context]
        ax.plot([p["bytes_per_step"] / 1e9 for p in points], [p["ms_per_step"] for p in points], "o",
                label=f"context {context}")
        for p in points:
            ax.annotate(f"B={p['batch_size']}", (p["bytes_per_step"] / 1e9, p["ms_per_step"]), fontsize=7)
    largest = max(p["bytes_per_step"] for p in section["points"]) / 1e9
    ax.plot([0, largest], [0, largest / copy_gb_per_s * 1e3], color="gray", linestyle=":",
            label=f"bytes / copy bandwidth ({copy_gb_per_s:.0f} GB/s)")
    ax.set_xlabel("GB read per decode step (weights + KV)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("decode step time against bytes read")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _offline(ax, section: dict) -> None:
    workloads = list(section["workloads"])
    systems = sorted({s for w in section["workloads"].values() for s in w["systems"]})
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        values = [section["workloads"][w]["systems"].get(system, {}).get("output_tokens_per_second", 0.0)
                  for w in workloads]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(workloads))]
        bars = ax.bar(xs, values, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("output tokens / s")
    ax.set_title("offline throughput")
    ax.legend(fontsize=8)
