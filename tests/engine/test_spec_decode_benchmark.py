"""benchmarks/spec_decode.py end to end in its smoke configuration (dummy:tiny, random
weights: a few seconds): every case runs, speculative and plain greedy outputs agree, and
the JSON holds the figures. The figures themselves mean nothing for a random model."""

from __future__ import annotations

import json

from benchmarks import spec_decode


def test_smoke_runs_every_case_and_greedy_outputs_agree(tmp_path):
    path = tmp_path / "spec.json"
    cases = ",".join(spec_decode.CASES)
    assert spec_decode.main(["--smoke", "--cases", cases, "--json", str(path)]) == 0
    results = {r["case"]: r for r in json.loads(path.read_text())["cases"]}
    assert set(results) == set(spec_decode.CASES)
    for result in results.values():
        assert result["greedy_mismatches"] == []
        assert result["plain_tokens_per_s"] > 0 and result["ngram_tokens_per_s"] > 0
        assert sum(result["output_tokens_per_round"]) > 0
        assert len(result["acceptance_by_position"]) == 4
        assert result["passed"] in (True, False)
    assert results["mixed-b32"]["num_prompts"] == 4 and results["copy-b1"]["num_prompts"] == 2


def test_workloads_are_distinct_prompts():
    copies = spec_decode.copy_messages()
    assert len(set(copies)) == len(copies) == len(spec_decode.PASSAGES) * len(spec_decode.COPY_INSTRUCTIONS)
    assert len(set(spec_decode.open_messages())) == len(spec_decode.open_messages())
    mixed = spec_decode.workload_messages("mixed", 32)
    assert len(set(mixed)) == 32 and mixed[0] in copies and mixed[1] not in copies
    assert spec_decode.with_typos(spec_decode.PASSAGES[0]) != spec_decode.PASSAGES[0]
