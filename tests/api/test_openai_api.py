"""The OpenAI HTTP API (gateway/http) over `baton up`'s real processes, with the official
`openai` client: chat and completions, streamed and not, usage and cached tokens,
logprobs, the same greedy text as gRPC, refusals in OpenAI's shape (unsupported fields,
bad input with the gRPC suite's field names, API key, 429 with Retry-After, 504), and a
client that goes away mid-stream leaving nothing held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
import torch

from baton.cli.launcher import UpSettings, start_up
from baton.cli.local import free_port
from baton.cli.main import build_parser
from baton.runtime.settings import from_args
from baton.wire.limits import MAX_REQUEST_BYTES
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.tokenizer import load_tokenizer
from gateway.http.translate import param_name
from tests.support.bad_requests import CASES
from tests.serving.test_bursts import gateway_samples, total
from tests.serving.test_serving import VOCAB_SIZE
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

KEY = "test-key-0123456789"
SERVED = "tiny-chat"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`baton up` (gateway + prefill + decode worker) serving a tiny random Llama with
    SmolLM2's tokenizer under the name SERVED, behind an API key, HTTP on a free port."""
    directory = tmp_path_factory.mktemp("tiny-openai")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    settings = from_args(UpSettings, build_parser().parse_args([
        "up", "--model", str(path), "--port", str(free_port()), "--http-port", str(free_port()),
        "--served-model-name", SERVED, "--threads", "1", "--max-model-len", "512", "--api-key", KEY]))
    deployment = start_up(settings, tmp_path_factory.mktemp("logs"), metrics=True)
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=f"http://{up.http}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stub(up):
    with grpc.insecure_channel(up.gateway) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def grpc_generate(stub, request: pb.GenerateRequest) -> pb.GenerateResponse:
    return stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)


def post(up, route: str, body: dict, **headers) -> httpx.Response:
    """`body` as JSON (NaN and infinities as Python writes them: NaN, Infinity)."""
    return httpx.post(f"http://{up.http}/v1/{route}", content=json.dumps(body), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers})


def test_health_ready_and_the_served_model(up, client):
    assert httpx.get(f"http://{up.http}/health").status_code == 200  # no key needed
    assert httpx.get(f"http://{up.http}/ready").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_completions_and_chat_give_grpcs_greedy_text(client, stub):
    expected = grpc_generate(stub, pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True)))
    completion = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected.text and completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == \
        (expected.usage.prompt_tokens, 12)
    streamed = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected_chat = grpc_generate(stub, pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=messages[0]["content"])]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=10, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.usage.prompt_tokens == expected_chat.usage.prompt_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"]}]}]
    chunks = list(client.chat.completions.create(model=SERVED, messages=parts, max_completion_tokens=10,
                                                 temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_chat.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_batch_of_prompts_and_token_ids(client, stub):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    expected = [grpc_generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True))).text for ids in prompts]
    batch = client.completions.create(model=SERVED, prompt=prompts, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (9, 12)
    texts = client.completions.create(model=SERVED, prompt=[PROMPT, PROMPT], max_tokens=3, temperature=0.0)
    assert texts.choices[0].text == texts.choices[1].text


def test_usage_in_the_stream_counts_cached_tokens_of_a_repeated_prompt(client):
    prompt = "tell me a story about " * 12  # several KV blocks of prompt

    def usage():
        chunks = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        return chunks[-1].usage

    first, second = usage(), usage()
    assert first.prompt_tokens == second.prompt_tokens > 32 and first.completion_tokens == 4
    assert second.prompt_tokens_details.cached_tokens >= 16
    # Baton's split of them by tier (no host tier here: all in device memory).
    assert second.prompt_tokens_details.model_extra == {"host_cached_tokens": 0}


def test_logprobs_of_chat_and_completions(client):
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob <= 0 and entry.bytes == list(entry.token.encode()) for entry in content)
    completion = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, logprobs=1,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) >= 1 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_penalties_and_biases_over_http_equal_grpc(client, stub):
    sampling = dict(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                    allowed_token_ids=list(range(40, 400)), bad_words=["the"])
    expected = grpc_generate(stub, pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        **sampling, logit_bias={45: 5.0, 46: -100.0})))
    extra = {k: v for k, v in sampling.items() if k not in ("temperature", "max_tokens", "presence_penalty",
                                                              "frequency_penalty")}
    answer = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                       presence_penalty=1.5, frequency_penalty=0.5,
                                       logit_bias={"45": 5.0, "46": -100.0}, extra_body=extra)
    assert answer.choices[0].text == expected.text
    assert 45 in list(expected.token_ids) and "the" not in expected.text


def test_structured_output_over_http(client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and
    guided_* extras: compact JSON that validates, a regex, a choice."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 14}},
              "required": ["city", "days"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "plan a trip"}], max_tokens=80, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}})
    text = chat.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert chat.choices[0].finish_reason == "stop" and text == json.dumps(json.loads(text), separators=(",", ":"),
                                                                          ensure_ascii=False)
    regex = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=20, temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": "[a-f]{2,5}-[0-9]{2}"}})
    assert re.fullmatch("[a-f]{2,5}-[0-9]{2}", regex.choices[0].text)
    choice = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=20,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=5,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_regex": "a+"})
    assert error.value.body["param"] == "structured_outputs.regex"


@pytest.mark.parametrize(("field", "value"), [
    ("best_of", 3), ("tools", [{"type": "function", "function": {"name": "f"}}]),
])
def test_unsupported_fields_are_refused_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert error.value.body["param"] == field and error.value.body["type"] == "invalid_request_error"


def test_key_model_and_timeout_refusals(up, client):
    anonymous = openai.OpenAI(base_url=f"http://{up.http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert error.value.body["param"] == "model"
    # A deadline no deployment could meet: refused at once, 504.
    answer = post(up, "completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True},
                  **{"X-Request-Timeout": "0.01"})
    assert answer.status_code == 504 and answer.json()["error"]["type"] == "timeout"
    # "inf" is no deadline (it was answered 504 at once).
    answer = post(up, "completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 3},
                  **{"X-Request-Timeout": "inf"})
    assert answer.status_code == 200, answer.text


def test_without_the_key_a_bad_body_is_401_not_400(up):
    """A caller without the key learns nothing of its body: 401, not the 400 of the body's
    validation (which told an anonymous caller what the server accepts)."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for route, content in (("completions", b"\xff{not json"), ("chat/completions", b'{"messages": "hi"}')):
            answer = httpx.post(f"http://{up.http}/v1/{route}", content=content, timeout=60,
                                headers={"Content-Type": "application/json", **headers})
            assert answer.status_code == 401, (route, headers, answer.text)
            assert answer.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"http://{up.http}/v1/models", headers=headers, timeout=60).status_code == 401
    assert httpx.get(f"http://{up.http}/health").status_code == 200  # open, as before


def _scheduled(up) -> int:
    return sum(s.num_tokens_scheduled_total for s in up.wait_idle(timeout_s=120).values())


def test_one_bad_prompt_ends_its_batch_at_once(up):
    """A batch with one invalid prompt is answered 400, and its other prompts stop with it:
    they ran on for seconds, their tokens read by nobody."""
    before = _scheduled(up)
    prompts = [[5 + i, 6, 7, 8] for i in range(16)] + [[VOCAB_SIZE + 5]]  # the last one outside the vocabulary
    answer = post(up, "completions", {"model": SERVED, "prompt": prompts, "max_tokens": 400, "ignore_eos": True})
    assert answer.status_code == 400, answer.text
    spent = _scheduled(up) - before  # waits until nothing of the batch runs anywhere
    assert spent < 16 * 400 // 4, f"{spent} tokens ran for a batch answered 400"


def test_a_batch_that_does_not_fit_is_refused_whole_and_holds_nothing(up, client):
    """A batch of as many prompts as the deployment runs at once, while one request runs:
    it is refused 429 before any of it runs (its first prompts held every slot for as long
    as they ran, and the next caller got 429 too), and the next caller is served. A batch
    that could never fit (prompts times n) is 400."""
    limit = up.stats("decode").max_num_seqs
    up.wait_idle()
    running = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=500, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))  # it holds a slot now
    before = up.stats("decode").num_tokens_scheduled_total
    prompts = [[5 + i % 50, 6, 7] for i in range(limit)]
    answer = post(up, "completions", {"model": SERVED, "prompt": prompts, "max_tokens": 200, "ignore_eos": True})
    assert answer.status_code == 429 and answer.json()["error"]["type"] == "rate_limit_error", answer.text
    after = post(up, "completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 200, after.text
    running.close()
    assert _scheduled(up) - before < 600  # the running one's tokens and the next one's, nothing of the batch
    never = post(up, "completions", {"model": SERVED, "prompt": prompts[:2], "n": limit, "max_tokens": 2})
    assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text
    never = post(up, "completions", {"model": SERVED, "prompt": prompts + prompts[:1], "max_tokens": 2})
    assert never.status_code == 400 and never.json()["error"]["param"] == "prompt", never.text


def test_n_is_counted_by_admission_before_any_token(up, stub):
    """Five n=128 requests at once: 640 sequences where the deployment runs 256. Admission
    counts each as 128, so those that do not fit are refused before any message; it
    counted each as one, and the decode worker's own bound refused choices mid-stream."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                                 sampling=pb.SamplingParams(n=128, max_tokens=24, ignore_eos=True, temperature=1.0))

    def run(_) -> tuple[int, str]:
        messages = 0
        try:
            for _ in stub.GenerateStream(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=300):
                messages += 1
        except grpc.RpcError as error:
            return messages, error.code().name
        return messages, "OK"

    with ThreadPoolExecutor(5) as pool:
        outcomes = list(pool.map(run, range(5)))
    assert {code for _, code in outcomes} <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert all(messages == 0 for messages, code in outcomes if code != "OK"), outcomes  # refused before any token
    assert any(code == "OK" for _, code in outcomes), outcomes
    assert all(messages >= 128 for messages, code in outcomes if code == "OK"), outcomes
    up.wait_idle(timeout_s=120)


def test_a_body_over_the_limit_and_an_unknown_route_in_openais_shape(up):
    answer = post(up, "completions", {"model": SERVED, "prompt": "x" * (MAX_REQUEST_BYTES + 1)})
    assert answer.status_code == 413 and "error" in answer.json()
    answer = post(up, "embeddings", {"model": SERVED, "input": "x"})
    assert answer.status_code == 404 and "error" in answer.json()


def _http_body(request: pb.GenerateRequest) -> tuple[str, dict] | None:
    """A gRPC bad-input case as the OpenAI request a client would send (None: it has none)."""
    body: dict = {"model": SERVED, "max_tokens": 4}
    kind = request.WhichOneof("prompt")
    if kind == "messages":
        route = "chat/completions"
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    else:
        route = "completions"
        body["prompt"] = request.text if kind == "text" else list(request.token_ids.ids) if kind else ""
    sampling = request.sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "logprobs"):
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    if sampling.min_tokens:
        body["min_tokens"] = sampling.min_tokens
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    for name in ("presence_penalty", "frequency_penalty", "allowed_token_ids", "bad_words"):
        if getattr(sampling, name):
            body[name] = getattr(sampling, name) if "penalty" in name else list(getattr(sampling, name))
    if sampling.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in sampling.logit_bias.items()}
    constraint = sampling.WhichOneof("structured_output")
    if constraint == "json_schema":
        schema = sampling.json_schema  # sent as the string it is when it is no JSON
        with contextlib.suppress(json.JSONDecodeError):
            schema = json.loads(schema)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif constraint is not None:
        value = getattr(sampling, constraint)
        body["structured_outputs"] = {constraint: list(value.choices) if constraint == "choice" else value}
    if request.request_id:
        body["request_id"] = request.request_id
    if request.priority:
        body["priority"] = request.priority
    if route == "chat/completions" and "logprobs" in body:
        body["top_logprobs"], body["logprobs"] = body["logprobs"], True
    return route, body


HTTP_CASES = {name: case for name, case in CASES.items() if isinstance(case[0], pb.GenerateRequest) and case[2]}


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
def test_bad_input_over_http_names_the_grpc_suites_field(up, case):
    request, _, field = HTTP_CASES[case]
    route, body = _http_body(request)
    answer = post(up, route, body)
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.text)
    assert answer.json()["error"]["param"] == param_name(field, chat=route == "chat/completions"), answer.text


def test_a_body_that_is_no_json_or_no_request_names_what_is_wrong(up):
    answer = httpx.post(f"http://{up.http}/v1/completions", content=b"\xff{not json", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    answer = post(up, "chat/completions", {"model": SERVED, "messages": "hi"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"


def test_after_the_bad_input_nothing_is_held_and_it_serves(up, client, stub):
    """Bad input by both front ends (some of the suite's cases, sent here so that the test
    stands alone), then a good request: it is served, nothing is held, and the gateway's
    metrics count each front end's requests apart."""
    before = gateway_samples(up)
    names = sorted(HTTP_CASES)[:8]
    for name in names:
        request, code, _ = HTTP_CASES[name]
        assert 400 <= post(up, *_http_body(request)).status_code < 500, name
        with pytest.raises(grpc.RpcError) as refused:
            grpc_generate(stub, request)
        assert refused.value.code() == code, name
    up.wait_idle()
    assert client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
    up.wait_idle()
    after = gateway_samples(up)
    for front, sent in (("http", len(names) + 1), ("grpc", len(names))):
        received = (total(after, "baton_requests_received_total", front=front)
                    - total(before, "baton_requests_received_total", front=front))
        assert received == sent, (front, received, sent)


def test_a_client_gone_mid_stream_leaves_no_block_held_within_2_s(up):
    async def read_a_little_then_leave() -> None:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
                "POST", f"http://{up.http}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                json={"model": SERVED, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
                      "stream": True}) as answer:
            assert answer.status_code == 200
            lines = 0
            async for line in answer.aiter_lines():
                lines += line.startswith("data: ")
                if lines >= 3:
                    break
            assert up.stats("decode").num_kv_blocks_used > 0  # it is decoding as we leave

    up.wait_idle()
    finished = up.stats("decode").num_finished
    asyncio.run(read_a_little_then_leave())
    left = time.monotonic()
    up.wait_idle(timeout_s=2.0)
    assert time.monotonic() - left <= 2.0
    assert up.stats("decode").num_finished == finished + 1  # aborted, not run to its 500 tokens


def test_admission_refuses_with_429_and_retry_after(up):
    """Through a second gateway whose queue-wait bound no first token can meet: 429 with
    Retry-After, in OpenAI's shape, streamed or not."""
    from benchmarks.overload import start_second_gateway

    http_port = free_port()
    gateway = start_second_gateway(up, ["--max-queue-wait-s", "1e-9", "--http-port", str(http_port)])
    try:
        base = f"http://127.0.0.1:{http_port}/v1/completions"
        headers = {"Authorization": f"Bearer {KEY}"}
        for stream in (False, True):
            answer = httpx.post(base, json={"model": SERVED, "prompt": PROMPT, "max_tokens": 4, "stream": stream},
                                headers=headers, timeout=60)
            assert answer.status_code == 429, answer.text
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert gateway.stop()["gateway"] == 0
    up.wait_idle()
