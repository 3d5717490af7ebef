"""Hosts on one machine, for tests and benchmarks that cross a network: each host a Linux
network namespace with one address on a bridge, its own loopback, its own ephemeral port
range and its own /etc/hosts (`ip netns exec` mounts /etc/netns/<name>/hosts over
/etc/hosts for what it runs), so a DNS name can be made to resolve to whichever hosts
the test says, and changed while processes run.

    with Network(["gw", "h1", "h2"]) as net:
        net.address("h1")                 # "10.123.45.2"
        net.command("h1", ["python", ...]) # runs in h1's namespace
        net.set_hosts({"decode.baton.test": ["h1", "h2"]})

Needs root and iproute2. The namespaces, the bridge, its veth pairs and the hosts files
are removed on close, and by `Network.cleanup_stale` after a crash (names carry the
creating process's id). This process stays in its own namespace and reaches every host
through the bridge's address.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
_PREFIX = "baton"


def available() -> str:
    """'' if network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return ""


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


class Network:
    """Hosts (network namespaces) joined by one bridge; see the module's doc."""

    def __init__(self, hosts: Sequence[str]) -> None:
        reason = available()
        if reason:
            raise RuntimeError(reason)
        pid = os.getpid()
        self.tag = f"{pid % 100000:05d}"
        # A /24 of 10/8 from our pid, so two runs at once do not collide.
        self.subnet = f"10.{100 + (pid >> 8) % 100}.{pid % 256}"
        self.bridge = f"btbr{self.tag}"
        self.hosts = {host: f"{_PREFIX}-{self.tag}-{host}" for host in hosts}
        self._addresses = {host: f"{self.subnet}.{i + 2}" for i, host in enumerate(hosts)}
        self.gateway_address = f"{self.subnet}.1"  # the bridge's, in our namespace
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, (host, namespace) in enumerate(self.hosts.items()):
            outside, inside = f"bt{self.tag}h{i}", f"bt{self.tag}n{i}"
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", namespace)
            _run("ip", "link", "set", outside, "master", self.bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{self._addresses[host]}/24", "dev", inside)
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", inside, "up")
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
            # Its own /etc/hosts (empty until set_hosts), so names resolve as the test says.
            (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / namespace / "hosts").write_text("127.0.0.1 localhost\n")

    def address(self, host: str) -> str:
        return self._addresses[host]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run in `host`'s namespace (with its /etc/hosts)."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def set_hosts(self, names: Mapping[str, Sequence[str]]) -> None:
        """Every host's /etc/hosts now maps each name to the given hosts' addresses.
        Written in place: a process's mount of the file sees the change."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self._addresses[host]} {name}" for name, hosts in names.items() for host in hosts]
        text = "\n".join(lines) + "\n"
        for namespace in self.hosts.values():
            with open(NETNS_ETC / namespace / "hosts", "r+") as file:
                file.write(text)
                file.truncate()

    def set_port_range(self, host: str, low: int, high: int) -> None:
        """`host`'s ephemeral ports (net.ipv4.ip_local_port_range, per namespace)."""
        _run("ip", "netns", "exec", self.hosts[host], "sysctl", "-q", "-w",
             f"net.ipv4.ip_local_port_range={low} {high}")

    def close(self) -> None:
        for namespace in self.hosts.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)  # takes its veth pair
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def cleanup_stale() -> None:
        """Remove what a crashed run left: namespaces, bridges and hosts files whose
        creating process is gone."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in listed:
            parts = name.split("-")
            if len(parts) >= 3 and parts[0] == _PREFIX and parts[1].isdigit() and not _tag_alive(parts[1]):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
                shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
                subprocess.run(["ip", "link", "del", f"btbr{parts[1]}"], capture_output=True)


def _tag_alive(tag: str) -> bool:
    """Whether a live process's pid ends in `tag` (pid mod 100000)."""
    return any(f"{int(pid) % 100000:05d}" == tag for pid in os.listdir("/proc") if pid.isdigit())
