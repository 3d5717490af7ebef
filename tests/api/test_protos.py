"""The protos as other languages and tools see them: buf's lint (standard rules, with the
exceptions buf.yaml gives reasons for) and its breaking-change check against the last
release's image (protos/releases/); reflection v1 as well as v1alpha; and the Node client
of examples/node streaming text from `baton up`, the same text a Python client gets.

buf and the Node client's packages come from npm, pinned by their package-lock.json
(`npm ci`, once per run); without npm on the PATH these tests are skipped."""

from __future__ import annotations

import shutil
import os
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from baton.cli.launcher import UpSettings, start_up
from baton.cli.local import REPO_ROOT, free_port
from baton.cli.main import build_parser
from baton.runtime.server import REFLECTION_V1
from baton.runtime.settings import from_args
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(300)

BUF_DIR = REPO_ROOT / "tools" / "buf"
NODE_EXAMPLE = REPO_ROOT / "examples" / "node"
# The last release's protos, as buf's image (docs/api.md: one is added at each release).
BASELINE = max((REPO_ROOT / "protos" / "releases").glob("baton-*.binpb"),
               key=lambda path: tuple(int(part) for part in path.stem.removeprefix("baton-").split(".")))
PROMPT = "The capital of France is"


def run(args: list[str], cwd=REPO_ROOT, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def npm_ci(package, into) -> Path:
    """`package`'s locked dependencies installed into `into` (not next to it: the tree
    stays as checked out); their node_modules."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("needs node and npm on the PATH")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(package / name, into)
    result = run(["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=into, timeout=300)
    assert result.returncode == 0, f"npm ci of {package} failed:\n{result.stdout}\n{result.stderr}"
    return into / "node_modules"


@pytest.fixture(scope="module")
def buf(tmp_path_factory) -> str:
    return str(npm_ci(BUF_DIR, tmp_path_factory.mktemp("buf")) / ".bin" / "buf")


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory) -> Path:
    return npm_ci(NODE_EXAMPLE, tmp_path_factory.mktemp("node-example"))


def test_buf_lint_passes(buf):
    result = run([buf, "lint"])
    assert result.returncode == 0, f"buf lint:\n{result.stdout}{result.stderr}"


def test_no_breaking_change_since_the_last_release(buf):
    result = run([buf, "breaking", "--against", str(BASELINE)])
    assert result.returncode == 0, f"buf breaking against {BASELINE.name}:\n{result.stdout}{result.stderr}"


def test_the_breaking_check_catches_a_public_rename_and_lets_internal_changes_by(buf, tmp_path):
    """Not vacuous: renaming the public service or a field of it fails the check, while the
    internal package, which changes with both its ends, is not checked."""
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path)
    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("releases"))
    internal = tmp_path / "protos/baton/internal/v1/worker.proto"
    internal.write_text(internal.read_text().replace("string kv_token = 2;", "string kv_secret = 2;", 1))
    assert run([buf, "breaking", str(tmp_path), "--against", str(BASELINE)]).returncode == 0
    public = tmp_path / "protos/baton/v1/generation.proto"
    public.write_text(public.read_text().replace("service Generation {", "service GenerationService {")
                      .replace("uint32 vocab_size = 3;", "uint32 vocabulary_size = 3;"))
    result = run([buf, "breaking", str(tmp_path), "--against", str(BASELINE)])
    assert result.returncode != 0
    assert 'service "Generation" was deleted' in result.stdout, result.stdout
    assert 'changed name from "vocab_size" to "vocabulary_size"' in result.stdout, result.stdout


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`baton up --colocated` serving the dummy tiny model (random weights, a byte-level
    tokenizer: any text encodes, every id decodes to text)."""
    settings = from_args(UpSettings, build_parser().parse_args([
        "up", "--model", "dummy:tiny", "--colocated", "--port", str(free_port()), "--http-port", "0",
        "--threads", "1"]))
    deployment = start_up(settings, tmp_path_factory.mktemp("logs"))
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0}, deployment.logs()


def reflect(channel: grpc.Channel, service: str, requests: list) -> list:
    """ServerReflectionInfo of reflection `service` (v1 or v1alpha: the same messages)."""
    info = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(info(iter(requests), timeout=30))


@pytest.mark.parametrize("service", [REFLECTION_V1, "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_v1_and_v1alpha_list_and_describe_the_services(up, service):
    with grpc.insecure_channel(up.gateway) as channel:
        listed, described = reflect(channel, service, [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=REFLECTION_V1),
        ])
        (generation,) = reflect(channel, service, [
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="baton.v1.Generation")])
    names = {s.name for s in listed.list_services_response.service}
    assert {"baton.v1.Generation", "grpc.health.v1.Health", REFLECTION_V1,
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    assert [(f.package, f.service[0].name) for f in files] == [("grpc.reflection.v1", "ServerReflection")]
    public = descriptor_pb2.FileDescriptorProto.FromString(generation.file_descriptor_response.file_descriptor_proto[0])
    assert public.name == "baton/v1/generation.proto"
    assert public.options.go_package == "github.com/baton-llm/baton/gen/go/baton/v1;batonv1"


def test_the_node_client_streams_the_text_a_python_client_gets(up, node_modules):
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(temperature=0.0, max_tokens=12))
    with grpc.insecure_channel(up.gateway) as channel:
        messages = list(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=60))
    expected = "".join(m.text for m in messages)
    assert expected.strip(), "the dummy tokenizer decodes every id to text"
    result = run(["node", str(NODE_EXAMPLE / "client.js"), up.gateway, PROMPT,
                  "--temperature", "0", "--max-tokens", "12"], timeout=120,
                 env={"PATH": os.environ["PATH"], "NODE_PATH": str(node_modules)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    usage = messages[-1].usage
    assert f"{usage.prompt_tokens} prompt, {usage.completion_tokens} generated tokens" in result.stderr, result.stderr
