"""Worker discovery, and the allowlist of the peers a worker may dial.

A list of targets (addresses, and DNS names standing for every address they resolve
to) is turned into the set of worker addresses, again and again:

    targets = TargetSet(["10.0.0.5:50061", "dns:///decode.baton.svc:50062"])
    addresses = await targets.resolve()   # ("10.0.0.5:50061", "10.1.0.7:50062", "10.1.0.9:50062")

A Kubernetes headless Service's name resolves to the addresses of its ready pods, so
re-resolving it finds pods that joined and misses pods that left (or are no longer
ready). Names are looked up with the system's resolver (getaddrinfo: /etc/hosts, then
DNS) on a thread, never on the event loop.

A lookup that fails for a reason that says nothing about the name (a DNS server not
answering, a timeout) keeps the name's last addresses: a DNS outage must not empty
the worker set. A name that does not exist (NXDOMAIN, or no address: a headless
Service with no ready pod) has no workers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterable

from baton.runtime.addresses import Target, join_address, normalize_address, parse_target

logger = logging.getLogger(__name__)

# A lookup longer than this keeps the name's last addresses (the resolver's own retries
# may take longer; its thread finishes on its own).
LOOKUP_TIMEOUT_S = 10.0
# getaddrinfo's answers for "this name has no address", as opposed to "could not ask".
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class TargetSet:
    """Targets, in order, and the addresses each DNS name had at its last good lookup."""

    def __init__(self, targets: Iterable[str | Target]) -> None:
        self.targets = tuple(t if isinstance(t, Target) else parse_target(t) for t in targets)  # ValueError
        self._last: dict[Target, tuple[str, ...]] = {}

    @property
    def is_dynamic(self) -> bool:
        """Whether resolving again may change the addresses (a DNS name is among the targets)."""
        return any(target.is_dns for target in self.targets)

    def current(self) -> tuple[str, ...]:
        """The addresses as of the last resolve (the static ones before any)."""
        return _unique(address for target in self.targets
                       for address in ((target.text,) if not target.is_dns else self._last.get(target, ())))

    async def resolve(self) -> tuple[str, ...]:
        """Every target's addresses now, in target order, each once."""
        await asyncio.gather(*(self._lookup(target) for target in self.targets if target.is_dns))
        return self.current()

    async def _lookup(self, target: Target) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(target.dns_name, target.port, type=socket.SOCK_STREAM), LOOKUP_TIMEOUT_S)
        except (TimeoutError, OSError) as error:  # socket.gaierror is an OSError
            if isinstance(error, socket.gaierror) and error.errno in _NO_SUCH_NAME:
                self._set(target, ())
            else:
                logger.warning("could not resolve %s (%s): keeping its %d last addresses", target.text,
                               error or type(error).__name__, len(self._last.get(target, ())))
            return
        # Sorted, so that the order does not follow the resolver's round robin.
        self._set(target, tuple(sorted(_unique(join_address(info[4][0], target.port) for info in infos))))

    def _set(self, target: Target, addresses: tuple[str, ...]) -> None:
        if self._last.get(target) != addresses:
            logger.info("%s resolves to %s", target.text, ", ".join(addresses) or "no address")
        self._last[target] = addresses


ANY = "*"  # an allowlist of this alone allows every address


class AddressAllowlist:
    """The peers a worker dials on a caller's word (a decode worker: the prefill workers
    named in KV handles). Empty: none (closed: a caller's word makes it dial nothing);
    ANY alone: any address, unchecked (open, for a network where every caller is trusted).

    Entries are addresses or `dns:///name:port` targets: a DNS name allows every address
    it resolved to within the last RETAIN_S (a Kubernetes headless Service of prefill
    pods, whose addresses change as pods come and go: a pod that is draining is no
    longer listed, but the KV handles it gave out must still be pulled).
    """

    # A miss refreshes the DNS entries at most this often (a forged handle must not make
    # this worker hammer its resolver); concurrent misses share one lookup.
    REFRESH_MIN_INTERVAL_S = 1.0
    # An address a name resolved to stays allowed this long after it stops resolving:
    # longer than a prefill worker's grace period plus its lease.
    RETAIN_S = 300.0

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        addresses = tuple(addresses)
        self._any = addresses == (ANY,)
        self.targets = TargetSet(() if self._any else addresses)  # ValueError if one is bad
        self._static = frozenset(self.targets.current())
        self._seen: dict[str, float] = {}  # resolved address -> when it last resolved
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task | None = None

    @property
    def is_open(self) -> bool:
        """Any address is dialled."""
        return self._any

    @property
    def is_closed(self) -> bool:
        """No address is dialled."""
        return not self._any and not self.targets.targets

    @property
    def is_dynamic(self) -> bool:
        return self.targets.is_dynamic

    @property
    def addresses(self) -> frozenset[str]:
        """The addresses allowed now."""
        oldest = time.monotonic() - self.RETAIN_S
        return self._static | {address for address, seen in self._seen.items() if seen >= oldest}

    def dial_address(self, address: str) -> str | None:
        """The address to dial for a peer named `address`: its listed, normalized form,
        or None if the list does not have it (none, when it is closed); `address` itself
        when the list is open."""
        if self.is_open:
            return address
        try:
            normalized = normalize_address(address)
        except ValueError:
            return None
        return normalized if normalized in self.addresses else None

    async def refresh(self, *, force: bool = False) -> None:
        """Resolve the DNS entries again (unless done within REFRESH_MIN_INTERVAL_S, or
        `force`); a refresh under way is waited for, not repeated."""
        if not self.is_dynamic:
            return
        if self._refreshing is None or self._refreshing.done():
            if not force and time.monotonic() - self._refreshed_at < self.REFRESH_MIN_INTERVAL_S:
                return
            self._refreshed_at = time.monotonic()
            self._refreshing = asyncio.ensure_future(self._resolve())
        await asyncio.shield(self._refreshing)

    async def _resolve(self) -> None:
        addresses = await self.targets.resolve()
        now = time.monotonic()
        for address in addresses:
            self._seen[address] = now
        oldest = now - self.RETAIN_S
        self._seen = {address: seen for address, seen in self._seen.items() if seen >= oldest}

    def __repr__(self) -> str:
        return f"AddressAllowlist({[target.text for target in self.targets.targets]})"


def _unique(addresses: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(addresses))
