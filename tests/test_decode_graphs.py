"""Static decode batches (engine/decode_graphs.py): the padded batch sizes, the layout one
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
from engine.decode_graphs import StaticDecode, graph_batch_sizes, padded_batch_size
from engine.request import PENDING_TOKEN
from tests.test_parity import TINY_CONFIGS, mixed_workload
from tests.tiny_models import hf_greedy, make_tiny_model

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    batch, size = static.prepare(sched_out)
    assert size == 4  # 3 sequences padded to the next graph size

    full = static._views(size)[0]
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
    overlapped: its decodes take their input tokens from the device) equal the normal
    path's and transformers', token for token, through chunked prompts, preemption by
    recompute and swap, and batches of every padded size up to 8."""
    hf_model, model_dir = tiny_triton
    hf_model = hf_model.to(DEVICE)  # the reference on the same device
    prompts, max_tokens = mixed_workload(hf_model.config.vocab_size, num_prompts=12, seed=3)
    with torch.device(DEVICE):
        expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=8, num_kv_blocks=40, num_swap_blocks=4,
                  preemption_mode="swap", admission_reserve_steps=0)
    normal = make_llm(model_dir, static=False, **kwargs).generate(prompts, params)
    llm = make_llm(model_dir, static=True, overlap=True, **kwargs)
    static_steps, pending = [], []
    prepare = llm.engine.runner.static_decode.prepare

    def counting_prepare(out):
        prepared = prepare(out)
        if prepared is not None:
            static_steps.append(prepared[1])
            pending.append(prepared[0].pending_rows is not None)
        return prepared

    llm.engine.runner.static_decode.prepare = counting_prepare
    static = llm.generate(prompts, params)
    assert [o.token_ids for o in static] == [o.token_ids for o in normal] == expected
    assert {1, 2, 4, 8} <= set(static_steps), static_steps
    assert any(pending)  # decodes fed from the step in flight
    stats = llm.get_metrics()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == 40
