"""What crosses a process boundary, as the rest of Baton sees it: named records.

Servicers and clients hand these to `baton.wire.convert`, the one module that
builds and reads the protobuf messages (protos/ says what each field means on the
wire). Records of the engine and of kvtransfer are used as they are where they fit
(SamplingParams, TokenLogprobs, RecentStats, KvLayoutSpec, KvEndpoint, Rendezvous).

Finish reasons are the engine's words: "stop" or "length" once finished, None before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler.stats import RecentStats
from kvtransfer.endpoint import KvEndpoint
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
    load: ModelLoad | None = None  # how the worker read the weights


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """How a worker read its model's weights (engine/model/checkpoint.py's LoadReport)."""

    format: str
    source: str
    files: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


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
    """One message of a client's stream: the tokens and text since the previous one, of
    choice `index` (n > 1). The last of a choice has `finish_reason` and what stopped it;
    the last of the stream also the token counts (the prompt's once, every choice's
    tokens): a choice that finishes before others carries none (num_prompt_tokens 0)."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that matched ("stop")
    stop_token_id: int | None = None  # else the EOS or stop token that was sampled ("stop")
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV a prefix cache held
    index: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first delta, when asked

    @property
    def has_usage(self) -> bool:
        return self.finish_reason is not None and self.num_prompt_tokens > 0


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
    # The last this many prompt tokens were generated by an earlier attempt (see continued).
    num_generated_tokens: int = 0
    kv_token: str = ""
    # How many times it moved off a lost worker (0: new work); workers never refuse moved work.
    attempt: int = 0

    def continued(self, generated: list[int], request_id: str) -> WorkRequest:
        """This request carried on after `generated` more tokens were streamed, as a new
        attempt `request_id` on other workers: they prefill the prompt plus those tokens
        and generate what is left, with the token limits counted down, and a seeded
        request's generator skips the draws already made; its `attempt` counts the move.
        Prompt logprobs, when asked, came with the first token: asked again only if none came."""
        n = len(generated)
        params = replace(self.params, max_tokens=self.params.max_tokens - n,
                         min_tokens=max(0, self.params.min_tokens - n),
                         prompt_logprobs=self.params.prompt_logprobs if n == 0 else None)
        return WorkRequest(request_id, [*self.prompt_token_ids, *generated], params, self.priority,
                           num_generated_tokens=self.num_generated_tokens + n, kv_token=self.kv_token,
                           attempt=self.attempt + 1)


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
    prefill_endpoint: KvEndpoint | None = None  # the holder's side, for choosing the transport (always sent)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill's first token, and the handle of its held KV unless that token ended it."""

    first_token_id: int
    first_logprob: TokenLogprobs | None = None
    finish_reason: str | None = None  # set: nothing is held, kv_handle is None
    kv_handle: KvHandle | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache held
    prompt_logprobs: list[TokenLogprobs] | None = None  # when asked: entry i is prompt token i + 1's


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
    # On the first event from the worker that prefilled the prompt: its tokens a prefix
    # cache held there (None: not reported by this event).
    num_cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first event, when asked


# ------------------------------------------------------- the KV handoff's control
@dataclass(frozen=True, slots=True)
class OpenKvChannel:
    """A decode worker asks a prefill worker to join the data channel it hosts."""

    rendezvous: Rendezvous  # its transport, chosen by the decode worker
    layout: KvLayoutSpec  # the decode worker's cache blocks; must equal the prefill worker's
    decode_worker_id: str
    decode_endpoint: KvEndpoint  # the decode worker's side, to check the transport against


@dataclass(frozen=True, slots=True)
class KvChannelOpened:
    prefill_worker_id: str
    backend: str  # the transport the channel uses: "ipc", "gloo" or "nccl"


@dataclass(frozen=True, slots=True)
class SendKv:
    """Send a held request's blocks over an open channel into the receiver's `block_ids`
    (held block i lands in block_ids[i])."""

    channel_id: str
    request_id: str
    tag: int  # the transfer's messages on the channel; unique per channel
    num_blocks: int  # the receiver's for the prompt (reused and received); the sender checks it against what it holds
    block_ids: list[int]
    verify: bool = False  # also return a checksum per sent block
    kv_token: str = ""  # the handle's: the KV is sent only to a caller that knows it
    # Held blocks before this one stay: the receiver holds their KV already (its prefix
    # cache). `block_ids` receive held blocks first_block.. ; `num_blocks` counts all.
    first_block: int = 0


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
    kv_transports: tuple[KvTransportStats, ...] = ()  # the transfers above, by transport
    kv_channel_refusal: str = ""  # why the last channel this worker tried to open was refused
    num_kv_blocks_fenced: int = 0  # kept out of use: a sender stopped answering mid-copy
    kv_endpoint: KvEndpoint | None = None  # where its KV cache lives (routing pairs same-host workers)
    # Prefix caching: on or off; blocks cached (held or not) and of them held by nobody.
    prefix_caching: bool = False
    num_kv_blocks_cached: int = 0
    num_kv_blocks_evictable: int = 0
    # Since start: prompt tokens looked up at admissions to prefill, and those found cached;
    # prompt blocks of handed-off requests (decode), and those already held here.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_received_blocks: int = 0
    prefix_cache_reused_blocks: int = 0
    recent: RecentStats | None = None  # the scheduler's last minute of steps
    # The worker's step-time model (engine/step_time.py), measured at start and refitted as
    # it serves: a decode step of n sequences takes decode_step_base_s +
    # decode_step_per_seq_s * n seconds, a prefill prefill_s_per_token a prompt token.
    # 0.0: not known (a worker of an older release, or nothing measured yet).
    decode_step_base_s: float = 0.0
    decode_step_per_seq_s: float = 0.0
    prefill_s_per_token: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    def decode_step_s(self, num_seqs: int) -> float | None:
        """Predicted seconds of a decode step of `num_seqs` sequences (None: no model)."""
        if self.decode_step_base_s <= 0 and self.decode_step_per_seq_s <= 0:
            return None
        return self.decode_step_base_s + self.decode_step_per_seq_s * num_seqs

    def prefill_s(self, num_tokens: int) -> float | None:
        """Predicted seconds to prefill `num_tokens` prompt tokens (None: no rate measured)."""
        return num_tokens * self.prefill_s_per_token if self.prefill_s_per_token > 0 else None


@dataclass(frozen=True, slots=True)
class KvTransportStats:
    """A worker's KV transfers over one transport, since start."""

    transport: str  # "ipc", "gloo" or "nccl"
    num_transfers: int = 0
    num_failures: int = 0
    num_transferred_bytes: int = 0
    transfer_seconds: float = 0.0


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
class AdmissionStatus:
    """The gateway's admission since it started (gateway/admission.py): requests refused by
    reason, deadlines missed after admission, and its forecasts against what happened
    (first tokens, seconds from arrival; means over its last 256 requests; 0: none yet)."""

    max_concurrent_requests: int  # the bound now (0: no worker known yet)
    max_queue_wait_s: float
    num_in_flight: int
    num_admitted: int
    num_refused_concurrency: int
    num_refused_queue_wait: int
    num_refused_deadline: int
    num_deadline_misses: int  # admitted, then ended at their deadline: mispredictions
    num_met_deadlines: int  # finished with a deadline, within it
    forecast_known: bool  # the workers have published their step-time models
    forecast_queue_wait_s: float  # a new request's first token, were it admitted now
    mean_forecast_ttft_s: float
    mean_observed_ttft_s: float
    decode_scale: float = 1.0  # finished requests' decode steps over the workers' line
    decode_step_base_s: float = 0.0  # the pooled line a forecast uses now
    decode_step_per_seq_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DeploymentStatus:
    model: str
    workers: tuple[WorkerStatus, ...]
    admission: AdmissionStatus | None = None
