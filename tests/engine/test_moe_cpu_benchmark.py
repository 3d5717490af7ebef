"""benchmarks/moe_cpu.py end to end at a toy size (one layer, batch 4, two tokens, no
transformers round: seconds): both models decode through the engine, and the JSON holds
every figure, the bandwidth floor's among them. The figures mean nothing at this size."""

from __future__ import annotations

import json
import math

from benchmarks import moe_cpu


def test_a_toy_run_writes_every_figure(tmp_path):
    path = tmp_path / "moe.json"
    assert moe_cpu.main(["--rounds", "2", "--num-layers", "1", "--batch", "4", "--prompt-len", "4",
                         "--max-tokens", "2", "--no-hf", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert (report["batch"], report["num_layers"], report["max_tokens"]) == (4, 1, 2)
    for kind in moe_cpu.MODELS:
        assert report["warm_tokens_per_second"][kind] > 0 and report["cold_tokens_per_second"][kind] > 0
        assert report["step_ms"][kind] > 0 and report["weight_floor_ms"][kind] > 0
    assert report["read_gb_per_s"] > 0 and report["moe_over_hf_moe"] is None
    for name in ("moe_over_dense", "moe_step_over_its_floor", "moe_over_dense_bound", "moe_over_dense_weight_bytes"):
        assert math.isfinite(report[name]) and report[name] > 0, name
    assert report["passed"] == (report["moe_over_dense"] >= moe_cpu.TARGET)


def test_the_moe_reads_only_the_experts_a_batch_touches():
    """Batch 1 touches top_k of the 8 experts; a large batch touches them all."""
    one, many = (moe_cpu.weight_bytes_per_step("moe", 1, batch) for batch in (1, 4096))
    dense = moe_cpu.weight_bytes_per_step("dense", 1, 1)
    _, extra = moe_cpu.MODELS["moe"]
    expert_bytes = 4 * 3 * moe_cpu.WIDTH["hidden_size"] * extra["intermediate_size"]
    assert math.isclose(many - one, (8 - 2) * expert_bytes, rel_tol=1e-6)
    assert math.isclose(one - dense, 4 * 8 * moe_cpu.WIDTH["hidden_size"], rel_tol=1e-6)  # the router
