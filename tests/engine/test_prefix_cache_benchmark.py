"""benchmarks/prefix_cache.py --tier end to end at its --quick scale (SmolLM2 on the engine,
8 users x 2 turns: seconds): all four arms run, every turn is answered, the host tier gives
back what the device cache evicted (and is counted apart in the usage), and the report and
JSON hold every figure and check. How the figures compare with the targets means nothing at
this scale."""

from __future__ import annotations

import json

import pytest

from benchmarks import prefix_cache

pytestmark = pytest.mark.timeout(600)


def test_the_tier_benchmark_at_quick_scale(tmp_path, capsys):
    """The benchmark's whole run on a tiny random model (what the tier holds is a matter of
    tokens and blocks, not of the model; SmolLM2 made this 194 s of CI)."""
    path = tmp_path / "tier.json"
    code = prefix_cache.main(["--tier", "--quick", "--systems", "engine", "--model", "dummy:tiny", "--json",
                              str(path)])
    report = json.loads(path.read_text())
    assert code == (0 if all(check["met"] for check in report["checks"]) else 1)
    shape = report["shape"]
    assert (shape["users"], shape["turns"], shape["history_tokens"]) == (8, 2, 64)
    results = {(r["workload"], r["caching"]): r for r in report["results"]}
    assert set(results) == {(w, on) for w in ("shared", "fits") for on in (True, False)}
    for result in results.values():
        assert result["num_requests"] == 16 and result["num_output_tokens"] == 16 * shape["answer_tokens"]
        assert result["output_tokens_per_s"] > 0 and result["ttft_p50"] > 0
    on, off = results[("shared", True)], results[("shared", False)]
    # The device cache is too small for the conversations: the tier gives their histories back.
    assert on["host_cached_fraction"] > 0 and off["host_cached_fraction"] == 0
    assert on["cached_fraction"] > off["cached_fraction"]
    assert on["num_host_cached_tokens"] <= on["num_cached_tokens"]
    assert [check["what"] for check in report["checks"]] == [
        "engine shared: throughput on/off", "engine shared: TTFT p50 off/on", "engine fits: throughput on/off"]
    printed = capsys.readouterr().out
    assert "each user's history 64" in printed and "(host)" in printed
