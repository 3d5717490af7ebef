"""Worker addresses as `host:port`, normalized so that two spellings of one address
compare equal; the address a worker advertises; worker targets (an address, or a DNS
name standing for every address it resolves to); the allowlist of prefill workers a
decode worker pulls KV from (discovery.py).

    normalize_address(" Prefill-0.Baton:050061")  -> "prefill-0.baton:50061"
    normalize_address("[0:0::1]:50061")           -> "[::1]:50061"

`normalize_address` resolves no name: `localhost:50061` and `127.0.0.1:50061` are
different addresses. A target `dns:///name:port` is resolved (baton/runtime/discovery.py),
each address it yields standing for one worker: a Kubernetes headless Service's name
resolves to every ready pod behind it.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from kvtransfer.endpoint import source_address

# A target naming every address a DNS name resolves to (gRPC's spelling of a DNS target).
DNS_SCHEME = "dns:///"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})

# A DNS name or an IPv4 address: letters, digits, dots, hyphens and underscores.
_HOST_NAME = re.compile(r"[a-z0-9_][a-z0-9_.-]*")


def normalize_address(address: str) -> str:
    """`address` as `host:port`: surrounding whitespace gone, the host in lower case, an
    IP address in its canonical form (IPv6 in brackets), the port without leading zeros.
    ValueError unless it is a host and a port in 1-65535."""
    text = address.strip()
    if text.startswith("["):
        host, bracket, port = text[1:].partition("]:")
        ipv6 = _ipv6(host) if bracket else None
        host = f"[{ipv6.compressed}]" if ipv6 is not None else ""
    else:
        host, _, port = text.rpartition(":")
        host = host.lower()
        if _ipv6(host) is not None:
            raise ValueError(f"{address!r}: an IPv6 address goes in brackets, as in [::1]:50061")
        try:
            host = ipaddress.IPv4Address(host).compressed
        except ValueError:
            if not _HOST_NAME.fullmatch(host):
                host = ""
    if not host:
        raise ValueError(f"{address!r} is not host:port")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{address!r}: the port must be a number in 1-65535")
    return f"{host}:{int(port)}"


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a normalized address; an IPv6 host without its brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """`host:port`, normalized (an IPv6 host in brackets)."""
    return normalize_address(f"[{host}]:{port}" if _ipv6(host) is not None else f"{host}:{port}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def primary_address() -> str | None:
    """This host's address towards the rest of the network: the source address of its
    default route (a UDP connect sends nothing), else its hostname's first address that
    is not loopback; None if it has neither."""
    for probe in ("192.0.2.1", "2001:db8::1"):  # documentation addresses: any routed one will do
        try:
            return source_address(probe, 9)
        except OSError:
            continue
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return next((info[4][0] for info in infos if not is_loopback(info[4][0])), None)


def advertise_address(listening: str, advertise: str | None) -> str:
    """The address peers reach a worker at: `advertise` if given; else the address it
    listens on (`listening`, its port resolved), when that names one interface; else,
    listening on every interface, this host's primary address (`primary_address`) on
    the same port. Never loopback unless the worker listens on loopback only.
    ValueError if nothing can be derived (set --advertise)."""
    if advertise:
        return normalize_address(advertise)
    host, _, port = listening.rpartition(":")
    if host not in WILDCARD_HOSTS:
        return normalize_address(listening)
    primary = primary_address()
    if primary is None:
        raise ValueError(f"listening on {listening}, every interface, and this host has no address but "
                         "loopback to advertise: set --advertise to the address peers reach this worker at")
    return join_address(primary, int(port))


@dataclass(frozen=True, slots=True)
class Target:
    """A worker, or a DNS name standing for as many workers as it has addresses."""

    text: str  # as given, normalized
    dns_name: str = ""  # set for `dns:///name:port`
    port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_name)


def parse_target(text: str) -> Target:
    """`host:port` (one worker), or `dns:///name:port` (one worker per address the name
    resolves to, re-resolved over time). ValueError if it is neither."""
    stripped = text.strip()
    if stripped.startswith(DNS_SCHEME):
        address = normalize_address(stripped[len(DNS_SCHEME):])
        name, port = split_address(address)
        return Target(DNS_SCHEME + address, dns_name=name, port=port)
    if "://" in stripped:
        raise ValueError(f"{text!r}: a worker is host:port or {DNS_SCHEME}name:port")
    return Target(normalize_address(stripped))


def _ipv6(host: str) -> ipaddress.IPv6Address | None:
    try:
        return ipaddress.IPv6Address(host)
    except ValueError:
        return None
