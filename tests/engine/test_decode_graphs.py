"""Static decode batches (engine/runner/decode_graphs.py): the padded batch sizes, the layout one
step writes, and the static path against the normal one, token for token.

The static path is what a CUDA graph replays: without a GPU it runs the same
padded, persistent inputs through the model eagerly (Triton's interpreter runs
the attention kernel), so everything but the capture itself is checked in CI.
On a GPU (`make test-gpu`) the same tests capture the graphs and replay them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.attention import get_attention_backend
from engine.envs import use_triton_interpreter
from engine.kv.manager import KVCacheManager
from engine.request import PENDING_TOKEN
from engine.runner.decode_graphs import (GraphKey, StaticDecode, context_bounds, graph_batch_sizes, padded_batch_size,
                                         static_decode_bytes)
from tests.engine.test_handoff import handoff
from tests.engine.test_parity import TINY_CONFIGS, mixed_workload
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytest.importorskip("triton")
if not torch.cuda.is_available():
    use_triton_interpreter()

from engine.kernels.triton_attention import MIN_SPLIT_SEQ_LEN, choose_num_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEST_KV_BYTES = 1 << 30


def test_graph_batch_sizes():
    assert graph_batch_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert graph_batch_sizes(300)[-4:] == (256, 272, 288, 300)  # every 16 past 256, then the cap
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(1024)[-1] == 512  # past 512 sequences a step runs eagerly
    assert padded_batch_size(graph_batch_sizes(256), 257) is None


@given(max_num_seqs=st.integers(1, 1024), num_seqs=st.integers(1, 1024))
def test_padded_batch_size_is_the_smallest_that_fits(max_num_seqs, num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == 1
    size = padded_batch_size(sizes, num_seqs)
    if num_seqs > sizes[-1]:
        assert size is None
    else:
        assert size >= num_seqs and all(s < num_seqs for s in sizes if s < size)
        # Padding wastes at most half the batch below 8 sequences, at most 15 rows beyond.
        assert size - num_seqs <= max(num_seqs - 1, 15)


@pytest.fixture(scope="module")
def tiny_triton(tmp_path_factory):
    """An engine on the Triton backend (interpreted on CPU) with decodes in flight."""
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS["llama-gqa-hd32-untied-bias"]
    hf_model, model_dir = make_tiny_model(
        tmp_path_factory.mktemp("tiny"), arch, heads, kv_heads, head_dim, tied, dtype=torch.float32, **extra
    )
    return hf_model, model_dir


def make_llm(model_dir: str, static: bool, overlap: bool = False, **kwargs) -> LLM:
    # A sized cache (a CPU engine's default size): on a GPU an unsized one would take 0.9 of
    # it, which another engine of the test or a test beside it needs free.
    if "num_kv_blocks" not in kwargs:
        kwargs.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
    llm = LLM(model_dir, device=DEVICE, dtype="float32", attention_backend="triton", block_size=4,
              overlap_scheduling=overlap, enforce_eager=True, **kwargs)
    if static:  # on a GPU, captured as graphs
        engine = llm.engine
        engine.runner.use_static_decode(engine.config.scheduler.max_num_seqs, engine.max_model_len,
                                        capture=DEVICE == "cuda")
    return llm


def test_a_step_is_written_as_the_layout_says(tiny_triton):
    _, model_dir = tiny_triton
    llm = make_llm(model_dir, static=True, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, length in enumerate((3, 9, 6)):
        engine.add_request(list(range(5, 5 + length)), params, request_id=f"r{i}")
    engine.step()  # the prompts, eagerly
    sched_out = engine.scheduler.schedule()
    requests = sched_out.requests
    assert len(requests) == 3 and sched_out.total_num_scheduled_tokens == 3
    # As the overlapped loop leaves it: the second request's input is still on the device.
    requests[1].all_token_ids[-1] = PENDING_TOKEN
    requests[1].pending_sample_index = 2
    static: StaticDecode = engine.runner.static_decode
    batch, key = static.prepare(sched_out)
    assert key == GraphKey(size=4, num_splits=1)  # 3 sequences padded to the next graph size
    size = key.size

    full = static._views(key)[0]
    block_size = engine.kv_manager.block_size
    positions = [r.num_computed_tokens for r in requests]
    assert full.positions.tolist() == positions + [0]
    assert full.attn.seq_lens.tolist() == [p + 1 for p in positions] + [1]
    width = max(positions) // block_size + 1
    assert full.attn.table_stride.item() == width
    tables = static.buffer[full.attn.block_tables.storage_offset():][: size * width].view(size, width)
    for row, request in enumerate(requests):
        blocks = engine.kv_manager.get_block_ids(request.request_id)
        assert tables[row, : len(blocks)].tolist() == blocks[:width]
        slot = blocks[positions[row] // block_size] * block_size + positions[row] % block_size
        assert full.attn.slot_mapping[row].item() == slot
    assert tables[3].tolist() == [0] * width and full.attn.slot_mapping[3].item() == -1  # padding: stored nowhere
    assert full.input_ids[1].item() == PENDING_TOKEN and full.input_ids[3].item() == 0
    assert batch.pending_rows.tolist() == [1] and batch.pending_sources.tolist() == [2]
    assert batch.sample_indices.tolist() == [0, 1, 2] and batch.sample_requests == requests
    assert full.attn.query_start.tolist() == [0, 1, 2, 3, 4]


def test_prefill_steps_and_large_batches_run_eagerly(tiny_triton):
    _, model_dir = tiny_triton
    llm = make_llm(model_dir, static=True, max_num_seqs=8)
    engine = llm.engine
    engine.add_request(list(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=4), request_id="p")
    assert engine.runner.static_decode.prepare(engine.scheduler.schedule()) is None  # a prefill chunk


def test_static_path_gives_the_normal_paths_tokens(tiny_triton):
    """Greedy tokens of the static path (padded persistent inputs, what a graph replays,
    overlapped: its decodes take their input tokens from the device) equal transformers',
    token for token, through chunked prompts, preemption by recompute and swap, and
    batches of every padded size up to 8 (the normal path's equal them too:
    tests/engine/test_triton_engine.py)."""
    hf_model, model_dir = tiny_triton
    hf_model = hf_model.to(DEVICE)  # the reference on the same device
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=12, seed=3)
    with torch.device(DEVICE):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=8, num_kv_blocks=40, num_swap_blocks=4,
                  preemption_mode="swap", admission_reserve_steps=0)
    llm = make_llm(model_dir, static=True, overlap=True, **kwargs)
    static_steps, pending = [], []
    prepare = llm.engine.runner.static_decode.prepare

    def counting_prepare(out):
        prepared = prepare(out)
        if prepared is not None:
            static_steps.append(prepared[1].size)
            pending.append(prepared[0].pending_rows is not None)
        return prepared

    llm.engine.runner.static_decode.prepare = counting_prepare
    static = llm.generate(prompts, params)
    assert [o.token_ids for o in static] == expected
    assert {1, 2, 4, 8} <= set(static_steps), static_steps
    assert any(pending)  # decodes fed from the step in flight
    stats = llm.get_metrics()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == 40


def test_steps_that_check_proposals_replay_the_graph_of_their_entries(tiny_triton):
    """Speculative decoding: a row checking k proposals is k+1 decode entries, so its step
    runs on the static path (a graph of the entries' padded size) and gives the normal
    path's tokens and transformers'."""
    from tests.engine.test_spec_engine import copying_prompts

    hf_model, model_dir = tiny_triton
    hf_model = hf_model.to(DEVICE)
    prompts = copying_prompts(hf_model.config.vocab_size, 5, seed=2)
    with torch.device(DEVICE):
        expected = [hf_greedy(hf_model, p, 14) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    spec = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False, max_num_seqs=8)
    llm = make_llm(model_dir, static=True, **spec)
    checked = []
    prepare = llm.engine.runner.static_decode.prepare

    def counting_prepare(out):
        prepared = prepare(out)
        if prepared is not None and prepared[0].sample_counts is not None:
            checked.append((prepared[1].size, sum(prepared[0].sample_counts)))
        return prepared

    llm.engine.runner.static_decode.prepare = counting_prepare
    static = llm.generate(prompts, params)
    assert [o.token_ids for o in static] == expected
    assert checked and all(entries <= size for size, entries in checked), checked
    assert llm.engine.speculator.stats().num_accepted > 0
    llm.engine.check_integrity()


# ------------------------------------------------------------------ split-KV per step
def split_backend(num_sms: int = 132):
    """The Triton backend as if on a GPU of num_sms SMs: only its split counts change (the
    interpreter runs a split launch exactly as a GPU would)."""
    backend = get_attention_backend("triton", DEVICE)
    backend.num_sms = num_sms
    return backend


def test_graphs_at_llama_8b_shapes_follow_the_longest_context():
    """Llama-3.1-8B (8 KV heads) on 132 SMs, 256 sequences, 128k context: a size whose
    programs fill the SMs has one graph, the smallest a few (at most 6), one per split count
    a step's longest context can give; each graph's metadata splits as its key says and is
    built for the longest context that key serves."""
    max_model_len, block_size, num_kv_heads = 131072, 16, 8
    kv = KVCacheManager(16, 0, block_size, max_model_len // block_size, initial_rows=1)
    layer = torch.empty(1, block_size, num_kv_heads, 128, device=DEVICE)
    static = StaticDecode(None, [(layer, layer)], kv, split_backend(132), batch_sizes=graph_batch_sizes(256),
                          max_model_len=max_model_len, num_heads=32, device=torch.device(DEVICE))
    keys = static.max_seq_lens
    splits = {size: [key.num_splits for key in keys if key.size == size] for size in static.batch_sizes}
    assert splits[1] == [1, 2, 4, 8, 16, 32] and splits[2] == [1, 2, 4, 8, 16, 17] and splits[16] == [1, 2, 3]
    assert all(splits[size] == [1] for size in static.batch_sizes if size * num_kv_heads >= 132)
    assert max(map(len, splits.values())) == 6 and len(keys) == 54  # one per size (35) before
    for key, max_seq_len in keys.items():
        assert static._views(key)[1].num_splits == key.num_splits
        assert static.graph_key(key.size, max_seq_len) == key
        if max_seq_len < max_model_len:  # the longest context of its count
            assert static.graph_key(key.size, max_seq_len + 1) != key
    for seq_len in (1, 100, 127, 128, 129, 500, 1023, 1024, 1025, 3000, 4096, 4097, 100_000, max_model_len):
        bucket = seq_len if seq_len < MIN_SPLIT_SEQ_LEN else 1 << (seq_len - 1).bit_length()
        key = static.graph_key(1, seq_len)
        assert key.num_splits == choose_num_splits(1, num_kv_heads, bucket, 132)
        assert choose_num_splits(1, num_kv_heads, seq_len, 132) <= key.num_splits
        assert keys[key] >= seq_len  # a graph's bound holds every context it serves
    assert static.graph_key(1, 127).num_splits == 1 and static.graph_key(1, 128).num_splits == 2
    # What sizing the KV cache keeps for these graphs besides their pool (engine/runner/memory.py):
    # the input buffers this object holds, and one bfloat16 [size, 4096] output per graph.
    inputs = sum(t.numel() * t.element_size() for t in (static.buffer, static.query_start))
    outputs = sum(key.size for key in keys) * 4096 * 2
    assert static_decode_bytes(static.backend, static.batch_sizes, max_model_len, block_size, num_kv_heads, 4096,
                               torch.bfloat16) == inputs + outputs
    assert context_bounds(1500) == (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512,
                                    1023, 1024, 1500)


def test_a_static_step_splits_for_its_own_context(tmp_path):
    """One sequence decoding across 128 keys of context (MIN_SPLIT_SEQ_LEN), on a backend
    faking 132 SMs: its steps run 1 split under 128 keys, then more (the count for the
    context rounded up to a power of 2, never more), and the tokens stay transformers' greedy
    ones. The prompt is prefilled by an engine on the cpu backend and handed over; the decode
    steps, the subject, run the Triton kernels."""
    arch, heads, kv_heads, head_dim, tied, extra = TINY_CONFIGS["llama3-rope-gqa-hd16"]
    hf_model, model_dir = make_tiny_model(tmp_path, arch, heads, kv_heads, head_dim, tied, dtype=torch.float32,
                                          **extra)
    hf_model.config.max_position_embeddings = 2048  # room for contexts that split
    hf_model.save_pretrained(model_dir)
    prompt = torch.randint(3, hf_model.config.vocab_size, (MIN_SPLIT_SEQ_LEN - 2,),
                           generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with torch.device(DEVICE):
        expected = hf_greedy(hf_model.to(DEVICE), prompt, params.max_tokens)

    prefill_engine = LLM(model_dir, device=DEVICE, dtype="float32", attention_backend="auto", block_size=4,
                         max_num_batched_tokens=1024, kv_cache_memory_bytes=TEST_KV_BYTES).engine
    engine = make_llm(model_dir, static=False, max_num_seqs=2).engine
    runner = engine.runner
    static = StaticDecode(runner.model, runner.kv_cache.layers, runner.kv_manager, split_backend(132),
                          batch_sizes=graph_batch_sizes(2), max_model_len=engine.max_model_len,
                          num_heads=runner.num_heads, device=runner.device)
    runner.static_decode = static
    steps = []  # (longest context, graph) of each static step
    prepare = static.prepare

    def recording_prepare(out):
        prepared = prepare(out)
        if prepared is not None:
            key = prepared[1]
            assert static._views(key)[1].num_splits == key.num_splits  # what the kernels launch with
            steps.append((out.requests[0].num_computed_tokens + 1, key))
        return prepared

    static.prepare = recording_prepare
    outputs = handoff(prefill_engine, engine, {"r": prompt}, params)
    assert outputs["r"] == expected
    assert [seq_len for seq_len, _ in steps] == [127, 128, 129]
    for seq_len, key in steps:
        bucket = 1 << (seq_len - 1).bit_length()
        assert key.size == 1 and key.num_splits <= choose_num_splits(1, kv_heads, bucket, 132)
    assert [key.num_splits for _, key in steps] == [1, 2, 4]  # under 128 keys; 128; 256 rounded up
