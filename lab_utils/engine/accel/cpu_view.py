"""The model a CPU engine runs: a view of the caller's model with packed linears and fused layers.

`fast_linears(model, device, config)` is what the engine calls; it builds (once per model and switches) a copy
of the module tree that shares the model's parameters, with `cpu_linear`'s packed linears and `cpu_fused`'s
fused layers, as the config's CPU switches say (`cpu_packed_linear`, `cpu_fused_layers`, `cpu_small_m_linear`,
`cpu_kernels`).
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from lab_utils.engine.accel.cpu_fused import fusable, fuse_layers
from lab_utils.engine.accel.device_fused import fuse_for_device
from lab_utils.engine.accel.cpu_linear import PackedLinear, SmallMInt8Linear, packed_linear_available
from lab_utils.engine.config import EngineConfig, cpu_switch_default
from lab_utils.quant.linear import Int8Linear, W8A8GroupLinear


def pack_linears(model: nn.Module, fuse: bool = True, small_m: bool | None = None, kernels: bool | None = None
                 ) -> tuple[nn.Module, int]:
    """A copy of `model`'s module tree that shares its parameters and buffers, with every plain `nn.Linear`
    replaced by a `PackedLinear` (and every `Int8Linear` / `W8A8GroupLinear` by a `SmallMInt8Linear`), and for a plain
    Llama the layers fused (`cpu_fused`: q/k/v and gate/up as one packed weight each, fewer small kernels).
    `small_m`, `kernels`: the compiled kernels' switches (`cpu_linear`). Returns (view, number of linears
    packed); the model is unchanged."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo)
    count = 0
    fused = fuse and fusable(model)
    for module in list(view.modules()):
        for name, child in list(module.named_children()):
            if fused and name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                continue  # packed together by fuse_layers, not one by one (one packed copy of each weight)
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child, small_m, kernels))
                count += 1
            elif type(child) in (Int8Linear, W8A8GroupLinear) and child.scale.dtype == torch.float32:
                setattr(module, name, SmallMInt8Linear(child, small_m, kernels))
                count += 1
    if fused:
        fuse_layers(view, small_m, kernels)
        count += 5 * len(view.model.layers)
    return view, count


# one packed view per model, shared by every engine built on it (a lab often builds several engines on one
# model: each would otherwise hold its own extra copy of the weights); reused only while no weight has changed
# (the switches: fused layers, small-M kernel, compiled kernels)
_VIEWS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, list[int], tuple]] = weakref.WeakKeyDictionary()


def _versions(model: nn.Module) -> list[int]:
    return [p._version for p in model.parameters()]  # bumped by every in-place change (training, copy_)


def fast_linears(model: nn.Module, device: torch.device, config: EngineConfig | None = None) -> nn.Module:
    """The model the engine's runner calls: on CUDA the fused view (`device_fused`); a packed view on CPU (float32,
    oneDNN present, `cpu_packed_linear` on), with fused layers if `cpu_fused_layers`; the model itself otherwise.
    The switches (`cpu_small_m_linear` and `cpu_kernels` too) come from `config`, or without one (a draft model,
    a script) from `EngineConfig`'s defaults. (They are for A/B measurements: benchmarks/engine_step_times.py.)"""
    def on(name: str) -> bool:
        return cpu_switch_default(name) if config is None else getattr(config, name)

    if device.type == "cuda":
        return fuse_for_device(model)
    if not on("cpu_packed_linear") or not packed_linear_available(device, model.dtype):
        return model
    switches = (on("cpu_fused_layers"), on("cpu_small_m_linear"), on("cpu_kernels"))
    cached = _VIEWS.get(model)
    if cached is not None and cached[1] == _versions(model) and cached[2] == switches:
        return cached[0]
    view, count = pack_linears(model, *switches)
    if not count:
        return model
    _VIEWS[model] = (view, _versions(model), switches)
    return view
