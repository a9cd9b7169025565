"""The trained proposers' acceptance in the engine vs their teacher-forced accuracy outside it, on the same text.

    OMP_NUM_THREADS=1 python benchmarks/spec_agreement.py --workload chat --num-prompts 6 --k 3 \
        --json benchmarks/results/spec_agreement_chat.json

For each proposer (draft, medusa, eagle): the engine generates greedily at batch 1 while every proposal is recorded
(`lab_utils.speculative.agreement`); then, outside the engine, (1) every recorded proposal is recomputed teacher-forced
from one plain forward of the target over the final text (the share that agrees must be ~1: a lower share is a
bug in features, offsets or history), and (2) the proposer is scored at EVERY generated position of that text:
top-1 at each draft depth, and the first-guess accuracy restricted to the positions the engine asked at, which
must equal the engine's first-position acceptance.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.engine.config import SpecConfig
from lab_utils.speculative.agreement import ProposalRecorder, accepted_from_text, replay, teacher_forced
from lab_utils.speculative.training.train import acceptance_summary
from lab_utils.speculative.training.workloads import WORKLOADS, make_prompts


def run(model_tok, method: str, k: int, prompts: list[str], max_tokens: int) -> dict:
    model, tok = model_tok
    eng = LLMEngine(model_tok, EngineConfig(speculative=SpecConfig(method, k), kv_cache_memory_bytes=64 << 20,
                                            enable_prefix_caching=False), device="cpu")
    rec = ProposalRecorder(eng)
    texts, starts = {}, {}
    for p in prompts:  # batch 1, as lab 07 measures
        o = eng.generate([p], SamplingParams(max_tokens=max_tokens))[0]
        texts[o.request_id] = list(o.prompt_token_ids) + list(o.token_ids)
        starts[o.request_id] = len(o.prompt_token_ids)
    rec.stop()
    calls = [c for c in rec.calls if c.guesses]
    st = eng.spec.stats.as_dict()
    rows = replay(eng.spec.proposer, model, calls, {r: t[:starts[r]] for r, t in texts.items()}, texts)
    kept = accepted_from_text(calls, texts)
    # the offline (teacher-forced) first guess at each position the engine asked, checked against the final text
    first_at_asked = [bool(o) and o[0] == texts[c.request_id][len(c.token_ids)] for c, (_, o, _) in zip(calls, rows)]
    tf = [teacher_forced(eng.spec.proposer, model, ids, starts[rid], k) for rid, ids in texts.items()]
    summary = acceptance_summary(torch.cat(tf))
    return {"engine": {"acceptance_per_position": st["spec_acceptance_per_position"],
                       "acceptance_rate": st["spec_acceptance_rate"],
                       "tokens_per_verify": st["spec_mean_tokens_per_step"], "proposals": len(calls)},
            "replay": {"proposals_equal": sum(e == o for e, o, _ in rows) / max(1, len(rows)),
                       "max_feature_diff": max((d for _, _, d in rows), default=0.0),
                       "accepted_from_text": sum(kept), "engine_accepted": st["spec_num_accepted"]},
            "teacher_forced_all_positions": summary,
            "teacher_forced_first_at_engine_positions": sum(first_at_asked) / max(1, len(first_at_asked))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    ap.add_argument("--methods", nargs="+", default=["draft", "medusa", "eagle"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model_tok = load_model(a.model, device="cpu", dtype=torch.float32)
    prompts = make_prompts(a.workload, model_tok[1], a.num_prompts, seed=a.seed)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform(),
           "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "args": vars(a), "methods": {}}
    for m in a.methods:
        r = res["methods"][m] = run(model_tok, m, a.k, prompts, a.max_tokens)
        e, t = r["engine"], r["teacher_forced_all_positions"]
        print(f"{m:7s} engine by depth {[None if x is None else round(x, 3) for x in e['acceptance_per_position']]}"
              f"  teacher-forced top-1 {t['top1']}  first at engine positions "
              f"{r['teacher_forced_first_at_engine_positions']:.3f}  replay equal {r['replay']['proposals_equal']:.3f}"
              f"  (feature diff {r['replay']['max_feature_diff']:.1e})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json)
    return res


if __name__ == "__main__":
    main()
