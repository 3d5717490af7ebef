"""Transport security (issue 13): TLS on every port from certificate files, mutual TLS
between Baton's processes, the public API's bearer token, GatewayAdmin on a port of
its own. One deployment (gateway + prefill worker + decode worker, every prompt
handed off, so the KV control plane runs over mTLS) serves the end-to-end tests; a
throwaway CA (tests/support/tls.py) signs every certificate."""

from __future__ import annotations

import argparse
import asyncio
import ssl

import grpc
import httpx2 as httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.cli.local import free_port, start_deployment
from baton.cli.main import build_parser, main
from baton.runtime.security import ApiKeyInterceptor, TlsConfig, bearer_metadata
from baton.runtime.server import GrpcServer, open_blocking_channel, open_channel
from baton.runtime.settings import (
    DecodeWorkerSettings,
    GatewaySettings,
    SettingsError,
    add_flags,
    from_args,
)
from baton.wire.internal.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.tokenizer import load_tokenizer
from tests.support.tiny_models import make_tiny_model
from tests.support.tls import make_pki

pytestmark = pytest.mark.timeout(600)

API_KEY = "s3cret-key-for-tests"
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


HEALTH_PORTS = {"decode": free_port(), "gateway": free_port()}


def tls_flags(leaf) -> list[str]:
    return ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-ca", str(leaf.ca)]


@pytest.fixture(scope="module")
def system(pki, tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    _, model_dir = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=49152)
    load_tokenizer("smollm2-135m").save_pretrained(directory)  # `baton generate` sends text
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(API_KEY + "\n")  # as a mounted secret may end
    server = pki.server
    deployment = start_deployment(
        model_dir, tmp_path_factory.mktemp("logs"),
        worker_args=["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "200", *tls_flags(server)],
        decode_args=["--health-port", str(HEALTH_PORTS["decode"])],
        gateway_args=["--max-prefill-queue-tokens", "0", "--api-key-file", str(key_file), *tls_flags(server),
                      "--health-port", str(HEALTH_PORTS["gateway"])],
        admin_address="auto",
        tls=TlsConfig.load(str(server.cert), str(server.key), str(server.ca)),
        api_key=API_KEY,
        http_port=0,
    )
    yield deployment
    codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()


def request(prompt: list[int] = PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def client_tls(pki, leaf=None) -> TlsConfig:
    """A client's TLS: trusts the deployment's CA; presents `leaf`'s certificate if given."""
    if leaf is None:
        return TlsConfig.load(None, None, str(pki.ca), serving=False)
    return TlsConfig.load(str(leaf.cert), str(leaf.key), str(pki.ca), serving=False)


def call_fails(address: str, tls: TlsConfig | None, call) -> grpc.StatusCode:
    with open_blocking_channel(address, tls) as channel:
        with pytest.raises(grpc.RpcError) as error:
            call(channel)
    return error.value.code()


def get_stats(role: str):
    stub_class = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    return lambda channel: stub_class(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5)


def health_check(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def release_someone_elses_lease(channel):
    return worker_pb2_grpc.PrefillWorkerStub(channel).ReleaseKv(worker_pb2.ReleaseKvRequest(request_id="other"),
                                                                timeout=5)


def deployment_status(channel):
    return admin_pb2_grpc.GatewayAdminStub(channel).GetDeploymentStatus(
        admin_pb2.GetDeploymentStatusRequest(), timeout=10, metadata=bearer_metadata(API_KEY))


def test_health_alone_is_served_in_plaintext_on_the_health_port(system):
    """Kubernetes' gRPC probes speak no TLS: --health-port answers them, and nothing else."""
    for role, port in HEALTH_PORTS.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert health_check(channel).status == health_pb2.HealthCheckResponse.SERVING
            liveness = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert liveness.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as error:
                get_stats("decode")(channel)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED, role
    # The service port still refuses plaintext.
    with grpc.insecure_channel(system.worker("decode").address) as channel:
        with pytest.raises(grpc.RpcError):
            health_check(channel)


def test_the_right_key_over_tls_is_served_end_to_end_through_a_handoff(system, pki):
    transfers = system.stats("decode").num_transfers
    with open_blocking_channel(system.gateway, client_tls(pki)) as channel:  # no client certificate
        stub = generation_pb2_grpc.GenerationStub(channel)
        unary = stub.Generate(request(), timeout=60, metadata=bearer_metadata(API_KEY), wait_for_ready=True)
        # Another prompt: a repeat would find its blocks in the decode worker's prefix cache, unpulled.
        other = [PROMPT[0] + 1, *PROMPT[1:]]
        streamed = [t for m in stub.GenerateStream(request(other), timeout=60, metadata=bearer_metadata(API_KEY),
                                                   wait_for_ready=True)
                    for t in m.token_ids]
    assert len(unary.token_ids) == 4 and len(streamed) == 4
    # Prefilled on the prefill worker and pulled by the decode worker: OpenKvChannel and
    # SendKv went over mutual TLS, the blocks over a channel whose peer proved its secret.
    assert system.stats("decode").num_transfers == transfers + 2, system.logs()


def test_the_http_api_speaks_tls_only_and_wants_the_key(system, pki):
    """The OpenAI API on the gateway's certificate (no client certificate asked for), behind the key."""
    url = f"https://{system.http}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    trust = ssl.create_default_context(cafile=str(pki.ca))
    answer = httpx.post(url, json=body, verify=trust, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2, answer.text
    assert httpx.post(url, json=body, verify=trust, timeout=60).status_code == 401
    with pytest.raises(httpx.HTTPError):  # plaintext gets no answer
        httpx.post(f"http://{system.http}/v1/completions", json=body, timeout=10)


@pytest.mark.parametrize("metadata", [(), bearer_metadata("wrong"), bearer_metadata(API_KEY + "x"),
                                      (("authorization", API_KEY),)],
                         ids=["missing", "wrong", "longer", "not-bearer"])
def test_a_missing_or_wrong_key_is_unauthenticated(system, pki, metadata):
    # wait_for_ready where an answer is expected: on a loaded machine a handshake may fail
    # once (UNAVAILABLE, seen at a load of 7 on 2 cores); the call then waits for the next.
    with open_blocking_channel(system.gateway, client_tls(pki)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as unary:
            stub.Generate(request(), timeout=30, metadata=metadata, wait_for_ready=True)
        with pytest.raises(grpc.RpcError) as stream:
            list(stub.GenerateStream(request(), timeout=30, metadata=metadata, wait_for_ready=True))
    assert unary.value.code() == stream.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_is_open_on_the_public_port(system, pki):
    with open_blocking_channel(system.gateway, client_tls(pki)) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                           wait_for_ready=True).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_plaintext_client_gets_no_answer_from_any_port(system):
    for address in (system.gateway, system.admin, *(p.address for p in system.processes if p.role != "gateway")):
        assert call_fails(address, None, health_check) == grpc.StatusCode.UNAVAILABLE, address


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_worker_port_answers_without_a_client_certificate_of_our_ca(system, pki, role):
    address = system.worker(role).address
    assert call_fails(address, client_tls(pki), get_stats(role)) == grpc.StatusCode.UNAVAILABLE
    assert call_fails(address, client_tls(pki, pki.stranger), get_stats(role)) == grpc.StatusCode.UNAVAILABLE
    assert call_fails(address, client_tls(pki), health_check) == grpc.StatusCode.UNAVAILABLE
    if role == "prefill":  # the probe dropped another request's lease so; now no anonymous call gets through
        assert call_fails(address, client_tls(pki), release_someone_elses_lease) == grpc.StatusCode.UNAVAILABLE
    with open_blocking_channel(address, client_tls(pki, pki.client)) as channel:  # an operator's certificate
        assert get_stats(role)(channel).serving


def test_gateway_admin_is_only_on_its_own_port_behind_a_client_certificate(system, pki):
    # Not served on the public port, even with the key: no worker addresses there.
    assert call_fails(system.gateway, client_tls(pki), deployment_status) == grpc.StatusCode.UNIMPLEMENTED
    assert call_fails(system.admin, client_tls(pki), deployment_status) == grpc.StatusCode.UNAVAILABLE
    with open_blocking_channel(system.admin, client_tls(pki, pki.client)) as channel:
        workers = deployment_status(channel).workers
    assert sorted(w.role for w in workers) == ["decode", "prefill"] and all(w.reachable for w in workers)


def test_the_command_line_reaches_a_secured_deployment(system, pki, capsys):
    generate = ["generate", "--gateway", system.gateway, "--tls-ca", str(pki.ca), "--max-tokens", "3", "hello"]
    assert main([*generate, "--api-key", API_KEY]) == 0
    assert main([*generate, "--api-key", "wrong"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    operator = pki.client
    assert main(["status", "--gateway", system.admin, "--tls-ca", str(pki.ca), "--tls-cert", str(operator.cert),
                 "--tls-key", str(operator.key), "--json"]) == 0
    assert '"prefill"' in capsys.readouterr().out
    assert main(["status", "--gateway", system.admin, "--tls-ca", str(pki.ca)]) == 1


# ---------------------------------------------------------------- no deployment
def test_the_gateway_serves_gateway_admin_only_where_asked():
    """GatewayAdmin lists every worker's address: by default it is not served at all
    (anonymous callers of the public port got them), with --admin-listen ADDR apart from
    the public port, with --admin-listen public on it."""
    from gateway.server import _servers

    async def services(*flags: str) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        settings = from_args(GatewaySettings, build_parser().parse_args(
            ["gateway", "--listen", f"127.0.0.1:{free_port()}", "--decode-workers", "127.0.0.1:2", *flags]))
        public, admin = _servers(settings)
        names = public.service_names, None if admin is None else admin.service_names
        for server in {public, admin} - {None}:
            await server.server.stop(None)
        return names

    generation, gateway_admin = "baton.v1.Generation", "baton.internal.v1.GatewayAdmin"
    assert asyncio.run(services()) == ((generation,), None)
    public, admin = asyncio.run(services("--admin-listen", f"127.0.0.1:{free_port()}"))
    assert gateway_admin not in public and admin == (gateway_admin,)
    public, admin = asyncio.run(services("--admin-listen", "public"))
    assert gateway_admin in public and admin == public


def test_gateway_admin_on_the_public_port_is_behind_the_key(pki):
    """With --admin-listen public, GatewayAdmin shares the public port and its API key."""
    from gateway.admin import GatewayAdminService
    from gateway.workers import RoutingPolicy, WorkerPool

    async def scenario() -> dict[str, grpc.StatusCode]:
        tls = TlsConfig.load(str(pki.server.cert), str(pki.server.key), str(pki.ca))
        server = GrpcServer("127.0.0.1:0", ["baton.internal.v1.GatewayAdmin"],
                            credentials=tls.server_credentials(internal=False),
                            interceptors=[ApiKeyInterceptor(API_KEY)])
        admin = GatewayAdminService(WorkerPool([], [], RoutingPolicy(0, 0)))
        admin_pb2_grpc.add_GatewayAdminServicer_to_server(admin, server.server)
        await server.start()
        await server.set_serving(True)
        codes = {}
        async with grpc.aio.secure_channel(server.address, client_tls(pki).channel_credentials()) as channel:
            stub = admin_pb2_grpc.GatewayAdminStub(channel)
            keys = {"none": (), "wrong": bearer_metadata("nope"), "right": bearer_metadata(API_KEY)}
            for name, metadata in keys.items():
                try:
                    await stub.GetDeploymentStatus(admin_pb2.GetDeploymentStatusRequest(), timeout=5,
                                                   metadata=metadata)
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    codes[name] = error.code()
            health = health_pb2_grpc.HealthStub(channel)
            codes["health"] = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        await server.server.stop(None)
        return codes

    codes = asyncio.run(scenario())
    assert codes == {"none": grpc.StatusCode.UNAUTHENTICATED, "wrong": grpc.StatusCode.UNAUTHENTICATED,
                     "right": grpc.StatusCode.OK, "health": health_pb2.HealthCheckResponse.SERVING}


def parse(cls, argv: list[str], env: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(argv), env or {})


def test_tls_and_key_settings_fail_at_startup_in_one_line(pki, tmp_path):
    workers = ["--decode-workers", "127.0.0.1:1"]
    with pytest.raises(SettingsError, match="--tls-cert: cannot read .*missing.crt"):
        parse(GatewaySettings, [*workers, "--tls-cert", str(tmp_path / "missing.crt"),
                                "--tls-key", str(pki.server.key)])
    with pytest.raises(SettingsError, match="--tls-cert and --tls-key go together"):
        parse(GatewaySettings, [*workers, "--tls-cert", str(pki.server.cert)])
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(SettingsError, match="--tls-ca: .* is not PEM"):
        parse(DecodeWorkerSettings, [*tls_flags(pki.server)[:4], "--tls-ca", str(not_pem)])
    with pytest.raises(SettingsError, match="--tls-ca needs --tls-cert"):
        parse(DecodeWorkerSettings, ["--tls-ca", str(pki.ca)])
    with pytest.raises(SettingsError, match="not both"):
        parse(GatewaySettings, [*workers, "--api-key", "a", "--api-key-file", str(pki.ca)])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        parse(GatewaySettings, [*workers, "--api-key-file", str(empty)])
    env = {"BATON_API_KEY": API_KEY, "BATON_TLS_CERT": str(pki.server.cert), "BATON_TLS_KEY": str(pki.server.key),
           "BATON_TLS_CA": str(pki.ca)}
    settings = parse(GatewaySettings, workers, env=env)
    assert settings.bearer_key == API_KEY and settings.tls.is_mutual
    assert API_KEY not in repr(settings) and "PRIVATE KEY" not in repr(settings)
    assert parse(DecodeWorkerSettings, []).tls is None  # plaintext stays the default


def test_baton_up_secures_every_process_it_starts(pki, tmp_path):
    from baton.cli.launcher import UpSettings, role_args

    settings = parse(UpSettings, [*tls_flags(pki.server), "--api-key", API_KEY, "--admin-port", "50052"])
    args = role_args(settings)
    for flags in (args.worker, args.gateway):
        assert flags[flags.index("--tls-ca") + 1] == str(pki.server.ca)
        assert flags[flags.index("--tls-cert") + 1] == str(pki.server.cert)
        assert flags[flags.index("--tls-key") + 1] == str(pki.server.key)
    assert args.env == {"BATON_API_KEY": API_KEY}  # not on a command line
    assert API_KEY not in args.worker + args.gateway
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    args = role_args(parse(UpSettings, ["--api-key-file", str(key_file)]))
    # The gateway gets the logging flags every role does, and the key's file.
    assert args.gateway == ["--log-level", "INFO", "--log-format", "text", "--api-key-file", str(key_file)]
    assert args.env == {}
    with pytest.raises(SettingsError, match="--tls-key: cannot read"):
        parse(UpSettings, ["--tls-cert", str(pki.server.cert), "--tls-key", str(tmp_path / "nope")])


def test_a_peer_dialled_by_an_address_its_certificate_lacks_needs_the_server_name(pki):
    named = pki.dns_only  # DNS:baton.internal only; we dial 127.0.0.1

    async def scenario(server_name: str | None) -> grpc.StatusCode:
        tls = TlsConfig.load(str(named.cert), str(named.key), str(pki.ca))
        server = GrpcServer("127.0.0.1:0", [], credentials=tls.server_credentials(internal=True))
        await server.start()
        client = TlsConfig.load(str(pki.client.cert), str(pki.client.key), str(pki.ca), server_name,
                                serving=False)
        try:
            async with open_channel(server.address, client) as channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            return error.code()
        finally:
            await server.server.stop(None)

    assert asyncio.run(scenario(None)) == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(scenario("baton.internal")) == grpc.StatusCode.OK
