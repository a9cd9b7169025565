"""What one proposer step costs next to one target decode step, at batch 1 (the 'c' of speculation's arithmetic).

    OMP_NUM_THREADS=1 python benchmarks/spec_head_cost.py --json benchmarks/results/spec_head_cost.json

Target step: the engine's plain decode at batch 1 (packed linears, paged KV), per generated token. Proposer steps:
`propose(k=1)` of the EAGLE head (full 49k vocabulary vs its draft vocabulary), of the Medusa heads (k=4 heads,
both vocabularies) and of the distilled draft model, each with the request's state warm, medians of many calls.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.engine.config import SpecConfig
from lab_utils.speculative import make_proposer
from lab_utils.speculative.medusa import VocabHead
from lab_utils.speculative.training.workloads import make_prompts


def target_step_s(model_tok, prompt: str, tokens: int, repeat: int) -> float:
    """Seconds per decode step: (time for 1 + tokens outputs - time for 1 output) / tokens."""
    eng = LLMEngine(model_tok, EngineConfig(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False), device="cpu")
    t = {}
    for n in (1, 1 + tokens):
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            eng.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
            runs.append(time.perf_counter() - t0)
        t[n] = statistics.median(runs)
    return (t[1 + tokens] - t[1]) / tokens


@torch.inference_mode()
def propose_s(prop, ids: list[int], hidden: torch.Tensor | None, k: int, calls: int) -> float:
    prop.request_id = "bench"
    times = []
    for i in range(calls + 3):
        L = len(ids) - calls - 3 + i
        t0 = time.perf_counter()
        prop.propose(ids[:L], k, hidden=None if hidden is None else hidden[L - 2: L - 1])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tok = load_model(a.model, device="cpu", dtype=torch.float32)
    prompt = make_prompts("chat", tok, 1)[0]
    ids = tok(prompt, add_special_tokens=False).input_ids
    ids = ids + tok(" The sky looks blue because air scatters short wavelengths of sunlight more than long ones, "
                    "so blue light reaches our eyes from every direction.", add_special_tokens=False).input_ids
    hidden = model.hidden_states(torch.tensor([ids]))[0].detach()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform(),
           "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "threads": torch.get_num_threads(),
           "load_avg_1m_start": os.getloadavg()[0], "steps_s": {}}
    res["steps_s"]["target decode step"] = target_step_s((model, tok), prompt, a.tokens, a.repeat)
    for method, k in (("eagle", 1), ("medusa", 4), ("draft", 1)):
        try:
            prop = make_proposer(SpecConfig(method, k), model, "cpu")
        except ValueError as e:
            print(f"skipping {method}: {e}")
            continue
        h = hidden if prop.needs_hidden else None
        lm = getattr(prop, "lm", None)
        if lm is not None and lm.vocab is not None:
            res["steps_s"][f"{method} k={k}, draft vocabulary {len(lm.vocab)}"] = propose_s(prop, ids, h, k, a.calls)
            prop.lm = VocabHead(model, None)
        res["steps_s"][f"{method} k={k}, full vocabulary"] = propose_s(prop, ids, h, k, a.calls)
    base = res["steps_s"]["target decode step"]
    res["relative_to_target_step"] = {n: round(v / base, 3) for n, v in res["steps_s"].items()}
    res["load_avg_1m_end"] = os.getloadavg()[0]
    for n, v in res["steps_s"].items():
        print(f"{n:42s} {v * 1e3:7.2f} ms  {res['relative_to_target_step'][n]:.3f}x a target step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json)
    return res


if __name__ == "__main__":
    main()
