"""The CUDA paths' logic, run on a CPU: graph capture/replay with a fake graph and stream, no host sync inside
the captured decode forward, and fast paths that fall back one at a time."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.checks.teacher_forced import assert_greedy_outputs_agree
from lab_utils.engine.accel.cuda_graphs import DecodeGraphRunner
from lab_utils.models.loader import load_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float32)


def _prompts(n: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


class _FakeCuda:
    """torch.cuda's graph API on a CPU. A capture records the addresses of the entry's static buffers; a replay
    checks they did not move (a graph reads and writes fixed addresses), then recomputes into the captured
    output in place, as a replay of the recorded kernels would."""

    def __init__(self, runner: DecodeGraphRunner) -> None:
        self.runner, self.captures, self.replays, self.capturing = runner, [], 0, None
        self.eager_forward = runner._forward
        runner._forward = self._forward

    @staticmethod
    def buffers(e) -> dict[str, int]:
        named = {"inputs": e.inputs, "keys": e.keys, "key_block": e.key_block, "key_offset": e.key_offset,
                 "query_index": e.query_index, "unpad_index": e.unpad_index}
        return {k: t.data_ptr() for k, t in named.items()}

    def _forward(self, e):
        out = self.eager_forward(e)
        if self.capturing is not None:
            self.capturing.entry, self.capturing.ptrs = e, self.buffers(e)
        return out

    def install(self, monkeypatch) -> None:
        fake = self

        class Stream:
            def __init__(self, *a, **k) -> None:
                pass

            def wait_stream(self, other) -> None:
                pass

        class Graph:
            def __init__(self) -> None:
                self.entry = self.ptrs = None
                fake.captures.append(self)

            def pool(self):
                return "pool"

            def replay(self) -> None:
                e = self.entry
                assert fake.buffers(e) == self.ptrs, "a static input buffer moved after capture"
                out_ptr = e.hidden.data_ptr()
                e.hidden.copy_(fake.eager_forward(e))
                assert e.hidden.data_ptr() == out_ptr
                fake.replays += 1

        @contextlib.contextmanager
        def graph(g, pool=None, **kw):
            assert pool is None or pool == "pool", "every graph shares one memory pool"
            fake.capturing = g
            try:
                yield g
            finally:
                fake.capturing = None

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())


def _graph_engine(tiny, **cfg) -> LLMEngine:
    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enable_prefix_caching=False, **cfg), device="cpu")
    r = eng.runner
    r.graphs = DecodeGraphRunner(r.model, r.cache, eng.block_size, eng.device, eng.config.max_num_seqs,
                                 eng.max_model_len, capture=False)
    r.cpu_decode_kernel = False
    return eng


def test_graph_replay_keeps_static_buffers_across_batch_and_context_buckets(tiny, monkeypatch):
    prompts = _prompts(7, [30, 250, 120, 9])  # contexts cross 256 (-> 512); batch shrinks 7 -> 4 -> ... -> 1
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 20, 8, 14, 5, 11, 2)]
    ref = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enforce_eager=True), device="cpu").generate(prompts, params)
    eng = _graph_engine(tiny, max_num_seqs=8)
    fake = _FakeCuda(eng.runner.graphs)
    fake.install(monkeypatch)
    eng.runner.graphs.capture = True
    got = eng.generate(prompts, params)
    assert_greedy_outputs_agree(tiny[0], got, ref, "the graph path vs eager (fp32)")
    keys = set(eng.runner.graphs.entries)
    assert {b for b, _ in keys} >= {1, 2, 4, 8} and {L for _, L in keys} >= {256, 512}, keys
    assert len(fake.captures) == len(keys) and all(e.graph is not None for e in eng.runner.graphs.entries.values())
    assert fake.replays == eng.runner.graphs.num_replays > len(keys)
    assert eng.runner.fast_path_error is None


def test_fake_replay_catches_a_rebound_static_buffer(tiny, monkeypatch):
    """Negative control: code that replaces a static buffer instead of copying into it is caught."""
    eng = _graph_engine(tiny, max_num_seqs=2)
    g = eng.runner.graphs
    fake = _FakeCuda(g)
    fake.install(monkeypatch)
    g.capture = True
    entry = g._entry
    g._entry = lambda b, L: entry(b, L)
    eng.generate(_prompts(1, [5]), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    e = next(iter(g.entries.values()))
    e.inputs = e.inputs.clone()  # what a careless edit would do
    with pytest.raises(AssertionError, match="static input buffer moved"):
        e.graph.replay()


SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave.Tensor", "item")


class NoHostSync(TorchDispatchMode):
    """Fails on ops that make the host wait for the device (not allowed inside a CUDA graph capture)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(op in name for op in SYNC_OPS) or (name.startswith("aten._to_copy") and (kwargs or {}).get("device")):
            raise AssertionError(f"host sync inside the captured forward: {name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_captured_decode_forward_makes_no_host_sync(tiny, kv):
    eng = _graph_engine(tiny, max_num_seqs=4, kv_cache_dtype=kv)
    g = eng.runner.graphs
    eng.generate(_prompts(3, [6, 17]), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert g.entries
    for e in g.entries.values():  # the very forward a capture records
        with NoHostSync(), torch.inference_mode():
            g._forward(e)


def test_no_host_sync_mode_catches_an_item_call(tiny):
    """Negative control for the mode above."""
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        torch.ones(2).sum().item()


def test_a_failing_flex_keeps_cuda_graphs_on(tiny, monkeypatch):
    """Flex fails on prefill steps: only flex goes off; decode steps still replay graphs (and vice versa)."""
    import lab_utils.engine.accel.flex_attention as fa

    prompts = _prompts(3, [9, 14])
    ref = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enforce_eager=True), device="cpu").generate(prompts, GREEDY)
    eng = _graph_engine(tiny, max_num_seqs=4)
    eng.runner.attention_backend = "flex"

    def broken(*a, **k):
        raise RuntimeError("Triton: no C compiler")

    monkeypatch.setattr(fa.FlexPagedAttention, "__init__", broken)
    with pytest.warns(UserWarning, match=r"'flex' failed .*still on: cuda_graphs"):
        got = eng.generate(prompts, GREEDY)
    assert_greedy_outputs_agree(tiny[0], got, ref, "the graph path vs eager (fp32)")
    r = eng.runner
    assert r.attention_backend == "sdpa" and r.graphs is not None and r.graphs.entries  # decode steps ran through it
    assert set(r.fast_path_errors) == {"flex"} and "no C compiler" in r.fast_path_error


def test_a_failing_graph_keeps_flex_on(tiny):
    prompts = _prompts(2, [9])
    ref = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enforce_eager=True), device="cpu").generate(prompts, GREEDY)
    eng = _graph_engine(tiny, max_num_seqs=4)
    eng.runner.attention_backend = "flex"

    def broken(*a, **k):
        raise RuntimeError("capture failed")

    eng.runner.graphs.run = broken
    with pytest.warns(UserWarning, match=r"'cuda_graphs' failed .*still on: flex"):
        got = eng.generate(prompts, GREEDY)
    assert_greedy_outputs_agree(tiny[0], got, ref, "the graph path vs eager (fp32)")
    assert eng.runner.graphs is None and eng.runner.attention_backend == "flex"
    assert set(eng.runner.fast_path_errors) == {"cuda_graphs"}


def test_warmup_captures_every_bucket_in_use_before_the_first_request(tiny, monkeypatch):
    """LLMEngine.warmup: graphs for batch buckets 1..max_batch at each context bucket up to max_context, then
    a measured run captures nothing new (and its tokens are the eager ones)."""
    prompts = _prompts(5, [40, 200, 90])
    ref = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enforce_eager=True), device="cpu").generate(prompts, GREEDY)
    eng = _graph_engine(tiny, max_num_seqs=8)
    fake = _FakeCuda(eng.runner.graphs)
    fake.install(monkeypatch)
    eng.runner.graphs.capture = True
    assert eng.can_warm_up()
    done = eng.warmup(max_batch=5, max_context=max(len(p) for p in prompts) + GREEDY.max_tokens)
    assert set(eng.runner.graphs.entries) == {(b, L) for b in (1, 2, 4, 8) for L in (256,)}, done
    assert done["graphs"] == 4 and done["steps"] == 8 and not done["fast_path_errors"]
    captured = len(fake.captures)
    got = eng.generate(prompts, GREEDY)
    assert_greedy_outputs_agree(tiny[0], got, ref, "the graph path vs eager (fp32)")
    assert len(fake.captures) == captured, "a measured run still captured graphs"
    eng.add_request(prompts[0], GREEDY)
    eng.step()  # a request holds blocks now: warm-up's dummy writes would corrupt them
    assert not eng.can_warm_up()
    with pytest.raises(RuntimeError, match="fresh engine"):
        eng.warmup()


def test_warmup_covers_longer_contexts(tiny):
    eng = _graph_engine(tiny, max_num_seqs=2)
    eng.warmup(max_context=600)
    assert {L for _, L in eng.runner.graphs.entries} == {256, 512, 1024}


def test_lab_backend_warms_up_the_batch_sizes_of_its_workload(tiny, monkeypatch):
    """LabBackend used to warm up at batch 1 only: now every graph bucket its workload can reach is captured
    before the clock starts, so a measured step never pays a capture."""
    from lab_utils.bench.backends import LabBackend
    from lab_utils.bench.workload import make_workload

    eng = _graph_engine(tiny, max_num_seqs=8)
    fake = _FakeCuda(eng.runner.graphs)
    fake.install(monkeypatch)
    eng.runner.graphs.capture = True
    wl = make_workload(tiny[1], 6, 12, 5, request_rate=float("inf"), seed=0)
    counts = []
    step = eng.step
    eng.step = lambda: (counts.append(len(fake.captures)), step())[1]
    LabBackend(engine=eng).run(wl)
    assert counts and counts[0] == counts[-1] == 4, counts  # buckets 1, 2, 4, 8 captured before step 1


def _compiled_flex_engine(model, monkeypatch) -> LLMEngine:
    import lab_utils.engine.accel.flex_attention as fa

    monkeypatch.setattr(fa, "COMPILE_BACKEND", "aot_eager")  # Dynamo + AOTAutograd, no C++ build
    init = fa.FlexPagedAttention.__init__
    monkeypatch.setattr(fa.FlexPagedAttention, "__init__", lambda self, c, m, compiled=None: init(self, c, m, True))
    eng = LLMEngine(model, EngineConfig(num_gpu_blocks=256, max_num_seqs=4), device="cpu")
    eng.runner.attention_backend, eng.runner.cpu_decode_kernel = "flex", False
    return eng


@pytest.mark.slow
def test_compiled_flex_on_cpu_recompiles_a_bounded_number_of_times(tiny, monkeypatch):
    """torch.compile(flex, dynamic=True): Dynamo specialises batch 1 vs > 1, 1 query vs more, and a few guards
    on query vs key lengths, so a model needs a handful of compiled variants, never one per shape. `warmup()`
    compiles the main four; an engine's varied steps (batch 1..4, prefill chunks, decodes, contexts 1..110)
    add at most a few; the same workload in a second engine compiles nothing new. Another dtype adds its own;
    the recompile limit is raised above what a notebook of several models needs (past it Dynamo would silently
    run flex uncompiled)."""
    import torch._dynamo
    import torch._dynamo.config as dc
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    frames = lambda: counters["frames"]["ok"]  # noqa: E731
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _prompts(8, [5, 30, 17, 64, 9, 40, 100, 3]) + _prompts(4, [7, 50, 1])
    ref = LLMEngine(tiny, EngineConfig(num_gpu_blocks=256, enforce_eager=True), device="cpu").generate(prompts, params)
    start = frames()
    eng = _compiled_flex_engine(tiny, monkeypatch)
    eng.warmup()
    warm = frames() - start
    assert 1 <= warm <= 4, f"{warm} compiled variants at warm-up"
    got = eng.generate(prompts, params)
    assert not eng.runner.fast_path_errors and eng.runner.attention_backend == "flex"
    assert_greedy_outputs_agree(tiny[0], got, ref, "the graph path vs eager (fp32)")
    one_model = frames() - start
    assert one_model <= 8, f"{one_model} compiled variants for one model"
    _compiled_flex_engine(tiny, monkeypatch).generate(prompts, params)
    assert frames() - start == one_model, "a second engine of the same model recompiled flex"
    m64 = load_model("tiny-random", device="cpu", dtype=torch.float64)
    _compiled_flex_engine(m64, monkeypatch).generate(prompts[:3], params)
    assert frames() - start <= 2 * one_model
    limit = getattr(dc, "recompile_limit", None) or dc.cache_size_limit
    assert limit >= 64 >= 4 * 8


def test_split_attention_groups_decode_rows_on_cpu_only(tiny, monkeypatch):
    """The CPU-tuned split (decode rows in groups of 8) multiplied kernels and host syncs on a GPU's eager path."""
    import lab_utils.engine.accel.split_attention as sa
    import lab_utils.engine.model_runner as mr

    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=16, enforce_eager=True), device="cpu")
    built = []
    monkeypatch.setattr(sa.SplitMetadata, "build", staticmethod(lambda *a, **k: built.append(a[-1])))
    monkeypatch.setattr(mr.AttentionMetadata, "build", staticmethod(lambda *a, **k: "meta"))
    r = mr.ModelRunner(eng.runner.model, eng.kv_cache, eng.block_size, torch.device("cuda"))
    assert not r.cpu_decode_kernel and isinstance(r._attention([[0]], [3], [1]), mr.PagedAttention) and not built
    r.device = torch.device("cpu")
    r._attention([[0]], [3], [1])
    assert built == [torch.device("cpu")]


def test_synchronize_and_timing_use_the_given_cuda_device(monkeypatch):
    from lab_utils import device as d

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: seen.append(dev))
    d.synchronize("cuda:1")
    assert seen == [torch.device("cuda:1")]
