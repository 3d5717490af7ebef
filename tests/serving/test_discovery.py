"""Worker discovery and the flags that make a worker reachable across hosts: targets
(addresses and `dns:///` names), their lookups (a resolver the test controls, through
getaddrinfo), the gateway's pool as workers join and leave, routing that pairs workers of
one host, the decode worker's allowlist of DNS names, the advertised address, and the KV
rendezvous's port range. tests/serving/test_multihost.py runs all of it across network
namespaces."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from baton.runtime.addresses import advertise_address, join_address, parse_target, split_address
from baton.runtime.discovery import AddressAllowlist, TargetSet
from baton.runtime.settings import DecodeWorkerSettings, GatewaySettings
from baton.runtime.values import parse_port_range
from baton.wire.records import WorkerStats
from gateway.workers import RoutingPolicy, WorkerPool
from kvtransfer.endpoint import KvEndpoint
from kvtransfer.group import StoreServer


class FakeDns:
    """getaddrinfo for the names the test sets (others go to the real one): a name maps to
    its addresses, or to a gaierror code."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: dict[str, list[str] | int] = {}
        self.lookups = 0
        real = socket.getaddrinfo

        def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
            if host not in self.names:
                return real(host, port, family, type, proto, flags)
            self.lookups += 1
            answer = self.names[host]
            if isinstance(answer, int):
                raise socket.gaierror(answer, "fake resolver")
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                    for a in answer]

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def dns(monkeypatch):
    return FakeDns(monkeypatch)


# ------------------------------------------------------------------ targets and values
def test_targets_are_addresses_or_dns_names():
    static = parse_target(" 10.0.0.5:050061 ")
    assert (static.text, static.is_dns) == ("10.0.0.5:50061", False)
    named = parse_target("dns:///Decode.Baton.svc:50062")
    assert (named.text, named.dns_name, named.port) == ("dns:///decode.baton.svc:50062", "decode.baton.svc", 50062)
    for bad in ("dns:///no-port", "http://x:1", "x", "dns:///x:0"):
        with pytest.raises(ValueError):
            parse_target(bad)
    with pytest.raises(ValueError, match="--decode-workers"):
        GatewaySettings(decode_workers=("dns://decode:1",))
    assert join_address("::1", 5) == "[::1]:5" and split_address("[::1]:5") == ("::1", 5)


def test_port_ranges():
    assert parse_port_range("40000-40099") == (40000, 40099)
    assert parse_port_range("40000") == (40000, 40000)
    for bad in ("40099-40000", "0-10", "1-70000", "a-b", ""):
        with pytest.raises(ValueError):
            parse_port_range(bad)
    assert DecodeWorkerSettings(model="dummy:tiny", kv_ports=(40000, 40010)).kv_ports == (40000, 40010)


def test_advertised_address_is_never_a_silent_wildcard_or_loopback(monkeypatch):
    assert advertise_address("10.1.2.3:50061", None) == "10.1.2.3:50061"
    assert advertise_address("127.0.0.1:50061", None) == "127.0.0.1:50061"  # loopback only: loopback
    assert advertise_address("0.0.0.0:50061", "Pod-7.baton:050061") == "pod-7.baton:50061"
    # Every interface: the host's own address, on the port listened on.
    monkeypatch.setattr("baton.runtime.addresses.primary_address", lambda: "10.9.8.7")
    assert advertise_address("0.0.0.0:50061", None) == "10.9.8.7:50061"
    assert advertise_address("[::]:50061", None) == "10.9.8.7:50061"
    monkeypatch.setattr("baton.runtime.addresses.primary_address", lambda: None)
    with pytest.raises(ValueError, match="--advertise"):
        advertise_address("0.0.0.0:50061", None)


# ------------------------------------------------------------------ lookups
def test_a_dns_name_stands_for_its_addresses_and_outages_keep_the_last(dns):
    async def scenario() -> None:
        targets = TargetSet(["10.0.0.1:7", "dns:///decode.test:50062"])
        assert targets.is_dynamic and targets.current() == ("10.0.0.1:7",)
        dns.names["decode.test"] = ["10.1.0.9", "10.1.0.7", "10.1.0.9"]
        assert await targets.resolve() == ("10.0.0.1:7", "10.1.0.7:50062", "10.1.0.9:50062")
        dns.names["decode.test"] = socket.EAI_AGAIN  # the DNS server does not answer: keep them
        assert await targets.resolve() == ("10.0.0.1:7", "10.1.0.7:50062", "10.1.0.9:50062")
        dns.names["decode.test"] = ["10.1.0.9", "fd00::5"]
        assert await targets.resolve() == ("10.0.0.1:7", "10.1.0.9:50062", "[fd00::5]:50062")
        dns.names["decode.test"] = socket.EAI_NONAME  # no such name (no ready pod): no workers
        assert await targets.resolve() == ("10.0.0.1:7",)

    asyncio.run(scenario())


def test_the_allowlist_follows_a_dns_name(dns):
    async def scenario() -> None:
        allowlist = AddressAllowlist(["10.0.0.1:50061", "dns:///prefill.test:50061"])
        assert not allowlist.is_open and allowlist.is_dynamic
        assert allowlist.dial_address("10.0.0.1:50061") == "10.0.0.1:50061"
        assert allowlist.dial_address("10.2.0.4:50061") is None  # not looked up yet
        dns.names["prefill.test"] = ["10.2.0.4"]
        await allowlist.refresh()
        assert allowlist.dial_address(" 10.2.0.4:050061") == "10.2.0.4:50061"
        assert allowlist.dial_address("10.2.0.4:50062") is None  # the name's port only
        # A new pod: a miss refreshes at most once a second (forged handles cannot make
        # the worker hammer its resolver).
        dns.names["prefill.test"] = ["10.2.0.4", "10.2.0.5"]
        lookups = dns.lookups
        await allowlist.refresh()
        assert dns.lookups == lookups and allowlist.dial_address("10.2.0.5:50061") is None
        await allowlist.refresh(force=True)
        assert allowlist.dial_address("10.2.0.5:50061") == "10.2.0.5:50061"
        # A pod that stops resolving (draining: no longer ready) stays allowed a while, so
        # the handles it gave out are still pulled; then it is forgotten.
        dns.names["prefill.test"] = ["10.2.0.5"]
        await allowlist.refresh(force=True)
        assert allowlist.dial_address("10.2.0.4:50061") == "10.2.0.4:50061"
        allowlist.RETAIN_S = 0.0
        await asyncio.sleep(0.01)
        assert allowlist.dial_address("10.2.0.4:50061") is None
        assert allowlist.dial_address("10.0.0.1:50061") == "10.0.0.1:50061"  # listed: always
        # Misses at once share one lookup.
        lookups = dns.lookups
        await asyncio.gather(*(allowlist.refresh(force=True) for _ in range(5)))
        assert dns.lookups == lookups + 1

    asyncio.run(scenario())


# ------------------------------------------------------------------ the gateway's pool
class _StatsServer:
    """GetStats on a real gRPC server bound to one loopback address."""

    def __init__(self, host: str, port: int, worker_id: str) -> None:
        self.host, self.port, self.worker_id = host, port, worker_id
        self.calls = 0

    async def GetStats(self, request, context):
        from baton.wire.internal.v1 import worker_pb2

        self.calls += 1
        return worker_pb2.WorkerStats(worker_id=self.worker_id, role="decode", serving=True,
                                      num_kv_blocks_free=100, block_size=16)

    async def start(self) -> int:
        from baton.wire.internal.v1 import worker_pb2_grpc

        self.server = grpc.aio.server()
        handler = worker_pb2_grpc.DecodeWorkerServicer()
        handler.GetStats = self.GetStats
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(handler, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        await self.server.start()
        return self.port


def test_workers_join_and_leave_through_dns(dns):
    """Two decode workers behind one name, on one port (127.0.0.2 and .3: loopback
    answers for all of 127/8): a worker the name gains is routed to once polled serving;
    one it loses is routed nothing new, still polled while requests run there, and its
    client closed once they are done."""

    async def scenario() -> None:
        first = _StatsServer("127.0.0.2", 0, "decode-a")
        port = await first.start()
        second = _StatsServer("127.0.0.3", port, "decode-b")
        await second.start()
        dns.names["decode.test"] = ["127.0.0.2"]
        pool = WorkerPool([], [f"dns:///decode.test:{port}"], RoutingPolicy(0, 0), discovery_interval_s=0.05)
        assert pool.decode == []  # nothing until looked up
        await asyncio.wait_for(pool.start(), 10)
        assert [w.address for w in pool.decode] == [f"127.0.0.2:{port}"]

        dns.names["decode.test"] = ["127.0.0.2", "127.0.0.3"]
        await _until(lambda: len(pool.decode) == 2 and all(w.routable for w in pool.decode))
        old, new = pool.decode
        picks = {pool.pick_decode(16).address for _ in range(4)}
        assert picks == {old.address, new.address}  # both take requests (by free blocks)

        detach = old.attached.take()  # a request still runs there
        dns.names["decode.test"] = ["127.0.0.3"]
        await _until(lambda: [w.address for w in pool.decode] == [new.address])
        assert old.retired and not old.routable
        assert all(pool.pick_decode(16) is new for _ in range(3))
        calls = first.calls
        await asyncio.sleep(0.3)
        assert first.calls > calls  # still polled: its request must learn if it is lost
        assert old in pool._retired
        detach()
        await _until(lambda: old not in pool._retired)  # its client closed

        # Listed again: back in rotation.
        dns.names["decode.test"] = ["127.0.0.2", "127.0.0.3"]
        await _until(lambda: len(pool.decode) == 2 and all(w.routable for w in pool.decode))
        await pool.close()
        await first.server.stop(None)
        await second.server.stop(None)

    asyncio.run(scenario())


def test_prefill_workers_on_the_decode_workers_host_are_preferred():
    async def scenario() -> None:
        pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"],
                          RoutingPolicy(0, 0, cross_host_tokens=100))
        here, there = pool.prefill
        decode = pool.decode[0]

        def endpoint(host_id: str) -> KvEndpoint:
            return KvEndpoint("h", host_id, "cpu")

        for worker, host in ((here, "host-a"), (there, "host-b"), (decode, "host-a")):
            worker.is_up = True
            worker.stats = WorkerStats(worker_id=worker.address, role=worker.role, serving=True,
                                       num_kv_blocks_free=100, kv_endpoint=endpoint(host))
        assert here.same_host(decode) and not there.same_host(decode)
        # The same-host worker wins until its queue is cross_host_tokens longer.
        assert pool.pick_prefill(60, decode) is here   # queues 0 vs 0+100
        assert pool.pick_prefill(60, decode) is here   # 60 vs 100
        assert pool.pick_prefill(60, decode) is there  # 120 vs 100
        assert pool.pick_prefill(60, decode) is here   # 120 vs 160
        # A worker whose endpoint is unknown (an older worker) counts as another host.
        here.stats = WorkerStats(worker_id="x", role="prefill", serving=True)
        assert not here.same_host(decode)
        await pool.close()

    asyncio.run(scenario())


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


# ------------------------------------------------------------------ KV ports
def _two_free_ports() -> int:
    """A port such that it and the next are free now."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            low = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", low + 1))
            except OSError:
                continue
            return low
    raise AssertionError("no two consecutive free ports")


def test_the_kv_rendezvous_takes_a_port_of_its_range():
    low = _two_free_ports()
    stores = [StoreServer("127.0.0.1", (low, low + 1)) for _ in range(2)]
    assert sorted(store.port for store in stores) == [low, low + 1]
    with pytest.raises(OSError, match="--kv-ports"):
        StoreServer("127.0.0.1", (low, low + 1))
    del stores
