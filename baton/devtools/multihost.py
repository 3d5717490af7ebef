"""A Baton deployment over several hosts (network namespaces, netns.py): the gateway on
one, prefill and decode workers on others, each bound to its host's address only, found
by the gateway through DNS names (each host's /etc/hosts) as on Kubernetes, and pulling
KV across hosts on a fixed port range. tests/serving/test_multihost.py and the serving
benchmark's multi-host topologies run it.

    with Network(["gw", "h1", "h2"]) as net:
        cluster = MultiHost.start(net, model, logs, gateway="gw",
                                  prefill=[("prefill-0", "h1")], decode=[("decode-0", "h2")])
        ... cluster.deployment.gateway is the address to call (reachable from here) ...
        cluster.add("decode", "decode-1", "h1")   # started, then listed in DNS
        cluster.unlist("decode-1")                # no longer listed: the gateway drains it
        cluster.stop()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from baton.cli.local import Deployment, Process, spawn, wait_serving
from baton.devtools.netns import Network
from baton.runtime.settings import child_environment

GATEWAY_PORT = 50051
PORTS = {"prefill": 50061, "decode": 50062}
NAMES = {"prefill": "prefill.baton.test", "decode": "decode.baton.test"}
# The KV data plane: the rendezvous stores listen here, and each host's ephemeral ports
# (where Gloo listens) are confined to it, as a firewall open to these ports only needs.
KV_PORTS = (41000, 41999)


@dataclass
class MultiHost:
    network: Network
    deployment: Deployment
    model: str
    log_dir: Path | None
    env: dict[str, str]
    worker_args: list[str]
    role_args: dict[str, list[str]]
    hosts: dict[str, str] = field(default_factory=dict)  # worker name -> host
    roles: dict[str, str] = field(default_factory=dict)  # worker name -> role
    listed: set[str] = field(default_factory=set)  # the workers DNS names

    @classmethod
    def start(cls, network: Network, model: str, log_dir: Path | None, *, gateway: str,
              prefill: list[tuple[str, str]], decode: list[tuple[str, str]], worker_args: list[str] = (),
              prefill_args: list[str] = (), decode_args: list[str] = (), gateway_args: list[str] = (),
              threads: int = 1, timeout_s: float = 300.0) -> MultiHost:
        """Start the workers (name, host) and the gateway; wait until everything serves
        and the gateway routes to every worker."""
        env = child_environment({"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",
                                 "PYTHONUNBUFFERED": "1"})
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        for host in network.hosts:
            network.set_port_range(host, *KV_PORTS)
        gateway_address = f"{network.address(gateway)}:{GATEWAY_PORT}"
        admin_address = f"{network.address(gateway)}:{GATEWAY_PORT + 1}"
        cluster = cls(network, Deployment(gateway_address, _env=env, admin=admin_address), model, log_dir, env,
                      ["--model", model, "--threads", str(threads), *worker_args],
                      {"prefill": list(prefill_args), "decode": list(decode_args)})
        try:
            for role, workers in (("prefill", prefill), ("decode", decode)):
                for name, host in workers:
                    cluster._spawn(role, name, host)
            cluster._list()
            args = ["gateway", "--listen", gateway_address, "--model", model,
                    "--prefill-workers", f"dns:///{NAMES['prefill']}:{PORTS['prefill']}",
                    "--decode-workers", f"dns:///{NAMES['decode']}:{PORTS['decode']}",
                    "--discovery-interval-s", "0.5", "--admin-listen", admin_address, *gateway_args]
            cluster.deployment.processes.append(
                spawn("gateway", args, log_dir, env, "gateway", wrap=lambda argv: network.command(gateway, argv)))
            for process in cluster.deployment.processes:
                wait_serving(process.address, cluster.deployment, timeout_s)
            cluster.wait_routed(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, role: str, name: str, host: str) -> Process:
        address = f"{self.network.address(host)}:{PORTS[role]}"
        args = [f"{role}-worker", "--listen", address, "--worker-id", name, "--kv-ports",
                f"{KV_PORTS[0]}-{KV_PORTS[1]}", *self.worker_args, *self.role_args[role]]
        if role == "decode":
            args += ["--allowed-prefill-workers", f"dns:///{NAMES['prefill']}:{PORTS['prefill']}"]
        process = spawn(role, args, self.log_dir, self.env, name,
                        wrap=lambda argv: self.network.command(host, argv))
        self.deployment.processes.append(process)
        self.hosts[name] = host
        self.roles[name] = role
        self.listed.add(name)
        return process

    def _list(self) -> None:
        """Every host's DNS: each role's name resolves to its listed workers' hosts."""
        self.network.set_hosts({NAMES[role]: [self.hosts[name] for name in sorted(self.listed)
                                              if self.roles[name] == role] for role in NAMES})

    def address(self, name: str) -> str:
        return f"{self.network.address(self.hosts[name])}:{PORTS[self.roles[name]]}"

    def process(self, name: str) -> Process:
        return next(p for p in self.deployment.processes if p.address == self.address(name) and p.role != "gateway")

    def add(self, role: str, name: str, host: str, timeout_s: float = 300.0) -> Process:
        """Start a worker, list it in DNS once it serves, and wait until the gateway routes to it."""
        process = self._spawn(role, name, host)
        self.listed.discard(name)
        wait_serving(process.address, self.deployment, timeout_s)
        self.listed.add(name)
        self._list()
        self.wait_routed(timeout_s)
        return process

    def unlist(self, name: str, timeout_s: float = 30.0) -> Process:
        """Take a worker out of DNS and wait until the gateway no longer lists it (it routes
        it nothing new; what runs there finishes)."""
        process = self.process(name)
        self.listed.discard(name)
        self._list()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.address not in {w.address for w in self.status().workers}:
                return process
            time.sleep(0.1)
        raise TimeoutError(f"the gateway still lists {name} {timeout_s} s after it left DNS\n{self.deployment.logs()}")

    def status(self):
        with self.deployment.channel(self.deployment.admin) as channel:
            return self.deployment.admin_client(channel).get_deployment_status(timeout=10)

    def wait_routed(self, timeout_s: float) -> None:
        """Until the gateway routes to exactly the listed workers."""
        wanted = {self.address(name) for name in self.listed}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if {w.address for w in status.workers if w.in_rotation} == wanted:
                return
            time.sleep(0.1)
        raise TimeoutError(f"the gateway did not route to {sorted(wanted)} within {timeout_s} s\n"
                           f"{self.deployment.logs()}")

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        return self.deployment.stop(timeout_s)
