"""Comparing two numerically different paths (a kernel and the reference, quantized and fp32, bf16 and fp32,
CUDA graphs and eager) on the same tokens, so the comparison does not depend on the CPU it runs on.

A free-running greedy comparison is fragile by construction: one near-tie that flips early changes every later
token, so "x % of tokens agree" measures where the first flip lands, and a different CPU (AVX2 or AVX-512
kernels, another summation order) moves it. Teacher-forced, both paths score one token sequence; position by
position the argmax must agree wherever the reference's top-2 margin is wider than what the two paths'
rounding can explain, and the logits must lie within a stated tolerance of each other."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@torch.no_grad()
def score(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's logits [T, vocab] (float32) at every position of `ids`, one plain causal forward."""
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device))[0].float().cpu()


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[T] the gap between each position's best and second-best logit."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@dataclass
class Agreement:
    """How two paths' logits over the same positions compare (`compare`)."""
    positions: int
    decisive: int               # positions whose reference margin exceeds `tie`
    decisive_agree: int         # of those, where both paths pick the same token
    all_agree: int              # over every position (near-ties included)
    max_abs_diff: float         # the largest |logit difference| anywhere
    tie: float
    disagreements: list[tuple[int, float, float]] = field(default_factory=list)  # (position, margin, |diff| there)

    @property
    def decisive_fraction(self) -> float:
        return self.decisive_agree / self.decisive if self.decisive else 1.0

    @property
    def fraction(self) -> float:
        return self.all_agree / self.positions if self.positions else 1.0

    def describe(self) -> str:
        worst = ", ".join(f"position {p}: margin {m:.3g}, |diff| {d:.3g}" for p, m, d in self.disagreements[:3])
        return (f"argmax agrees at {self.decisive_agree}/{self.decisive} positions whose reference margin exceeds "
                f"{self.tie:.3g} ({self.all_agree}/{self.positions} overall); max |logit diff| "
                f"{self.max_abs_diff:.3g}" + (f"; decisive disagreements at {worst}" if worst else ""))


def compare(reference: torch.Tensor | list[torch.Tensor], other: torch.Tensor | list[torch.Tensor],
            tie: float) -> Agreement:
    """Position by position: the argmax where the reference's top-2 margin exceeds `tie`, and the logits.
    `reference` / `other`: [T, vocab] logits of the same tokens (or lists of them, one per sequence)."""
    ref = torch.cat(list(reference)) if isinstance(reference, list) else reference
    got = torch.cat(list(other)) if isinstance(other, list) else other
    if ref.shape != got.shape:
        raise ValueError(f"the two paths scored different shapes: {tuple(ref.shape)} vs {tuple(got.shape)}")
    ref, got = ref.float(), got.float()
    margin = top2_margin(ref)
    same = ref.argmax(-1) == got.argmax(-1)
    decisive = margin > tie
    diff = (ref - got).abs()
    bad = (decisive & ~same).nonzero().flatten().tolist()
    return Agreement(positions=ref.shape[0], decisive=int(decisive.sum()), decisive_agree=int((decisive & same).sum()),
                     all_agree=int(same.sum()), max_abs_diff=float(diff.max()) if diff.numel() else 0.0, tie=tie,
                     disagreements=[(p, float(margin[p]), float(diff[p].max())) for p in bad])


def rounding_tie(dtype: torch.dtype, logits: torch.Tensor, floor: float = 1e-3) -> float:
    """The near-tie tolerance of lab 07's rule: 8 units in the last place of `dtype` at the largest |logit|,
    never below fp32's shape noise (`floor`): a margin that small may flip under another kernel's rounding."""
    return max(floor, 8 * torch.finfo(dtype).eps * float(logits.abs().max()))


@torch.no_grad()
def engine_logits(engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab]: the engine's logits before each token of `continuation`, teacher-forced
    through the engine's own path (prefill, paged KV cache in its dtype, decode steps and their kernels)."""
    return engine_logits_batch(engine, [prompt], [continuation])[0]


@torch.no_grad()
def engine_logits_batch(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Like `engine_logits` for several requests run together (batched decode, chunked prefills, as the engine
    schedules them). Each step's choice is pinned to the given token, so every step scores the same tokens
    whatever the path's rounding: the logits are recorded as computed, then every other token is masked."""
    from lab_utils import SamplingParams

    if len(prompts) != len(continuations) or any(not c for c in continuations):
        raise ValueError("one non-empty continuation per prompt")
    recorded: dict[str, list[torch.Tensor]] = {}
    wanted: dict[str, list[int]] = {}
    original = engine.structured.apply

    def pinned(logits: torch.Tensor, to_sample) -> torch.Tensor:
        logits = original(logits, to_sample)
        forced = torch.full_like(logits, float("-inf"))
        for row, req in enumerate(to_sample):
            seen = recorded.setdefault(req.request_id, [])
            seen.append(logits[row].detach().float().cpu().clone())
            forced[row, wanted[req.request_id][len(seen) - 1]] = 0.0
        return forced

    engine.structured.apply = pinned
    try:
        for prompt, cont in zip(prompts, continuations):
            wanted[engine.add_request(prompt, SamplingParams(max_tokens=len(cont), temperature=0.0,
                                                             ignore_eos=True))] = list(cont)
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished() and len(finished) < len(wanted):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = list(out.token_ids)
    finally:
        del engine.structured.apply  # the instance attribute: back to the class's method
    for rid, cont in wanted.items():
        if finished.get(rid) != cont:
            raise RuntimeError(f"the engine did not follow the forced tokens: {finished.get(rid)} vs {cont}")
    return [torch.stack(recorded[rid]) for rid in wanted]


def assert_same_up_to_rounding(reference: list[torch.Tensor], other: list[torch.Tensor], what: str) -> Agreement:
    """Two float32 paths that compute the same sums in another order (a kernel and PyTorch's op, oneDNN and
    F.linear): their logits over the same tokens lie within float32 round-off of each other (1e-4 of the
    largest |logit|, at least 1e-4), and the argmax agrees wherever the reference's top-2 margin exceeds
    lab 07's near-tie tolerance."""
    ref = torch.cat(list(reference))
    agreement = compare(reference, other, tie=rounding_tie(torch.float32, ref))
    scale = max(1.0, float(ref.abs().max()))
    assert agreement.max_abs_diff <= 1e-4 * scale, f"{what}: {agreement.describe()}"
    assert agreement.decisive_fraction == 1.0, f"{what}: {agreement.describe()}"
    return agreement


@torch.no_grad()
def same_or_near_tie(model: torch.nn.Module, prompt: list[int], a: list[int], b: list[int]) -> tuple[bool, float]:
    """(ok, gap) for two greedy continuations of one prompt from two runs whose batches differed (other rows,
    other kernel shapes): identical, or parting first where the model's two candidates lie within the near-tie
    tolerance of its dtype (`rounding_tie`), scored on the shared prefix: the one position both runs reached
    on the same tokens. After a parting the two continuations are not comparable, so nothing later is judged."""
    a, b = list(a), list(b)
    if a == b:
        return True, 0.0
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:  # one is a prefix of the other: they stopped at different lengths
        return False, float("inf")
    logits = score(model, list(prompt) + a[:k])[-1]
    gap = abs(float(logits[a[k]] - logits[b[k]]))
    return gap <= rounding_tie(next(model.parameters()).dtype, logits), gap


@dataclass
class GreedyRuns:
    """Two engines' greedy outputs for the same prompts, judged one request at a time by `same_or_near_tie`."""
    total: int
    identical: int
    near_ties: dict[str, float] = field(default_factory=dict)  # request -> gap at the first parting (<= the tie)
    partings: dict[str, float] = field(default_factory=dict)   # request -> gap: parted where the model was sure

    @property
    def ok(self) -> bool:
        return not self.partings

    def describe(self) -> str:
        worst = ", ".join(f"{k} (gap {g:.3g})" for k, g in list(self.partings.items())[:3])
        return (f"{self.identical}/{self.total} identical, {len(self.near_ties)} parted at a near-tie, "
                f"{len(self.partings)} parted where the model was sure" + (f": {worst}" if worst else ""))


def compare_greedy_runs(model: torch.nn.Module, prompts: dict[str, list[int]], a: dict[str, list[int]],
                        b: dict[str, list[int]]) -> GreedyRuns:
    """Every request of two greedy runs (two engines, two batch mixes): identical, or parting first at a near-tie
    of `model`'s dtype. `prompts`/`a`/`b` map request ids to the prompt and to each run's output tokens."""
    if set(a) != set(b) or not set(a) <= set(prompts):
        raise ValueError(f"the two runs answered different requests: {sorted(set(a) ^ set(b))[:5]}")
    runs = GreedyRuns(total=len(a), identical=0)
    for rid in a:
        if list(a[rid]) == list(b[rid]):
            runs.identical += 1
            continue
        ok, gap = same_or_near_tie(model, prompts[rid], a[rid], b[rid])
        if ok:
            runs.near_ties[rid] = gap
        else:
            runs.partings[rid] = gap
    return runs


def assert_greedy_outputs_agree(model: torch.nn.Module, got: list, ref: list, what: str) -> GreedyRuns:
    """Two engine runs of the same prompts (lists of outputs with `prompt_token_ids` and `token_ids`, in one
    order) whose arithmetic differs in shape only (other batches, padding, graphs, a verify pass over k tokens):
    every greedy output identical, or parting first at a near-tie of `model`'s dtype."""
    if [list(o.prompt_token_ids) for o in got] != [list(o.prompt_token_ids) for o in ref]:
        raise ValueError(f"{what}: the two runs were given different prompts")
    runs = compare_greedy_runs(model, {str(i): list(o.prompt_token_ids) for i, o in enumerate(ref)},
                               {str(i): list(o.token_ids) for i, o in enumerate(got)},
                               {str(i): list(o.token_ids) for i, o in enumerate(ref)})
    assert runs.ok, f"{what}: {runs.describe()}"
    return runs
