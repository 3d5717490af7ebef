"""Worker addresses as `host:port`, normalized so that two spellings of one address
compare equal, and the allowlist of prefill workers a decode worker pulls KV from.

    normalize_address(" Prefill-0.Baton:050061")  -> "prefill-0.baton:50061"
    normalize_address("[0:0::1]:50061")           -> "[::1]:50061"

No name is resolved: `localhost:50061` and `127.0.0.1:50061` are different addresses.
List the addresses the prefill workers advertise (their `--advertise`, else their
`--listen`), which is what their KV handles carry.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

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


def _ipv6(host: str) -> ipaddress.IPv6Address | None:
    try:
        return ipaddress.IPv6Address(host)
    except ValueError:
        return None


class AddressAllowlist:
    """The peers a worker dials on a caller's word (a decode worker: the prefill workers
    named in KV handles). Empty: any address, unchecked (open, as plaintext is).

    NOTE: the one place such an address is checked; a list of DNS names re-resolved
    over time (issue 16) belongs here, behind `dial_address`.
    """

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        self.addresses = frozenset(normalize_address(address) for address in addresses)  # ValueError if one is bad

    @property
    def is_open(self) -> bool:
        return not self.addresses

    def dial_address(self, address: str) -> str | None:
        """The address to dial for a peer named `address`: its listed, normalized form,
        or None if the list does not have it; `address` itself when the list is open."""
        if self.is_open:
            return address
        try:
            normalized = normalize_address(address)
        except ValueError:
            return None
        return normalized if normalized in self.addresses else None

    def __repr__(self) -> str:
        return f"AddressAllowlist({sorted(self.addresses)})"
