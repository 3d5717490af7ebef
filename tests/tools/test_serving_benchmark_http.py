"""benchmarks/serving.py over both front ends: its HTTP client against a real deployment
(a tiny random Llama with SmolLM2's tokenizer, gateway + one worker, HTTP on), timed as
its gRPC client times the same requests; `--target` measuring both front ends of that
running gateway, with the report's HTTP/gRPC checks and its plot; and the per-pass
prompts no prefix cache can serve from an earlier pass."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from benchmarks import serving
from benchmarks.serving_clients import Workload, drive_grpc, drive_http, parse_targets
from benchmarks.workload import WorkloadConfig, make_workload
from engine.tokenizer import load_tokenizer
from tests.serving.test_serving import VOCAB_SIZE
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

SHAPE = ["--num-requests", "6", "--min-prompt-len", "4", "--max-prompt-len", "40", "--min-output-len", "2",
         "--max-output-len", "12"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-bench")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    return path


@pytest.fixture(scope="module")
def deployment(model_path, tmp_path_factory):
    """Colocated (the fewest processes to start): the front ends are the gateway's alone."""
    from baton.cli.local import start_deployment

    deployment = start_deployment(model_path, tmp_path_factory.mktemp("logs"), prefill=False, http_port=0)
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0}, deployment.logs()


def workload(num_requests: int = 6) -> Workload:
    requests = make_workload(VOCAB_SIZE, WorkloadConfig(num_requests=num_requests, min_prompt_len=4, max_prompt_len=40,
                                                        min_output_len=2, max_output_len=12))
    return Workload(requests, [0.02 * i for i in range(num_requests)])


def test_the_http_client_times_what_the_grpc_client_does(deployment):
    passes = workload()
    requests = passes.fresh()
    over_http = asyncio.run(drive_http(deployment.http, requests, passes.offsets))
    over_grpc = asyncio.run(drive_grpc(deployment.gateway, requests, passes.offsets))
    for request, http, grpc in zip(requests, over_http, over_grpc):
        assert http.status == grpc.status == "OK"
        assert http.num_output_tokens == grpc.num_output_tokens == request.max_tokens
        # One entry per token (usage's count), in order, the first (TTFT) after the send.
        assert len(http.token_times) == request.max_tokens
        assert 0 < http.token_times[0] and http.token_times == sorted(http.token_times)
        assert http.token_times[-1] <= http.finished


def test_target_measures_both_front_ends_of_a_running_gateway(deployment, model_path, tmp_path, capsys):
    out = tmp_path / "serving.json"
    targets = f"grpc://{deployment.gateway},http://{deployment.http}"
    serving.main(["--model", model_path, "--target", targets, "--rate", "inf", "--json", str(out), *SHAPE])
    payload = json.loads(out.read_text())
    grpc, http = f"grpc://{deployment.gateway}", f"http://{deployment.http}"
    assert list(payload["results"]) == [grpc, http]
    total = sum(r.max_tokens for r in workload().requests)
    for result in payload["results"].values():
        assert (result["num_requests"], result["num_output_tokens"]) == (6, total)
        assert result["ttft"]["p50"] > 0 and result["output_tokens_per_s"] > 0
    checks = {check["name"]: check for check in payload["checks"]}
    throughput = checks[f"{http} / {grpc} output tok/s"]
    assert throughput["target"] == 0.95 and not throughput["at_most"]
    assert checks[f"{http} / {grpc} TTFT p50"]["at_most"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50" in capsys.readouterr().out


def test_each_pass_sends_prompts_no_other_pass_sent():
    passes = workload(num_requests=32)
    first, second = passes.fresh(), passes.fresh()
    ids = {t for r in passes.requests for t in r.prompt_token_ids}
    for original, a, b in zip(passes.requests, first, second):
        assert len(a.prompt_token_ids) == len(b.prompt_token_ids) == original.num_prompt_tokens
        assert a.prompt_token_ids[1:] == b.prompt_token_ids[1:] == original.prompt_token_ids[1:]
        assert a.prompt_token_ids[0] != b.prompt_token_ids[0]
        assert min(ids) <= a.prompt_token_ids[0] <= max(ids)
    # The warm-up's prompt is the first request's, cut short: it starts unlike either pass's.
    warm_up = passes.warm_up_request()
    assert warm_up.prompt_token_ids[0] not in {first[0].prompt_token_ids[0], second[0].prompt_token_ids[0]}


def test_systems_share_a_deployment_with_their_http_twin_and_targets_parse():
    assert serving.deployments(["disaggregated", "disaggregated+http", "colocated", "engine"]) == \
        [["disaggregated", "disaggregated+http"], ["colocated"], ["engine"]]
    assert serving.deployments(["engine", "disaggregated+http", "disaggregated"]) == \
        [["engine"], ["disaggregated+http", "disaggregated"]]
    assert [t.name for t in parse_targets(["grpc://h:1,http://h:2/", "http://g:3"])] == \
        ["grpc://h:1", "http://h:2", "http://g:3"]
    for bad in (["h:1"], ["https://h:1"], ["grpc://h:1", "grpc://h:1"]):
        with pytest.raises(SystemExit):
            parse_targets(bad)
