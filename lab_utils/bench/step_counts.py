"""What one engine step costs on the host, counted: tensors made from host data, device syncs, dispatcher calls.

A GPU step is fast only if the host keeps up: metadata built from Python lists is a pageable host-to-device copy
each, a `.tolist()` / `.item()` / `.cpu()` of a device tensor stalls the host until the device is done, and every
dispatcher (aten) call inside a layer is a kernel launch or more. These are counts, not times, so a CPU measures
them exactly for the CUDA code path:
- `cuda_logic_engine`: an engine on the CPU that runs the code CUDA runs (no packed CPU view or CPU kernels,
  the decode graph runner's padded static-buffer forward without capture, attention without the CPU-only split);
- `stub_forward`: the model's forward and lm head replaced by cheap stand-ins, so a step is its host side alone
  (scheduling, metadata, copies, sampling bookkeeping, outputs);
- `HostCounter`: a `TorchFunctionMode` plus wrappers of `torch.tensor` / `torch.as_tensor` (of a list) and
  `torch.from_numpy` that count tensors made from host data (each a host buffer and a copy), and sync calls (`item`, `tolist`, `cpu`, `numpy`, `__int__`/`__float__`/`__bool__` of a tensor,
  `torch.cuda.synchronize`);
- `aten_calls_per_decode_layer`: a `TorchDispatchMode` over one real decode step, calls inside layers / layers.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a device tensor to the host and wait for the device (on CUDA)
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}


def cuda_logic_engine(model, max_num_seqs: int, num_blocks: int, **config):
    """An `LLMEngine` on the CPU whose steps take CUDA's code path: the fused view a CUDA engine runs, no CPU
    kernels, decode steps through `DecodeGraphRunner` (padded static buffers, `capture=False`), attention
    without the CPU-only split."""
    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.engine.accel.attention_backends import step_attention
    from lab_utils.engine.accel.cuda_graphs import DecodeGraphRunner
    from lab_utils.engine.accel.device_fused import fuse_for_device

    cfg = EngineConfig(max_num_seqs=max_num_seqs, num_gpu_blocks=num_blocks, cpu_kernels=False,
                       cpu_packed_linear=False, cpu_fused_layers=False, cpu_small_m_linear=False,
                       **{"max_num_batched_tokens": max(512, 2 * max_num_seqs), **config})
    eng = LLMEngine(model, cfg, device="cpu")
    r = eng.runner
    r.model = fuse_for_device(r.model)  # what `fast_linears` gives a CUDA engine
    r.graphs = DecodeGraphRunner(r.model, r.cache, eng.block_size, eng.device, max_num_seqs, eng.max_model_len,
                                 capture=False)
    r.cpu_decode_kernel = False
    fp = r.fast_paths
    fp.attention = lambda cache, tables, ctx, q, bs, dev: step_attention(  # what a CUDA device takes
        fp.attention_backend, cache, tables, ctx, q, bs, dev, off=("cpu_kernel", "split"))
    return eng


@contextlib.contextmanager
def stub_forward(eng, vocab: int = 64):
    """The runner's model forward and lm head replaced by stand-ins that cost (almost) nothing: the hidden states
    are zeros, the logits one fixed row (greedy picks token `vocab - 1`)."""
    model = eng.runner.model
    hidden_size = model.config.hidden_size
    row = torch.zeros(vocab, device=eng.device)
    row[-1] = 1.0

    def hidden_states(input_ids, positions=None, attention=None):
        return torch.zeros(*input_ids.shape, hidden_size, dtype=model.dtype, device=input_ids.device)

    def logits(hidden):
        return row.expand(hidden.shape[0], vocab)

    model.hidden_states, model.logits = hidden_states, logits
    try:
        yield
    finally:
        del model.hidden_states, model.logits


class HostCounter(TorchFunctionMode):
    """Counts, while active, tensors made from host data (`torch.tensor` / `torch.as_tensor` of a list or
    tuple, `torch.from_numpy`) and sync calls (`SYNC_METHODS` on a tensor, `torch.cuda.synchronize`), with their
    call sites."""

    def __init__(self) -> None:
        super().__init__()
        self.list_tensors = 0
        self.syncs = 0
        self.sites: Counter = Counter()

    def _site(self, kind: str) -> None:
        import traceback

        for fr in reversed(traceback.extract_stack()[:-2]):
            if "lab_utils" in fr.filename and "step_counts" not in fr.filename:
                self.sites[f"{kind} {fr.filename.split('lab_utils/')[-1]}:{fr.lineno}"] += 1
                return
        self.sites[f"{kind} ?"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS and args and isinstance(args[0], torch.Tensor):
            self.syncs += 1
            self._site("sync")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = (torch.tensor, torch.as_tensor, torch.from_numpy, torch.cuda.synchronize)
        tensor, as_tensor, from_numpy, _ = self._saved

        def wrap(make, kinds):
            def made(data, *a, **k):
                if isinstance(data, kinds):
                    self.list_tensors += 1
                    self._site("list")
                return make(data, *a, **k)
            return made

        def synchronize(*a, **k):
            self.syncs += 1
            self._site("sync")
            return self._saved[3](*a, **k)

        # a numpy array made from Python data is the same host buffer + copy as `torch.tensor(list)`
        torch.tensor, torch.as_tensor = wrap(tensor, (list, tuple)), wrap(as_tensor, (list, tuple))
        torch.from_numpy, torch.cuda.synchronize = wrap(from_numpy, object), synchronize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor, torch.from_numpy, torch.cuda.synchronize = self._saved
        return super().__exit__(*exc)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n, length), generator=g).tolist()


def measure_host_steps(eng, batch: int, prompt_len: int = 100, steps: int = 20, arrivals: bool = False,
                       seed: int = 0) -> dict:
    """Host work of `steps` engine steps at `batch` running requests, forward stubbed: decode steady state, or
    with `arrivals` one new request (a prompt chunk in the step) joining per step while one leaves. Returns
    us/step (median and mean), host-made tensors/step and syncs/step."""
    from lab_utils import SamplingParams

    long = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    with stub_forward(eng):
        ids = [eng.add_request(p, long) for p in _prompts(batch, prompt_len, seed)]
        while any(eng.requests[i].num_output_tokens == 0 for i in ids):  # every prompt prefilled
            eng.step()
        for _ in range(3):
            eng.step()
        extra = _prompts(2 * steps, prompt_len, seed + 1)
        counter = HostCounter()
        times = []
        for s in range(2 * steps):  # timed steps first, then counted ones (the mode's overhead is not timed)
            if arrivals:
                eng.abort(ids.pop(0))
                ids.append(eng.add_request(extra[s], long))
            with counter if s >= steps else contextlib.nullcontext():
                t0 = time.perf_counter()
                eng.step()
                if s < steps:
                    times.append(time.perf_counter() - t0)
        for i in ids:
            eng.abort(i)
        eng.step()
    return {"batch": batch, "arrivals": arrivals, "steps": steps,
            # the median: on a shared machine a step that lost the CPU to another process is not the engine's cost
            "host_us_per_step": round(statistics.median(times) * 1e6, 1),
            "host_us_per_step_mean": round(statistics.fmean(times) * 1e6, 1),
            "list_tensors_per_step": counter.list_tensors / steps, "syncs_per_step": counter.syncs / steps,
            "sites": dict(counter.sites.most_common())}


class _AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.inside = 0  # > 0 while a decoder layer runs
        self.in_layers = 0
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.in_layers += 1
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def aten_calls_per_decode_layer(eng, batch: int = 4, prompt_len: int = 40) -> dict:
    """Dispatcher calls inside the decoder layers of one real decode step (after the prefill), per layer; the
    ops by name (per layer)."""
    from lab_utils import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in _prompts(batch, prompt_len, 3)]
    while any(eng.requests[i].num_output_tokens < 2 for i in ids):
        eng.step()
    counter = _AtenCounter()
    layers = list(eng.runner.model.model.layers)

    def pre(*_):
        counter.inside += 1

    def post(*_):
        counter.inside -= 1

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))]
    try:
        with counter:
            eng.step()
    finally:
        for h in hooks:
            h.remove()
        for i in ids:
            eng.abort(i)
        eng.step()
    n = len(layers)
    return {"aten_calls_per_decode_layer": counter.in_layers / n,
            "ops_per_layer": {k: v / n for k, v in counter.ops.most_common()}}
