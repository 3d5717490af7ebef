"""Decode steps over persistent inputs, padded to a few batch sizes, replayed as CUDA graphs.

An eager decode step of a large model launches a kernel or more per op of every
layer; at small batch the host's launches, not the GPU, set the pace. A step
whose every sequence adds one token (decodes, and one-token chunks) instead runs
on inputs that live at fixed device addresses, padded up to the nearest of a few
batch sizes; each size's decoder pass is captured as a CUDA graph, once per
split count of its contexts, and replayed with one launch (the LM head then runs
on the sampled rows alone).

Per padded size S (`graph_batch_sizes`: 1, 2, 4, 8, then every 8 to 256 and
every 16 beyond, ending at max_num_seqs), the step's inputs are views of one
persistent int64 device buffer, written each step by one non-blocking copy from
a pinned host buffer of the same layout:

    [ input_ids S | positions S | slots S | seq_lens S | sample rows S | pending rows S
      | pending sources S | table stride 2 | block tables S x W ]

(each S rounded up to even, so every part stays 16-byte aligned.) W, the width of
the tables, is the step's own (the longest context's blocks); the attention kernel
reads it from the buffer (`AttentionBatch.table_stride`), so a graph serves every
width. Rows n..S-1 pad the batch: token 0 at position 0, one key of context in
block 0, slot -1 (stored nowhere), never sampled. The query starts are the
constant 0..S.

The one launch parameter that follows the contexts is the split-KV count
(engine/kernels/triton_attention.py). A step's is chosen for its own longest
context rounded up to a power of 2 (`choose_static_num_splits`), not for
max_model_len, so a graph is keyed by (padded size, splits) (`GraphKey`): a size
has one graph per count it can get up to max_model_len. That is one graph where
its (sequence, KV head) programs fill the SMs; for the smallest sizes a few (1
split under MIN_SPLIT_SEQ_LEN (128) keys of context, then a new count per doubling until
the cap).
Each graph's metadata is built for the longest context of its count (`context_bounds`).

Steps with prefill chunks, and batches past the largest size, run eagerly. On CPU
(tests) the same static batches run without capture: `StaticDecode(capture=False)`.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.kv.manager import KVCacheManager
from engine.runner.forward_batch import DecodeRows, ForwardBatch, PackedLayout, decode_rows, split_checks
from engine.sampling.prompt_logprobs import wants_rows
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# Beyond this many sequences a step is long enough that launches no longer matter.
MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int, max_size: int = MAX_GRAPH_BATCH_SIZE) -> tuple[int, ...]:
    """The padded batch sizes: 1, 2, 4, 8, then every 8 up to 256 and every 16 beyond,
    ending at min(max_num_seqs, max_size) itself."""
    largest = min(max_num_seqs, max_size)
    sizes = [size for size in (1, 2, 4) if size < largest]
    size = 8
    while size < largest:
        sizes.append(size)
        size += 8 if size < 256 else 16
    sizes.append(largest)
    return tuple(sizes)


def padded_batch_size(sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest of `sizes` that holds num_seqs sequences; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def context_bounds(max_model_len: int) -> tuple[int, ...]:
    """Ascending, the contexts after which a static step's split count can change: each
    power of 2 and the length one short of it, then max_model_len. (The count is chosen
    for the longest context rounded up to a power of 2, contexts short of a power-of-2
    threshold never split, and it never falls as the context grows: the longest context
    of each count is one of these.)"""
    bounds = {n for k in range(max_model_len.bit_length()) for n in ((1 << k) - 1, 1 << k)}
    return (*sorted(n for n in bounds if 0 < n < max_model_len), max_model_len)


@functools.cache
def graph_layout(size: int, width: int) -> PackedLayout:
    """The buffer of a static step of padded size `size` with block tables `width` wide
    (the persistent buffer is this at the largest size and max width: the parts before
    the tables sit at the same offsets for every width)."""
    rows = dict.fromkeys(("input_ids", "positions", "slots", "seq_lens", "samples", "pending_rows",
                          "pending_sources"), size)
    return PackedLayout({**rows, "table_stride": 1, "block_tables": size * width})


class GraphKey(NamedTuple):
    """Which graph runs a static step: its padded batch size and its contexts' split count."""

    size: int
    num_splits: int


@dataclass(frozen=True, slots=True)
class GraphCapture:
    """What capturing cost, reported at start."""

    batch_sizes: tuple[int, ...]  # the padded batch sizes
    seconds: float
    # What this process's allocator took for the graphs (their pool): other processes on
    # the GPU do not move it.
    memory_bytes: int
    graph_keys: tuple[GraphKey, ...]  # one graph each, largest first

    @property
    def max_num_splits(self) -> int:
        return max(key.num_splits for key in self.graph_keys)


class StaticDecode:
    """Decode-only steps on persistent, padded inputs; with `capture`, as CUDA graphs.

    `prepare` lays out a step (None when the step has prefill chunks or too many
    sequences) and names its graph, `run` returns the logits of its sampled rows. The
    decoder pass is the model's own: only where its inputs live, and how it is launched,
    differ. The backend must be one with `supports_static_batches` and a
    `num_decode_splits` (the Triton one).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        kv: KVCacheManager,
        backend: AttentionBackend,
        *,
        batch_sizes: tuple[int, ...],
        max_model_len: int,
        num_heads: int,
        device: torch.device,
    ) -> None:
        # NOTE: padding rows rely on the fused RoPE + KV store skipping slot -1.
        if not (backend.supports_static_batches and backend.fuses_rope):
            raise ValueError(f"the {backend.name} attention backend cannot run static decode batches")
        self.model = model
        self.kv_layers = kv_layers
        self.kv = kv
        self.backend = backend
        self.batch_sizes = batch_sizes
        self.max_model_len = max_model_len
        self.num_heads = num_heads
        self.device = device
        self.num_kv_heads = kv_layers[0][0].shape[2]
        self.max_width = kv.max_blocks_per_seq
        largest = batch_sizes[-1]
        self.buffer = torch.zeros(graph_layout(largest, self.max_width).num_elements, dtype=torch.int64,
                                  device=device)
        self.query_start = torch.arange(largest + 1, dtype=torch.int64, device=device)
        # Every graph a step can need, with the longest context it serves: its metadata's bound.
        self.max_seq_lens = graph_keys(backend, batch_sizes, max_model_len, self.num_kv_heads)
        self._batches: dict[GraphKey, tuple[ForwardBatch, object]] = {}
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def graph_key(self, size: int, max_seq_len: int) -> GraphKey:
        """The graph of a step of padded size `size` whose longest context is max_seq_len."""
        return _graph_key(self.backend, size, max_seq_len, self.num_kv_heads)

    # ------------------------------------------------------------------ inputs
    def _views(self, key: GraphKey) -> tuple[ForwardBatch, object]:
        """The step inputs of padded size `key.size` (views of the buffer) and their attention
        metadata for `key.num_splits` splits: built once per graph, the same objects every step."""
        cached = self._batches.get(key)
        if cached is not None:
            return cached
        size = key.size
        max_seq_len = self.max_seq_lens[key]
        parts = graph_layout(size, self.max_width).views(self.buffer)
        # Laid out at the step's width; the kernel reads the stride from table_stride.
        tables = parts["block_tables"].view(size, self.max_width)
        attn = AttentionBatch(
            slot_mapping=parts["slots"],
            query_start=self.query_start[: size + 1],
            seq_lens=parts["seq_lens"],
            block_tables=tables,
            num_decode_tokens=size,
            max_query_len=1,
            max_seq_len=max_seq_len,  # the bound of the contexts this graph serves: its splits
            decode_max_seq_len=max_seq_len,
            prefills=(),
            table_stride=parts["table_stride"],
        )
        layout = self.kv_layers[0][0]
        metadata = self.backend.build_metadata(
            attn,
            block_size=self.kv.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=layout.shape[3],
            dtype=layout.dtype,
        )
        batch = ForwardBatch(
            input_ids=parts["input_ids"],
            positions=parts["positions"],
            attn=attn,
            sample_indices=parts["samples"],
            sample_requests=[],
            num_prefill_tokens=0,
            pending_rows=parts["pending_rows"],
            pending_sources=parts["pending_sources"],
        )
        self._batches[key] = (batch, metadata)
        return batch, metadata

    def prepare(self, out: SchedulerOutput) -> tuple[ForwardBatch, GraphKey] | None:
        """Write a decode-only step into the buffer (one copy) and return its batch, cut to
        its n real entries, and its graph (padded size, splits); None if the step is not one
        of those. A row checking k proposals is k+1 decode entries (forward_batch.decode_rows),
        so such a step replays the graph of its entries' padded size."""
        requests, proposals = out.requests, out.spec_token_ids
        num_entries = out.total_num_scheduled_tokens
        size = padded_batch_size(self.batch_sizes, num_entries)
        if size is None or any(map(wants_rows, requests)):
            return None
        checks = split_checks(requests, proposals)
        decodes = [r for r in requests if r.request_id not in proposals] if checks else requests
        if len(decodes) + sum(len(spec) + 1 for _, spec in checks) != num_entries:
            return None  # a prefill chunk
        d = decode_rows(decodes, self.kv, checks)
        key = self.graph_key(size, int(d.positions.max()) + 1)
        self._write(d, size)
        full, _ = self._views(key)
        num_sampled, num_pending = len(d.sample_rows), len(d.pending_rows)
        batch = ForwardBatch(
            input_ids=full.input_ids,
            positions=full.positions,
            attn=full.attn,
            sample_indices=full.sample_indices[:num_sampled],
            sample_requests=d.sample_requests(decodes),
            num_prefill_tokens=0,
            sample_counts=tuple(d.sample_counts()) if checks else None,
            pending_rows=full.pending_rows[:num_pending] if num_pending else None,
            pending_sources=full.pending_sources[:num_pending] if num_pending else None,
        )
        return batch, key

    def _write(self, d: DecodeRows, size: int) -> None:
        """The step's entries into the persistent buffer (one copy), padded to `size`."""
        kv = self.kv
        num_seqs, num_pending = len(d.positions), len(d.pending_rows)
        max_seq_len = int(d.positions.max()) + 1
        width = (max_seq_len - 1) // kv.block_size + 1
        layout = graph_layout(size, width)
        host = layout.host_buffer(self.device)
        h = layout.views(host.numpy())
        h["input_ids"][:num_seqs] = d.token_ids
        h["input_ids"][num_seqs:] = 0
        h["positions"][:num_seqs] = d.positions
        h["positions"][num_seqs:] = 0
        h["slots"][:num_seqs] = d.slots
        h["slots"][num_seqs:] = -1
        h["seq_lens"][:num_seqs] = d.positions + 1
        h["seq_lens"][num_seqs:] = 1
        h["samples"][: len(d.sample_rows)] = d.sample_rows
        h["pending_rows"][:num_pending] = d.pending_rows
        h["pending_sources"][:num_pending] = d.pending_sources
        h["table_stride"][0] = width
        table_part = h["block_tables"].reshape(size, width)
        table_part[:num_seqs] = kv.block_tables[d.table_rows, :width]
        table_part[num_seqs:] = 0
        self.buffer[: len(host)].copy_(host, non_blocking=True)

    # --------------------------------------------------------------- running
    def run(self, batch: ForwardBatch, key: GraphKey) -> torch.Tensor:
        """Logits [S, V] of the batch's sampled rows (its inputs already in the buffer).

        The graph holds the decoder only: the LM head runs on the sampled rows after it,
        so no padding row's logits are computed, and the graphs' pool keeps one small
        [size, hidden] output per graph rather than a vocabulary-wide one."""
        graph = self._graphs.get(key)
        if graph is not None:
            graph[0].replay()
            hidden = graph[1]
        else:
            hidden = self._forward(key)
        if len(batch.sample_indices) != key.size:
            hidden = hidden.index_select(0, batch.sample_indices)
        return self.model.compute_logits(hidden)

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The padded forward pass over every row: hidden states [size, hidden]."""
        full, metadata = self._views(key)
        return self.model(full.input_ids, full.positions, self.kv_layers, full.attn, metadata)

    # --------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self) -> GraphCapture:
        """Capture every (size, splits) decoder pass as a CUDA graph, largest first, all in one
        memory pool (they never run at once), after warm-up runs that compile every kernel."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        # What the pool took, read from this process's allocator (other processes move the
        # driver's free count); with its cache dropped at both readings, what the warm-ups
        # freed is not counted, and what the live graphs hold is.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        keys = tuple(sorted(self.max_seq_lens, reverse=True))  # by size, then splits
        for key in keys:
            self._fill_padding(key.size)
            for _ in range(2):
                self._forward(key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(key)
            self._graphs[key] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        report = GraphCapture(self.batch_sizes, time.perf_counter() - started, memory_bytes, keys)
        logger.info("captured %d CUDA graphs of decode steps (batch sizes %d-%d, up to %d context splits) "
                    "in %.1f s, %.0f MiB", len(keys), report.batch_sizes[0], report.batch_sizes[-1],
                    report.max_num_splits, report.seconds, report.memory_bytes / 2**20)
        return report

    def _fill_padding(self, size: int) -> None:
        """Every row a padding row, tables one block wide: what warm-up and capture run on."""
        parts = graph_layout(size, 1).views(self.buffer)
        for name in ("input_ids", "positions", "samples", "pending_rows", "pending_sources", "block_tables"):
            parts[name].zero_()
        parts["slots"].fill_(-1)  # stored nowhere
        parts["seq_lens"].fill_(1)  # one key
        parts["table_stride"].fill_(1)


def _graph_key(backend: AttentionBackend, size: int, max_seq_len: int, num_kv_heads: int) -> GraphKey:
    return GraphKey(size, backend.num_decode_splits(size, num_kv_heads, max_seq_len, is_static=True))


def graph_keys(backend: AttentionBackend, batch_sizes: tuple[int, ...], max_model_len: int,
               num_kv_heads: int) -> dict[GraphKey, int]:
    """Every graph a static step can need, with the longest context each serves."""
    keys: dict[GraphKey, int] = {}
    for size in batch_sizes:
        for seq_len in context_bounds(max_model_len):  # ascending: the last of a key is its longest
            keys[_graph_key(backend, size, seq_len, num_kv_heads)] = seq_len
    return keys


def static_decode_bytes(backend: AttentionBackend, batch_sizes: tuple[int, ...], max_model_len: int,
                        block_size: int, num_kv_heads: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory the static decode path keeps while it lives, besides its graphs' working
    memory (engine/runner/memory.py reserves it before sizing the KV cache): the int64 input buffer
    and each graph's [size, hidden] output."""
    largest = batch_sizes[-1]
    buffer = (graph_layout(largest, -(-max_model_len // block_size)).num_elements + largest + 1) * 8
    keys = graph_keys(backend, batch_sizes, max_model_len, num_kv_heads)
    return buffer + sum(key.size for key in keys) * hidden_size * torch.empty(0, dtype=dtype).element_size()
