"""End to end over real processes on loopback: gateway + prefill worker + decode worker
serving a tiny random Llama (float64, SmolLM2's tokenizer), checked against transformers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import re
import time

import grpc
import pytest
import torch

from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.detokenizer import detokenize
from engine.tokenizer import load_tokenizer
from baton.cli.local import start_deployment
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(900)

VOCAB_SIZE, SERVED_NAME = 49152, "acme/tiny-chat"  # SmolLM2's tokenizer; the workers' --served-model-name
WORKER_ARGS = ["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "400", "--verify-kv",
               "--served-model-name", SERVED_NAME]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer saved next to it."""
    directory = tmp_path_factory.mktemp("tiny-serving")
    model, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.save_pretrained(directory)
    return model, path, tokenizer


@pytest.fixture(scope="module")
def system(tiny_chat_model, tmp_path_factory):
    # Every prompt goes through the prefill worker and a handoff (no local prefill); bursts
    # far over a step of its tiny budget are queued, not refused.
    deployment = start_deployment(
        tiny_chat_model[1], tmp_path_factory.mktemp("logs"), worker_args=WORKER_ARGS, prefill_args=["--max-num-batched-tokens", "48"],
        decode_args=["--max-num-batched-tokens", "64"],
        gateway_args=["--max-prefill-queue-tokens", "0", "--max-queued-tokens", "100000"])
    yield deployment
    codes = deployment.stop()
    assert codes == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


def greedy_request(prompt: list[int], max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def stream_all(stub, request) -> tuple[list[int], str, list[pb.GenerateStreamResponse]]:
    messages = list(stub.GenerateStream(request, timeout=120))
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, "".join(m.text for m in messages), messages


def test_stream_and_unary_equal_transformers(system, stub, tiny_chat_model):
    model, _, tokenizer = tiny_chat_model
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    expected = hf_greedy(model, prompt, 20)
    tokens, text, messages = stream_all(stub, greedy_request(prompt, 20, "parity-stream"))
    assert tokens == expected
    assert text == detokenize(tokenizer, expected)
    assert messages[0].token_ids and len(messages[0].token_ids) == 1  # the first token alone, at once
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 20)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])

    response = stub.Generate(greedy_request(prompt, 20), timeout=120)
    assert list(response.token_ids) == expected
    assert response.text == text
    assert response.finish_reason == pb.FINISH_REASON_LENGTH

    # Text prompts are tokenized by the gateway like the tokenizer does.
    request = pb.GenerateRequest(
        text="The quick brown fox jumps over the lazy dog, and then",
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    )
    assert list(stub.Generate(request, timeout=120).token_ids) == expected


def test_a_shared_prefix_is_computed_and_moved_once(system, stub, tiny_chat_model):
    """A second prompt with the first's 40-token start: those are cached (usage says so) and not moved."""
    model, _, _ = tiny_chat_model
    first, second = [*range(2000, 2040), 7, 8, 9], [*range(2000, 2040), 11, 12, 13, 14, 15]  # 10 blocks shared
    decode_before, prefill_before = system.stats("decode"), system.stats("prefill")
    tokens, _, messages = stream_all(stub, greedy_request(first, 6))
    assert tokens == hf_greedy(model, first, 6) and messages[-1].usage.cached_tokens == 0
    decode_between = system.stats("decode")
    tokens, _, messages = stream_all(stub, greedy_request(second, 6))
    assert tokens == hf_greedy(model, second, 6)
    assert (messages[-1].usage.cached_tokens, messages[-1].usage.prompt_tokens) == (40, len(second))
    decode_after, prefill_after = system.stats("decode"), system.stats("prefill")
    assert prefill_after.prefix_cache_hit_tokens - prefill_before.prefix_cache_hit_tokens == 40
    assert decode_after.prefix_cache_reused_blocks - decode_between.prefix_cache_reused_blocks == 10
    moved = [b.num_transferred_bytes - a.num_transferred_bytes for a, b in ((decode_before, decode_between),
                                                                           (decode_between, decode_after))]
    assert moved == [11 * decode_after.kv_block_bytes, 2 * decode_after.kv_block_bytes]


def test_32_concurrent_streams_of_mixed_lengths(system, stub, tiny_chat_model):
    model, _, tokenizer = tiny_chat_model
    rng = random.Random(0)
    cases = []
    for i in range(32):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(2, 70))]
        cases.append((f"mixed-{i}", prompt, rng.randint(1, 24)))
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = {
            request_id: pool.submit(stream_all, stub, greedy_request(prompt, max_tokens, request_id))
            for request_id, prompt, max_tokens in cases
        }
        results = {request_id: future.result() for request_id, future in futures.items()}
    for request_id, prompt, max_tokens in cases:
        tokens, text, messages = results[request_id]
        expected = hf_greedy(model, prompt, max_tokens)
        assert tokens == expected, request_id
        assert text == detokenize(tokenizer, expected), request_id
        assert all(m.request_id == request_id for m in messages)
    # Every handed-off block was checksummed on both sides and matched.
    decode = system.stats("decode")
    prefill = system.stats("prefill")
    assert decode.num_transfers >= 32 - sum(1 for _, _, n in cases if n == 1)
    assert decode.num_transfers_verified == decode.num_transfers
    assert decode.num_transfer_failures == 0 and prefill.num_transfer_failures == 0
    assert prefill.num_transfers == decode.num_transfers
    assert prefill.num_transferred_bytes == decode.num_transferred_bytes > 0
    # One host: every transfer went over ipc, the decode worker's cache shared with the prefill worker.
    for stats in (decode, prefill):
        assert [(t.transport, t.num_transfers, t.num_failures) for t in stats.kv_transports] == [
            ("ipc", stats.num_transfers, 0)]
        assert stats.kv_channel_refusal == "" and stats.num_kv_blocks_fenced == 0


def test_cancelling_a_stream_frees_blocks_on_both_workers(system, stub, tiny_chat_model):
    model, _, _ = tiny_chat_model
    system.wait_idle()
    before = system.stats("decode").num_finished
    prompt = list(range(100, 160))
    call = stub.GenerateStream(greedy_request(prompt, 4000, "to-cancel"), timeout=120)
    received = []
    for message in call:
        received.extend(message.token_ids)
        if len(received) >= 4:
            break
    assert system.stats("decode").num_kv_blocks_used > 0  # it is decoding right now
    call.cancel()
    stats = system.wait_idle()
    assert stats["decode-0"].num_finished > before
    # And the system keeps serving, with the right answer.
    tokens, _, _ = stream_all(stub, greedy_request(prompt, 8))
    assert tokens == hf_greedy(model, prompt, 8)
    system.wait_idle()


def test_cancels_at_the_first_token_or_during_prefill_leave_no_lease(system, stub):
    """Clients gone at the first token or during the prefill call, end to end: within 5 s
    nothing is held on either worker, far sooner than the 30 s lease would free it.
    (tests/serving/test_gateway_routing.py pins the two moments the race here may miss.)"""
    system.wait_idle()
    prompt = list(range(100, 220))
    for index in range(12):
        call = stub.GenerateStream(greedy_request(prompt, 50, f"early-cancel-{index}"), timeout=60)
        if index % 2 == 0:
            next(call)  # the first token, streamed before the handoff
        else:
            time.sleep(0.005 * index)  # somewhere in the prefill call
        call.cancel()
    system.wait_idle(timeout_s=5)


def test_deadline_exceeded_frees_everything(system, stub):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.GenerateStream(greedy_request(list(range(5, 40)), 4000), timeout=0.25))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    system.wait_idle()


def test_stop_strings_cut_the_text_and_end_the_request(system, stub, tiny_chat_model):
    model, _, tokenizer = tiny_chat_model
    prompt = list(range(300, 330))
    expected = hf_greedy(model, prompt, 30)
    full_text = detokenize(tokenizer, expected)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip()
    request = greedy_request(prompt, 30)
    request.sampling.stop.append(stop)
    response = stub.Generate(request, timeout=60)
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert response.stop_string == stop
    assert response.text == full_text[: full_text.index(stop)]
    system.wait_idle()


def test_model_info(system, stub):
    assert system.stats("decode").block_size == 4  # what the gateway routes by
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == VOCAB_SIZE
    assert list(info.eos_token_ids) == [2]
    assert info.max_context_length == 512
    assert info.has_chat_template
    assert info.model == SERVED_NAME and system.stats("decode").model == SERVED_NAME
    load = info.load  # how the worker read the weights: the checkpoint's one file, directly
    assert (load.format, load.files, load.tensors) == ("safetensors", 1, 2 + 9 * 2) and load.seconds > 0
    assert load.bytes_per_second == pytest.approx(load.bytes / load.seconds) and load.bytes > 0


@contextlib.contextmanager
def extra_gateway(model_path: str, log_dir, *flags: str):
    """A second gateway process in front of the module's workers (`flags` name them);
    yields a stub on it once it serves and every worker is marked up."""
    from baton.cli.local import Deployment, free_port, spawn, wait_in_rotation, wait_serving

    address, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ["gateway", "--listen", address, "--admin-listen", admin, "--model", model_path, *flags]
    gateway = Deployment(address, [spawn("gateway", args, log_dir, dict(os.environ))], admin=admin)
    try:
        wait_serving(address, gateway, 120)
        wait_in_rotation(admin, gateway, 120)
        with grpc.insecure_channel(address) as channel:
            yield generation_pb2_grpc.GenerationStub(channel)
    finally:
        assert gateway.stop() == {"gateway": 0}, gateway.logs()


def test_colocated_gateway_matches(system, tiny_chat_model, tmp_path):
    """A second gateway that knows only the decode worker: it prefills there (again: from its prefix cache)."""
    model, path, _ = tiny_chat_model
    with extra_gateway(path, tmp_path, "--decode-workers", system.worker("decode").address) as stub:
        transfers_before = system.stats("decode").num_transfers
        prompt = list(range(1000, 1040))
        tokens, _, _ = stream_all(stub, greedy_request(prompt, 12))
        again, _, messages = stream_all(stub, greedy_request(prompt, 12))
    assert tokens == again == hf_greedy(model, prompt, 12)
    assert messages[-1].usage.cached_tokens == 36
    assert system.stats("decode").num_transfers == transfers_before


def test_gateway_prefills_on_the_decode_worker_when_the_prefill_queue_is_long(system, tiny_chat_model, tmp_path):
    """Conditional disaggregation: a second gateway over the same workers that keeps a
    prompt on its decode worker once the prefill worker has more than 1 token queued.
    A burst then splits between handoffs and local prefills, and every output is exact."""
    model, path, _ = tiny_chat_model
    rng = random.Random(7)
    cases = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(20, 60))] for _ in range(12)]
    flags = ["--max-prefill-queue-tokens", "1", "--max-queued-tokens", "100000",
             "--prefill-workers", system.worker("prefill").address, "--decode-workers", system.worker("decode").address]
    with extra_gateway(path, tmp_path, *flags) as stub:
        transfers_before = system.stats("decode").num_transfers
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(lambda prompt: stream_all(stub, greedy_request(prompt, 6)), cases))
    for prompt, (tokens, _, _) in zip(cases, results):
        assert tokens == hf_greedy(model, prompt, 6)
    handed_off = system.stats("decode").num_transfers - transfers_before
    assert 1 <= handed_off < len(cases), handed_off  # the first went remote, a later one local
    system.wait_idle()


CLIENT_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from baton.v1 import generation_pb2 as pb, generation_pb2_grpc
assert pb.__file__.startswith(sys.argv[1]), pb.__file__
with grpc.insecure_channel(sys.argv[2]) as channel:
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[7, 8, 9, 10]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    )
    tokens = [t for m in stub.GenerateStream(request, timeout=60) for t in m.token_ids]
assert not any(name.split(".")[0] in ("engine", "gateway", "kvtransfer") for name in sys.modules)
print(",".join(map(str, tokens)))
"""


def test_client_generated_from_protos_alone(system, tiny_chat_model, tmp_path):
    import subprocess
    import sys

    from grpc_tools import protoc

    from baton.cli.local import REPO_ROOT

    out = tmp_path / "generated"
    out.mkdir()
    assert protoc.main([
        "protoc", f"-I{REPO_ROOT / 'protos'}", f"--python_out={out}", f"--grpc_python_out={out}",
        "baton/v1/generation.proto",
    ]) == 0
    (tmp_path / "client.py").write_text(CLIENT_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-s", str(tmp_path / "client.py"), str(out), system.gateway],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    model, _, _ = tiny_chat_model
    assert [int(t) for t in result.stdout.strip().split(",")] == hf_greedy(model, [7, 8, 9, 10], 5)


def test_reflection_lists_the_public_service(system):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(system.gateway) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "baton.v1.Generation" in services
    assert "grpc.health.v1.Health" in services
    with grpc.insecure_channel(system.worker("decode").address) as channel:
        assert "baton.internal.v1.DecodeWorker" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_committed_stubs_match_protos():
    from baton.devtools.protogen import check

    assert check() == []


def stop_token_case(model, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy output up to and including a token first emitted at a position k > 1 (so the
    decode worker, not the prefill worker, samples it), and that token."""
    expected = hf_greedy(model, prompt, 24)
    for k in range(2, len(expected)):
        if expected[k] not in expected[:k]:
            return expected[: k + 1], expected[k]
    raise AssertionError(f"no token first appears after position 1 in {expected}")


def check_stop_token(stub, prompt: list[int], expected: list[int], stop_token: int) -> None:
    request = greedy_request(prompt, 24)
    request.sampling.stop_token_ids.append(stop_token)
    tokens, _, messages = stream_all(stub, request)
    last = messages[-1]
    assert tokens == expected
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.WhichOneof("stop_reason") == "stop_token_id" and last.stop_token_id == stop_token
    response = stub.Generate(request, timeout=60)
    assert list(response.token_ids) == expected
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert response.WhichOneof("stop_reason") == "stop_token_id" and response.stop_token_id == stop_token


def test_a_stop_token_sampled_on_the_decode_worker_is_reported(system, stub, tiny_chat_model, tmp_path):
    """The token that ended a request reaches the client as stop_token_id, whether the decode
    worker got the prompt by a handoff or prefilled it itself (a gateway without prefill workers)."""
    model, path, _ = tiny_chat_model
    prompt = list(range(400, 430))
    expected, stop_token = stop_token_case(model, prompt)
    transfers_before = system.stats("decode").num_transfers
    check_stop_token(stub, prompt, expected, stop_token)
    assert system.stats("decode").num_transfers == transfers_before + 2  # both went through a handoff
    with extra_gateway(path, tmp_path, "--decode-workers", system.worker("decode").address) as colocated:
        check_stop_token(colocated, prompt, expected, stop_token)
    assert system.stats("decode").num_transfers == transfers_before + 2
    system.wait_idle()


# What a process logs when something went wrong: our logging at WARNING and above, and
# grpc core's own error lines ("E1123 12:00:00.000 ... Received a GOAWAY ...").
LOG_PROBLEM = re.compile(r"^(E\d{4} |.* (WARNING|ERROR|CRITICAL) )|GOAWAY|too_many_pings", re.MULTILINE)


@pytest.mark.slow
def test_an_idle_internal_channel_survives_with_no_error_logged(system, stub, tiny_chat_model):
    """The decode worker's channel to the prefill worker carries nothing between handoffs.
    Client keepalive pings on it must be ones the server accepts: a server that counts
    them as abuse closes the channel with GOAWAY "too_many_pings" after about 30 s."""
    model, _, _ = tiny_chat_model
    prompt = list(range(500, 520))
    system.wait_idle()
    transfers = system.stats("decode").num_transfers
    assert stream_all(stub, greedy_request(prompt, 4))[0] == hf_greedy(model, prompt, 4)
    assert system.stats("decode").num_transfers == transfers + 1  # the channel is open
    logs_before = {p.role: len(p.log()) for p in system.processes}
    time.sleep(35)  # the client's pings come every 10 s: the channel was closed at the third
    prompt = list(range(520, 540))  # not the same: the decode worker's prefix cache holds that one whole
    assert stream_all(stub, greedy_request(prompt, 4))[0] == hf_greedy(model, prompt, 4)
    assert system.stats("decode").num_transfers == transfers + 2
    for process in system.processes:
        new = process.log()[logs_before[process.role]:]
        assert not LOG_PROBLEM.search(new), f"{process.role} logged while idle:\n{new}"


STRICT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('the conversation must not start with an assistant message') }}"
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_messages_a_chat_template_rejects_are_invalid_argument(system, tiny_chat_model, tmp_path):
    """A template's own refusal (raise_exception) reaches the client as INVALID_ARGUMENT with
    the template's words, and the gateway goes on serving."""
    model, _, tokenizer = tiny_chat_model
    strict = tmp_path / "strict-template"
    tokenizer.save_pretrained(strict)
    saved = type(tokenizer).from_pretrained(strict)
    saved.chat_template = STRICT_TEMPLATE
    saved.save_pretrained(strict)
    with extra_gateway(str(strict), tmp_path, "--decode-workers", system.worker("decode").address) as stub:
        bad = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="assistant", content="Hello")]),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=3),
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(bad, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert "must not start with an assistant message" in error.value.details()
        good = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello")]),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        )
        assert len(stub.Generate(good, timeout=60).token_ids) == 3
    system.wait_idle()


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"timeout_seconds": 1e300}, "timeout_seconds"),  # was an OverflowError: UNKNOWN
        ({"timeout_seconds": float("nan")}, "timeout_seconds"),
        ({"timeout_seconds": -5.0}, "timeout_seconds"),
        ({"store_port": 70000}, "store_port"),
        ({"channel_id": ""}, "channel_id"),
        ({"channel_id": "c" * 300}, "channel_id"),
        ({"store_host": ""}, "store_host"),
        ({"secret": b""}, "secret"),  # a channel nobody needs to prove anything to join
        ({"secret": b"short"}, "secret"),
        ({"transport": ""}, "transport"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"transport": "ipc"}, "ipc_socket"),  # where to connect is missing
        ({"decode_endpoint": None}, "decode_endpoint"),
        ({"decode_endpoint": {"hostname": "h", "host_id": "b", "device": "cpu", "kv_transport": "udp"}},
         "decode_endpoint"),
    ],
)
def test_a_malformed_kv_channel_rendezvous_is_invalid_argument(system, stub, fields, fragment):
    """OpenKvChannel on the prefill worker, as a forged or broken peer would call it: refused
    with INVALID_ARGUMENT naming the field, before any rendezvous; the system still serves."""
    from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc

    stats = system.stats("prefill")
    layout = worker_pb2.KvLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float64")
    endpoint = {"hostname": "elsewhere", "host_id": "boot/net:1", "device": "cpu", "kv_transport": "auto"}
    values = {"channel_id": "probe", "store_host": "127.0.0.1", "store_port": 1, "layout": layout,
              "decode_worker_id": "probe", "timeout_seconds": 1.0, "secret": bytes(32), "transport": "gloo",
              "decode_endpoint": endpoint, **fields}
    if values["decode_endpoint"] is None:
        del values["decode_endpoint"]
    else:
        values["decode_endpoint"] = worker_pb2.KvEndpoint(**values["decode_endpoint"])
    request = worker_pb2.OpenKvChannelRequest(**values)
    with grpc.insecure_channel(system.worker("prefill").address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            worker_pb2_grpc.PrefillWorkerStub(channel).OpenKvChannel(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert fragment in error.value.details()
    assert system.stats("prefill").worker_id == stats.worker_id
    tokens, _, _ = stream_all(stub, greedy_request(list(range(5, 20)), 3))
    assert len(tokens) == 3


def test_a_local_decode_worker_pulls_kv_from_its_prefill_worker_only(system, stub):
    """start_deployment (and so `baton up`) gives each decode worker its prefill worker's
    address as --allowed-prefill-workers: a Decode whose KV handle names another address is
    refused, naming the field, and nothing is dialled (tests/api/test_bad_input.py)."""
    from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
    from baton.wire.status import error_details_from_trailers

    layout = worker_pb2.KvLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float64")
    endpoint = worker_pb2.KvEndpoint(hostname="elsewhere", host_id="boot/net:1", device="cpu", kv_transport="auto")
    handle = worker_pb2.KvHandle(prefill_worker_id="p", prefill_address="127.0.0.1:1", request_id="elsewhere",
                                 num_tokens=8, num_blocks=2, layout=layout, lease_ms=30_000, kv_token="t" * 32,
                                 prefill_endpoint=endpoint)
    work = worker_pb2.WorkRequest(request_id="elsewhere", prompt_token_ids=list(range(11, 19)),
                                  sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
    request = worker_pb2.DecodeRequest(request=work, first_token_id=3, kv_handle=handle)
    with grpc.insecure_channel(system.worker("decode").address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    violations = error_details_from_trailers(error.value.trailing_metadata()).field_violations
    assert [field for field, _ in violations] == ["kv_handle.prefill_address"]
    system.wait_idle()
    tokens, _, _ = stream_all(stub, greedy_request(list(range(5, 20)), 3))
    assert len(tokens) == 3
