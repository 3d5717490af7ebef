"""`baton up` with the real SmolLM2-135M-Instruct: a chat question answered over gRPC."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import jsonschema
import openai
import pytest

from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from baton.cli.local import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(900)


def test_baton_up_answers_capital_of_france(tmp_path):
    port, http_port, admin_port = free_port(), free_port(), free_port()
    log_path = tmp_path / "baton-up.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "up", "--port", str(port), "--http-port", str(http_port),
             "--admin-port", str(admin_port),
             "--threads", "1",
             "--kv-cache-memory", "256M", "--verify-kv"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 600
        while "Baton is serving" not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(0.5)
        assert f"baton generate --gateway 127.0.0.1:{port}" in log_path.read_text()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                messages=pb.ChatMessages(
                    messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]
                ),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=40),
            )
            messages = list(stub.GenerateStream(request, timeout=300))
        text = "".join(m.text for m in messages)
        assert "Paris" in text, text
        assert messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        # The CLI client sees the same answer.
        result = subprocess.run(
            [sys.executable, "-m", "baton.cli", "generate", "--gateway", f"127.0.0.1:{port}", "--chat",
             "--max-tokens", "40", "What is the capital of France?"],
            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        )
        assert result.returncode == 0, result.stderr
        assert "Paris" in result.stdout
        # And an OpenAI client, pointed where the banner says.
        assert f"base_url http://127.0.0.1:{http_port}/v1" in log_path.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40, temperature=0.0)
        assert chat.choices[0].message.content == text
        # Structured output from the real model: the CLI with a schema file, and OpenAI's response_format.
        schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                                   "capital": {"type": "string", "maxLength": 20}},
                  "required": ["country", "capital"], "additionalProperties": False}
        (tmp_path / "schema.json").write_text(json.dumps(schema))
        result = subprocess.run(
            [sys.executable, "-m", "baton.cli", "generate", "--gateway", f"127.0.0.1:{port}", "--chat",
             "--max-tokens", "60", "--json-schema", str(tmp_path / "schema.json"),
             "What is the capital of France? Answer in JSON."],
            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        )
        assert result.returncode == 0 and "[finish: stop" in result.stderr, result.stderr
        answer = json.loads(result.stdout)
        jsonschema.validate(answer, schema)
        assert "Paris" in answer["capital"], answer
        chat = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            max_tokens=60, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        assert json.loads(chat.choices[0].message.content) == answer
        # On one CPU host `baton up` hands KV over ipc: the banner says so, and the workers did.
        assert "(disaggregated, KV over ipc)" in log_path.read_text()
        status = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--gateway",
                                 f"127.0.0.1:{admin_port}"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        # GatewayAdmin (every worker's address) is not on the public port.
        public = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--gateway", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert public.returncode != 0 and "--admin-listen" in public.stderr, public.stderr
        assert status.returncode == 0, status.stderr
        assert re.search(r"KV ipc +[1-9][0-9]* transfers, 0 failed", status.stdout), status.stdout
        assert "KV gloo" not in status.stdout and "KV channel refused" not in status.stdout
        assert re.search(r"refused +none", status.stdout), status.stdout
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    assert code == 0, log_path.read_text()[-5000:]
