"""The gateway's view of its workers: who they are, clients, load polled from each, and
the routing choice.

The workers are the addresses `--prefill-workers` and `--decode-workers` give, where a
`dns:///name:port` target stands for every address the name resolves to, looked up
again every `--discovery-interval-s` (baton/runtime/discovery.py). A worker that
appears joins the pool and is routed to from its first serving poll; one that is no
longer listed is retired: routed no new request, its requests left to finish (or to
move, if it then goes away), its client closed once none is left.

Routing follows the load each worker reported at its last poll, corrected by
what this gateway sent it since (so a burst between two polls spreads out):

- decode: the worker with the most free KV blocks, counting the prompt's blocks
  it likely holds already (prefix affinity, gateway/affinity.py) as free: it
  neither allocates nor receives those;
- prefill: the prefill worker with the least prefill work queued, this prompt's
  included: its queued prefill tokens, plus the prompt's tokens but those it
  likely holds cached, plus `--cross-host-tokens` for one on another host than
  the decode worker (same host: the KV moves over shared memory, ipc). A hot
  prefix thus stays on the worker that caches it until that worker's queue
  outgrows the prefill it saves, then spreads. Unless the RoutingPolicy
  says the chosen decode worker should prefill the prompt itself (conditional
  disaggregation): a prompt too short to be worth a handoff, or prefill workers
  so backed up that the decode worker, with less prefill queued, gets the
  prompt's first token out sooner.

A worker that fails a poll or a call is marked down and skipped until a
later poll finds it serving again (the poller's, or one a request makes when
it finds no decode worker up).

A worker that stops answering is lost, whether dead, frozen or its engine thread
stuck: a GetStats waits for the engine thread, so one that does not answer within
the worker's stall timeout (several of its recent steps, at least
`--stall-timeout-s`) means no step is coming. Marking a worker down sets its
`lost` event, which the requests running there wait on (gateway/dispatch.py
moves them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from baton.runtime.clients import DecodeWorkerClient, PrefillWorkerClient
from baton.runtime.discovery import TargetSet
from baton.runtime.security import TlsConfig
from baton.runtime.settings import GatewaySettings
from baton.wire.records import ModelInfo, WorkerStats
from gateway.affinity import PrefixIndex, PromptBlocks

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
POLL_TIMEOUT_S = 2.0
# A request that found no decode worker up waits at most this long for a fresh poll.
REFRESH_TIMEOUT_S = 0.5
# A worker is stalled when it has not answered for this many of its recent mean step
# times (and at least the configured minimum): a step far longer than the recent mean
# (a long prefill chunk among decodes) must not count as a stall.
STALL_STEPS = 50
# ... nor a burst's first steps, each a full token budget of prefill, however short the
# recent ones were: this many of those, by the worker's own model.
STALL_FULL_STEPS = 3


class Holds:
    """A count of holders: `with holds.held():` around a use, or `take()` for one that
    another task releases (idempotent, so a release on every path is safe)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def held(self):
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1

    def take(self) -> Callable[[], None]:
        """Hold now; the returned function lets go (once, however often it is called)."""
        self.count += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.count -= 1

        return release


@dataclass(frozen=True)
class RoutingPolicy:
    """When a prompt is prefilled on its decode worker instead of a prefill worker.

    `max_local_prefill_tokens`: prompts of at most this many tokens are prefilled
    locally: for them the handoff (a prefill RPC, a transfer, a second hop) costs
    about what the prefill saves the decode batch. `max_prefill_queue_tokens`:
    when the least-loaded prefill worker has more than this many prompt tokens
    queued, a prompt goes to the decode worker if that one has fewer queued, so a
    burst of prompts does not wait behind one prefill worker while decode workers
    have room. Both 0: every prompt goes to a prefill worker while one is up.
    """

    max_local_prefill_tokens: int
    max_prefill_queue_tokens: int
    # A prefill worker on another host than the decode worker counts as this many more
    # queued tokens: its handoff crosses the network instead of shared memory.
    cross_host_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0 or self.max_prefill_queue_tokens < 0 or self.cross_host_tokens < 0:
            raise ValueError("routing thresholds must be >= 0")

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> RoutingPolicy:
        return cls(settings.max_local_prefill_tokens, settings.max_prefill_queue_tokens, settings.cross_host_tokens)

    def prefill_locally(self, num_prompt_tokens: int, prefill_queue: int, decode_queue: int) -> bool:
        """Whether a prompt goes to its decode worker, given the queued prefill tokens of
        the least-loaded prefill worker and of the decode worker."""
        if num_prompt_tokens <= self.max_local_prefill_tokens:
            return True
        return 0 < self.max_prefill_queue_tokens < prefill_queue and decode_queue < prefill_queue


@dataclass
class Worker:
    """One worker as the gateway sees it."""

    address: str
    role: str  # "prefill" | "decode"
    client: PrefillWorkerClient | DecodeWorkerClient
    is_up: bool = False
    # As of the last poll; block_size and the limits are the worker's own.
    stats: WorkerStats = field(default_factory=lambda: WorkerStats(worker_id="", role="", serving=False))
    # Sent since the last poll: prompt tokens (prefill), blocks (decode).
    pending_prefill_tokens: int = 0
    pending_blocks: int = 0
    # Each a count of holders, taken around a use (`with worker.in_flight.held():`); while
    # any is held, a retired worker's client stays open (closing a grpc.aio channel cancels
    # the tasks awaiting its calls).
    in_flight: Holds = field(default_factory=Holds)  # calls on it under way (its load)
    attached: Holds = field(default_factory=Holds)  # requests that picked it and may call it
    polls: Holds = field(default_factory=Holds)  # GetStats calls on it under way
    min_stall_timeout_s: float = 1.0
    # Set when the worker is marked down; a fresh one once it is back.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # No longer listed (its DNS name no longer resolves to it): routed nothing new.
    retired: bool = False
    # What its prefix cache likely holds, as this gateway routed to it.
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def stall_timeout_s(self) -> float:
        """How long this worker may leave a request or a poll unanswered before it counts
        as stalled: STALL_STEPS of its recent mean step time (the time in its steps, not
        the idle gaps between them: a worker that served a request now and then read as
        one of seconds-long steps, and a frozen one went unnoticed for half a minute), or
        STALL_FULL_STEPS of a step that fills its token budget with prefill (by its
        published model: a burst's first steps are that long, however short its recent
        ones were), at least the minimum."""
        recent = self.stats.recent
        step_s = recent.busy_seconds / recent.num_steps if recent is not None and recent.num_steps > 1 else 0.0
        full_step_s = self.stats.prefill_s(self.stats.max_num_batched_tokens) or 0.0
        return max(self.min_stall_timeout_s, STALL_STEPS * step_s, STALL_FULL_STEPS * full_step_s)

    def set_up(self, up: bool, *, lost: bool = False) -> None:
        """In rotation or not. `lost`: it did not answer (or broke a call), and requests
        there move; one that answers it is not serving (draining) keeps its own."""
        if up and self.lost.is_set():
            self.lost = asyncio.Event()
        elif lost:
            self.lost.set()
            self.prefix.clear()  # back, it may be a new process with an empty cache
        self.is_up = up

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled here, as of the last poll plus since."""
        return self.stats.num_queued_prefill_tokens + self.pending_prefill_tokens

    def load_key(self) -> tuple[int, int]:
        if self.role == "prefill":
            return (self.queued_prefill_tokens, self.in_flight.count)
        return (-(self.stats.num_kv_blocks_free - self.pending_blocks), self.in_flight.count)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks `num_tokens` take in this worker's cache (its block size, from its stats)."""
        return -(-num_tokens // max(self.stats.block_size, 1))

    def cached_blocks(self, prompt: PromptBlocks | None) -> int:
        """Full blocks of `prompt`, from its start, that this worker's device cache likely holds."""
        return self._matched_tiers(prompt)[0]

    def _matched_tiers(self, prompt: PromptBlocks | None) -> tuple[int, int]:
        """Full blocks of `prompt`, from its start, this worker likely holds: in its device
        cache, then in its host tier (PrefixIndex.matched_tiers)."""
        block_size = self.stats.block_size
        if prompt is None or not self.prefix.capacity or block_size <= 0:
            return 0, 0
        return self.prefix.matched_tiers(prompt.hashes(block_size))

    def cached_prefill_tokens(self, prompt: PromptBlocks | None) -> int:
        """Tokens of `prompt` this worker would likely not compute: its cached blocks (those
        of its host tier weighted by what their copy back saves: `host_tier_weight`), but
        never the last token (which a prefill always computes)."""
        if prompt is None:
            return 0
        device, host = self._matched_tiers(prompt)
        block_size = max(self.stats.block_size, 1)
        num_tokens = len(prompt.token_ids)
        cached = round((device + host * self.host_tier_weight()) * block_size)
        return min(cached, (num_tokens - 1) // block_size * block_size)

    def host_tier_weight(self) -> float:
        """The share of a prompt token's prefill time that finding it in the host tier saves:
        1 - (its KV's copy back) / (its recompute), by the worker's published figures (1
        until it has measured its prefill)."""
        stats = self.stats
        if stats.prefill_s_per_token <= 0 or stats.kv_copy_bytes_per_s <= 0:
            return 1.0
        copy_s = stats.kv_block_bytes / max(stats.block_size, 1) / stats.kv_copy_bytes_per_s
        return max(0.0, 1.0 - copy_s / stats.prefill_s_per_token)

    def routed(self, prompt: PromptBlocks | None) -> None:
        """`prompt` was sent here: its blocks will be in this worker's cache."""
        if prompt is not None and self.prefix.capacity and self.stats.block_size > 0:
            self.prefix.add(prompt.hashes(self.stats.block_size))

    @property
    def is_held(self) -> bool:
        """Whether anything may still call it: a request, a call, a poll."""
        return bool(self.attached.count or self.in_flight.count or self.polls.count)

    @property
    def routable(self) -> bool:
        return self.is_up and not self.retired

    def same_host(self, other: Worker) -> bool:
        """Whether the two workers' caches share a host (a handoff between them can go over
        ipc), as their last polls said."""
        mine, theirs = self.stats.kv_endpoint, other.stats.kv_endpoint
        return mine is not None and theirs is not None and mine.host_id == theirs.host_id


class WorkerPool:
    """The workers (as discovered), a client for each, a background poller, and `pick_*`."""

    def __init__(self, prefill_targets: list[str], decode_targets: list[str], policy: RoutingPolicy,
                 tls: TlsConfig | None = None, stall_timeout_s: float = 1.0,
                 discovery_interval_s: float = 5.0) -> None:
        self.policy = policy
        self.tls = tls
        self.stall_timeout_s = stall_timeout_s
        self.discovery_interval_s = discovery_interval_s
        self.targets = {"prefill": TargetSet(prefill_targets), "decode": TargetSet(decode_targets)}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._retired: list[Worker] = []  # no longer listed, requests still running there
        self._update("prefill", self.targets["prefill"].current())
        self._update("decode", self.targets["decode"].current())
        self._poller: asyncio.Task | None = None
        self._discoverer: asyncio.Task | None = None
        self._refresh: asyncio.Future | None = None

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    @property
    def is_dynamic(self) -> bool:
        return any(targets.is_dynamic for targets in self.targets.values())

    async def start(self) -> None:
        """Find and poll every worker, start the poller (and the discoverer), and wait
        until a decode worker is up: without one the gateway can serve nothing (the
        caller bounds the wait)."""
        await self.discover()
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())
        if self.is_dynamic:
            self._discoverer = asyncio.create_task(self._discover_forever())
        while not any(worker.routable for worker in self.decode):
            for task in (self._poller, self._discoverer):
                if task is not None and task.done():  # it raised: report that, not a timeout
                    task.result()
            await asyncio.sleep(POLL_INTERVAL_S)

    async def close(self) -> None:
        for task in (self._poller, self._discoverer):
            if task is not None:
                task.cancel()
        for worker in self.workers + self._retired:
            await worker.client.close()

    async def model_info(self) -> ModelInfo:
        """The served model, from the first worker that answers (waits for one to load;
        the caller bounds the wait)."""
        while True:
            for worker in self.decode + self.prefill:
                try:
                    return await worker.client.get_model_info(timeout=POLL_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    continue
            await asyncio.sleep(0.5)
            await self.discover()

    # ------------------------------------------------------------------ discovery
    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # noqa: BLE001 - the pool stays as it was; the next round tries again
                logger.exception("worker discovery failed")

    async def discover(self) -> None:
        """Resolve the targets again: workers that appeared join (routed to once a poll
        finds them serving), workers that are gone are retired."""
        for role, targets in self.targets.items():
            if targets.is_dynamic:
                self._update(role, await targets.resolve())
        await self._close_retired()

    def _update(self, role: str, addresses: tuple[str, ...]) -> None:
        current = {worker.address: worker for worker in getattr(self, role)}
        workers = []
        for address in addresses:
            worker = current.pop(address, None)
            if worker is None:
                worker = next((w for w in self._retired if w.address == address and w.role == role), None)
                if worker is not None:  # listed again before its requests were done: keep its client
                    self._retired.remove(worker)
                    worker.retired = False
                    logger.info("%s worker %s is listed again", role, address)
                else:
                    worker = self._new_worker(address, role)
                    logger.info("%s worker %s joined", role, address)
            workers.append(worker)
        for worker in current.values():  # listed no longer
            worker.retired = True
            self._retired.append(worker)
            logger.info("%s worker %s is no longer listed: no new requests, %d in flight finish there",
                        role, worker.address, worker.attached.count)
        setattr(self, role, workers)

    def _new_worker(self, address: str, role: str) -> Worker:
        client_type = PrefillWorkerClient if role == "prefill" else DecodeWorkerClient
        return Worker(address, role, client_type(address, tls=self.tls), min_stall_timeout_s=self.stall_timeout_s)

    async def _close_retired(self) -> None:
        """Close the clients of retired workers no request will call again."""
        # NOTE: closing a grpc.aio channel cancels the tasks awaiting calls on it, so none may be.
        done = [worker for worker in self._retired if not worker.is_held]
        for worker in done:  # out of the pool before any await
            self._retired.remove(worker)
        for worker in done:
            await worker.client.close()

    # ------------------------------------------------------------------ polling
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                await self.poll_once()
                await self._close_retired()
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the pool is closing
                    raise
                logger.warning("a poll was cancelled under the poller; polling on")
            except Exception:  # noqa: BLE001 - never stop polling: routing and lost workers depend on it
                logger.exception("polling the workers failed")

    async def poll_once(self) -> None:
        # Retired workers too, while requests hold them: those need to know if it is lost.
        # (One nothing holds is not polled: a pod gone with its address would stretch
        # every round to the poll timeout.)
        held = [worker for worker in self._retired if worker.attached.count or worker.in_flight.count]
        await asyncio.gather(*(self._poll(worker) for worker in self.workers + held))

    async def refresh_decode(self) -> None:
        """Poll the decode workers now (a request found none up at the last poll; one
        may have come back since). Concurrent callers share one round of polls, and
        none waits more than REFRESH_TIMEOUT_S for it: a hung worker must not hold
        every request up for a full poll timeout."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(asyncio.gather(
                *(self._poll(worker, REFRESH_TIMEOUT_S) for worker in self.decode), return_exceptions=True))
        try:
            await asyncio.wait_for(asyncio.shield(self._refresh), REFRESH_TIMEOUT_S)
        except TimeoutError:
            pass

    async def _poll(self, worker: Worker, timeout_s: float | None = None) -> bool:
        """Poll `worker` (within its stall timeout, or `timeout_s`); whether it answered."""
        if timeout_s is None:
            timeout_s = max(POLL_TIMEOUT_S, worker.stall_timeout_s)
        try:
            with worker.polls.held():
                stats = await worker.client.get_stats(timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as error:  # UsageError: its client closed
            if worker.is_up and not worker.retired:
                logger.warning("%s worker %s is down: %s", worker.role, worker.address,
                               error.code().name if isinstance(error, grpc.aio.AioRpcError) else error)
            worker.set_up(False, lost=True)
            return False
        if not worker.is_up and stats.serving and not worker.retired:
            logger.info("%s worker %s (%s) is up", worker.role, worker.address, stats.worker_id)
        elif worker.is_up and not stats.serving and not worker.retired:
            logger.warning("%s worker %s is not serving (draining or failed)", worker.role, worker.address)
        worker.set_up(stats.serving)
        worker.stats = stats
        worker.prefix.sync(stats.worker_id, stats.prefix_caching, stats.num_kv_blocks_total,
                           stats.num_kv_offload_blocks_total)
        worker.pending_prefill_tokens = 0
        worker.pending_blocks = 0
        return True

    async def probe(self, worker: Worker) -> bool:
        """Whether `worker` is alive: it answers a poll within its stall timeout (a request
        there has waited that long with no token; it may just be queued, or the worker
        draining)."""
        return await self._poll(worker, worker.stall_timeout_s)

    def mark_down(self, worker: Worker) -> None:
        """`worker` broke a call: out of rotation, and the requests there move."""
        worker.set_up(False, lost=True)

    # ------------------------------------------------------------------ routing
    def pick_prefill(self, num_prompt_tokens: int, decode: Worker, prompt: PromptBlocks | None = None) -> Worker | None:
        """The prefill worker for a prompt whose decode worker is `decode`: the one with
        the least prefill work queued once the prompt's is added (its queued prefill
        tokens, plus the prompt's tokens it likely does not hold cached, plus the
        policy's `cross_host_tokens` for a worker on another host than `decode`), or
        None when none is up or the policy keeps the prompt on `decode` (the caller then
        prefills there). `prompt`: the prompt's blocks, for prefix affinity."""
        worker = min((w for w in self.prefill if w.routable), key=lambda w: self._prefill_key(w, decode, prompt),
                     default=None)
        if worker is not None and self.policy.prefill_locally(
            num_prompt_tokens, worker.queued_prefill_tokens, decode.queued_prefill_tokens
        ):
            worker = None
        chosen = worker or decode
        # The work it was given: what it will compute (its queue counts the same).
        chosen.pending_prefill_tokens += num_prompt_tokens - chosen.cached_prefill_tokens(prompt)
        # Both will cache the prompt's blocks: the one that prefills it, and the decode
        # worker (received or prefilled there).
        chosen.routed(prompt)
        if chosen is not decode:
            decode.routed(prompt)
        return worker

    def _prefill_key(self, worker: Worker, decode: Worker, prompt: PromptBlocks | None) -> tuple[int, int]:
        queued, in_flight = worker.load_key()
        penalty = 0 if worker.same_host(decode) else self.policy.cross_host_tokens
        return (queued + penalty - worker.cached_prefill_tokens(prompt), in_flight)

    @staticmethod
    def prefill_moved(prefill: Worker, decode: Worker, num_prompt_tokens: int) -> None:
        """A prompt sent to `prefill` is prefilled on `decode` after all (prefill unreachable)."""
        prefill.pending_prefill_tokens = max(0, prefill.pending_prefill_tokens - num_prompt_tokens)
        decode.pending_prefill_tokens += num_prompt_tokens

    def pick_decode(self, num_tokens: int, avoid: frozenset[str] = frozenset(),
                    prompt: PromptBlocks | None = None) -> Worker | None:
        """The decode worker with the most free KV blocks, counting the blocks of `prompt`
        it likely holds already as free, but those at the `avoid` addresses; None when
        none is up."""
        def key(worker: Worker) -> tuple[int, int]:
            minus_free, in_flight = worker.load_key()
            return (minus_free - worker.cached_blocks(prompt), in_flight)

        worker = min((w for w in self.decode if w.routable and w.address not in avoid), key=key, default=None)
        if worker is not None:
            # (Its prefix index learns the prompt in pick_prefill, which follows.)
            worker.pending_blocks += max(0, worker.blocks_for(num_tokens) - worker.cached_blocks(prompt))
        return worker
