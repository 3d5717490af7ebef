"""What crosses a process boundary, as the rest of Baton sees it: named records.

Servicers and clients hand these to `baton.wire.convert`, the one module that
builds and reads the protobuf messages (protos/ says what each field means on the
wire). Records of the engine and of kvtransfer are used as they are where they fit
(SamplingParams, TokenLogprobs, RecentStats, KvLayoutSpec, Rendezvous).

Finish reasons are the engine's words: "stop" or "length" once finished, None before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler.stats import RecentStats
from kvtransfer.layout import KvLayoutSpec
from kvtransfer.transport import Rendezvous

# ------------------------------------------------------------------ errors
class FieldError(ValueError):
    """A request field holds a value Baton refuses. `field` is the field's path in the
    request message ("params.temperature", "messages[2].role"), for the
    google.rpc.BadRequest the caller gets with INVALID_ARGUMENT."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What an error status carries besides its code and message (google.rpc.Status
    details): the fields at fault (BadRequest), and when to try again (RetryInfo)."""

    field_violations: tuple[tuple[str, str], ...] = ()  # (field path, what is wrong)
    retry_after_s: float | None = None

    def __bool__(self) -> bool:
        return bool(self.field_violations) or self.retry_after_s is not None


# ------------------------------------------------------------------ public API
@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model, as a worker reports it and the gateway passes it on."""

    model: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A client's request as the gateway receives it: read, not yet validated or tokenized.

    `prompt_kind` names the one prompt field set ("text", "token_ids", "messages";
    None: none was), and `prompt` holds it: a str, token ids, or chat messages.
    """

    request_id: str  # "": the gateway assigns one
    prompt_kind: str | None
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True, slots=True)
class TextDelta:
    """One message of a client's stream: the tokens and text since the previous one. The
    last has `finish_reason`, what stopped it, and the token counts."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that matched ("stop")
    stop_token_id: int | None = None  # else the EOS or stop token that was sampled ("stop")
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


# ------------------------------------------------------- gateway to workers
@dataclass(frozen=True, slots=True)
class WorkRequest:
    """A validated, tokenized request as the gateway hands it to a worker. `params` has
    no stop strings: the gateway owns the text and applies them itself.

    `kv_token` (sent with a Prefill only) is the secret the gateway chose for the KV the
    prefill worker will hold: ReleaseKv and SendKv must present it (the decode worker
    gets it in the KvHandle), so nobody else can drop, abort or consume that KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    kv_token: str = ""


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Where a prompt's KV is held for a handoff, and how long it waits to be pulled."""

    prefill_worker_id: str
    prefill_address: str  # its gRPC address, for OpenKvChannel and SendKv
    request_id: str
    num_tokens: int  # the whole prompt
    num_blocks: int
    layout: KvLayoutSpec
    lease_s: float
    kv_token: str  # the secret SendKv presents (WorkRequest.kv_token)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill's first token, and the handle of its held KV unless that token ended it."""

    first_token_id: int
    first_logprob: TokenLogprobs | None = None
    finish_reason: str | None = None  # set: nothing is held, kv_handle is None
    kv_handle: KvHandle | None = None


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Decode `request`; with a handle, from the prefill worker's KV after `first_token_id`,
    else prefilling the prompt on the decode worker (colocated)."""

    request: WorkRequest
    first_token_id: int | None = None
    kv_handle: KvHandle | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of a request, from a worker; the last event has `finish_reason` set."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the EOS or stop token that ended it ("stop")


# ------------------------------------------------------- the KV handoff's control
@dataclass(frozen=True, slots=True)
class OpenKvChannel:
    """A decode worker asks a prefill worker to join the data channel it hosts."""

    rendezvous: Rendezvous
    layout: KvLayoutSpec  # the decode worker's cache blocks; must equal the prefill worker's
    decode_worker_id: str


@dataclass(frozen=True, slots=True)
class KvChannelOpened:
    prefill_worker_id: str
    backend: str  # the transport the channel uses, e.g. "gloo" or "nccl"


@dataclass(frozen=True, slots=True)
class SendKv:
    """Send a held request's blocks over an open channel into the receiver's `block_ids`
    (held block i lands in block_ids[i])."""

    channel_id: str
    request_id: str
    tag: int  # the transfer's messages on the channel; unique per channel
    num_blocks: int  # the receiver allocated; the sender checks it against what it holds
    block_ids: list[int]
    verify: bool = False  # also return a checksum per sent block
    kv_token: str = ""  # the handle's: the KV is sent only to a caller that knows it


@dataclass(frozen=True, slots=True)
class ReleaseKv:
    """Drop the KV held (or being prefilled) for a request; `kv_token` must be its owner's."""

    request_id: str
    kv_token: str


@dataclass(frozen=True, slots=True)
class SendKvAccepted:
    """The lease is pinned and the send starts: the sender's blocks, in order."""

    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class SendKvDone:
    block_checksums: list[int]  # kvtransfer.block_checksums of the sent blocks, when verify
    num_bytes: int
    seconds: float


# ------------------------------------------------------------------ load and status
@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's identity, limits, load and counters (what routing and `baton status` read)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    serving: bool  # model loaded and warm, not draining
    model: str = ""
    # Limits and shapes, to read the figures against (and to route by).
    block_size: int = 0  # tokens per KV block
    kv_block_bytes: int = 0  # one block, all layers, K and V
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # Load now.
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_queued_prefill_tokens: int = 0
    num_kv_handoffs_pending: int = 0  # held for a handoff (prefill) or arriving (decode)
    oldest_queued_seconds: float = 0.0
    # Since start.
    num_steps: int = 0
    num_finished: int = 0
    mean_seqs_per_step: float = 0.0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_transfers: int = 0
    num_transfer_failures: int = 0
    num_transfers_verified: int = 0
    num_transferred_bytes: int = 0
    transfer_seconds: float = 0.0
    num_leases_expired: int = 0
    recent: RecentStats | None = None  # the scheduler's last minute of steps


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One configured worker as the gateway found it just now."""

    address: str
    role: str
    reachable: bool
    in_rotation: bool  # the gateway routes to it, as of its last poll
    error: str = ""  # why it is unreachable
    stats: WorkerStats | None = None


@dataclass(frozen=True, slots=True)
class DeploymentStatus:
    model: str
    workers: tuple[WorkerStatus, ...]
