"""What one engine step costs the host, counted (never timed): tensors made from host data, device syncs, and the
dispatcher calls per decode layer on CUDA's code path run on a CPU; the fused GPU view computes the reference
model's maths; each count has a negative control that breaks it."""
from __future__ import annotations

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.bench.step_counts import (
    HostCounter,
    aten_calls_per_decode_layer,
    cuda_logic_engine,
    measure_host_steps,
)
from lab_utils.checks.teacher_forced import assert_greedy_outputs_agree
from lab_utils.engine.accel.cuda_graphs import (
    DecodeGraphRunner,
    decode_metadata,
    padded_metadata,
)
from lab_utils.engine.accel.device_fused import (
    DeviceFusedLlama,
    device_fusable,
    fuse_for_device,
)
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.models.loader import load_model

MAX_HOST_TENSORS, MAX_SYNCS, MAX_ATEN_PER_LAYER = 2, 1, 20


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("arrivals", [False, True])
def test_a_step_makes_at_most_two_host_tensors_and_one_sync(tiny, arrivals):
    eng = cuda_logic_engine(tiny, 8, 128)
    row = measure_host_steps(eng, 8, prompt_len=40, steps=3, arrivals=arrivals)
    assert row["list_tensors_per_step"] <= MAX_HOST_TENSORS, row["sites"]
    assert row["syncs_per_step"] <= MAX_SYNCS, row["sites"]
    if not arrivals:  # a decode step through the graph runner: its inputs are one persistent buffer
        assert row["list_tensors_per_step"] == 0, row["sites"]
        assert eng.runner.graphs.entries


def test_host_counter_counts_list_tensors_numpy_and_syncs():
    """Negative control: every way a step could make a host tensor or wait for the device is counted."""
    import numpy as np

    x = torch.ones(3)
    with HostCounter() as c:
        torch.tensor([1, 2])
        torch.as_tensor((3,))
        torch.from_numpy(np.zeros(2))
        x.tolist()
        x.sum().item()
        int(x[0])
    assert c.list_tensors == 3 and c.syncs == 3, c.sites


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_layer_makes_at_most_20_dispatcher_calls_on_the_cuda_path(dtype):
    counts = aten_calls_per_decode_layer(cuda_logic_engine(load_model("tiny-random", device="cpu", dtype=dtype), 4, 64))
    assert counts["aten_calls_per_decode_layer"] <= MAX_ATEN_PER_LAYER, counts["ops_per_layer"]


def test_the_reference_layer_is_counted_above_the_limit(tiny):
    """Negative control: the same count over the unfused model (the labs' layer) is far above the limit."""
    eng = cuda_logic_engine(tiny, 4, 64)
    eng.runner.model = eng.runner.graphs.model = tiny[0]
    counts = aten_calls_per_decode_layer(eng)
    assert counts["aten_calls_per_decode_layer"] > 2 * MAX_ATEN_PER_LAYER, counts
    assert eng.runner.fast_path_error is None  # the static decode attention takes the reference layer's layout


def test_fused_view_computes_the_reference_logits_and_shares_its_weights():
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    ids = torch.randint(3, 200, (1, 23), generator=torch.Generator().manual_seed(1))
    ref = model(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    view = fuse_for_device(model)
    assert isinstance(view, DeviceFusedLlama) and view is not model
    torch.testing.assert_close(view.logits(view.hidden_states(ids)), ref, rtol=1e-4, atol=1e-4)
    batch = torch.cat([ids, ids.flip(1)])
    torch.testing.assert_close(view(batch), model(batch), rtol=1e-4, atol=1e-4)  # rows of a batch: reference layers
    torch.testing.assert_close(model(ids), ref, rtol=0, atol=0)  # the caller's model: same values, same maths
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    layer, attn = view.model.layers[0], model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()  # one copy of the weights
    assert attn.v_proj.weight.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()


def test_fused_view_is_refused_where_the_layer_maths_is_not_the_reference(tiny):
    from lab_utils.quant.linear import quantize_model

    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    assert device_fusable(model)
    quantized, _ = quantize_model(model, "int8")
    assert not device_fusable(quantized) and fuse_for_device(quantized) is quantized


def test_cuda_path_engine_gives_the_cpu_engines_greedy_tokens(tiny):
    prompts = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(tiny, EngineConfig(max_num_seqs=8, num_gpu_blocks=128), device="cpu").generate(prompts, params)
    eng = cuda_logic_engine(tiny, 8, 128)
    got = eng.generate(prompts, params)
    assert eng.runner.graphs.entries and eng.runner.fast_path_error is None
    assert_greedy_outputs_agree(tiny[0], got, ref, "CUDA's code path (fused view, static decode buffers) vs CPU")


def test_decode_metadata_from_the_static_buffer_matches_the_list_built_one(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=64), device="cpu")
    g = DecodeGraphRunner(tiny[0], eng.kv_cache, 4, eng.device, 4, 64, capture=False)
    tables, ctx = [[5, 2, 9], [7]], [11, 3]
    g.model.hidden_states = lambda ids, pos, attention: ids[..., None].float()  # the forward is not the point
    g.run([1, 2], [c - 1 for c in ctx], ctx, tables)
    e = g.entries[(2, 64)]
    got = decode_metadata(e, 4)
    want = padded_metadata(tables, ctx, 4, 64, eng.device)
    assert got.slot_mapping.tolist() == want.slot_mapping.tolist() == [9 * 4 + 2, 7 * 4 + 2]
    assert torch.equal(got.mask, want.mask)
    assert torch.equal(got.context_slots.masked_fill(~got.mask[:, 0, 0], 0),
                       want.context_slots.masked_fill(~want.mask[:, 0, 0], 0))
    del g.model.hidden_states


class _CountingList(list):
    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def test_commit_full_blocks_visits_only_the_new_blocks():
    from lab_utils.engine.request import Request

    bm = BlockManager(64, 4, enable_prefix_caching=True, watermark=0.0)
    req = Request("a", None, list(range(3, 40)), SamplingParams(), 0.0)
    assert bm.grow(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.commit_full_blocks(req)
    full = req.num_tokens // 4
    assert all(bm.blocks[b].hash is not None for b in req.block_table[:full])
    bm.blocks = _CountingList(bm.blocks)
    bm.commit_full_blocks(req)  # nothing new: one look at the last full block
    assert bm.blocks.reads <= 1
    req.token_ids.extend(range(4))
    assert bm.grow(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.blocks.reads = 0
    bm.commit_full_blocks(req)  # one block became full: it is named, its named neighbour stops the walk
    assert bm.blocks.reads <= 3 and bm.blocks[req.block_table[full]].hash is not None
