"""vLLM's own versions of labs 09 and 10, next to the lab's: `tensor_parallel_size` and disaggregated prefill
(`kv_transfer_config`). They need two GPUs (one per rank / per instance); elsewhere `skip_reason` says why not.

- TP: `LLM(model, tensor_parallel_size=2)` splits every layer's heads and MLP columns over two GPUs with NCCL
  all-reduces, as `lab_utils.parallel` does with its two ranks.
- P/D: two vLLM instances, prefill on GPU 0 and decode on GPU 1, each started with a `kv_transfer_config`.
  vLLM's `ExampleConnector` (the connector of its offline disaggregation example) writes the prompt's KV to a
  shared folder from the prefill instance and loads it in the decode instance; production deployments use
  `NixlConnector` (GPU to GPU over NIXL/UCX), which the `config` here also shows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lab_utils import vllm_env


def skip_reason(gpus_needed: int = 2) -> str | None:
    """None when vLLM's multi-GPU examples can run here, else why not (shown by the labs)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < gpus_needed:
        return f"needs {gpus_needed} GPUs (one per rank or instance), found {n}"
    ok, why = vllm_env.available()
    return None if ok else why


def tp_kwargs(tensor_parallel_size: int = 2, **flags) -> dict:
    """`vllm.LLM` keyword arguments for tensor parallelism (the lab's flag names for the rest)."""
    return vllm_env.llm_kwargs(tensor_parallel_size=tensor_parallel_size, **flags)


def run_tp(model_folder: str, prompts: list[list[int]], max_tokens: int, tensor_parallel_size: int = 2,
           **flags) -> list[list[int]]:
    """Greedy token ids from vLLM with `tensor_parallel_size` GPUs (raises where `skip_reason()` is not None)."""
    why = skip_reason(tensor_parallel_size)
    if why:
        raise RuntimeError(why)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_folder), **tp_kwargs(tensor_parallel_size, **flags))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def kv_transfer_config(role: str, storage: str | None = None, connector: str = "ExampleConnector") -> dict:
    """vLLM's `kv_transfer_config` for one instance of a P/D pair. role: "kv_producer" (prefill) |
    "kv_consumer" (decode) | "kv_both"."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"role={role!r} is invalid: must be 'kv_producer', 'kv_consumer' or 'kv_both'")
    cfg: dict = {"kv_connector": connector, "kv_role": role}
    if connector == "ExampleConnector":
        cfg["kv_connector_extra_config"] = {"shared_storage_path": storage or "local_storage"}
    return cfg


_PD_WORKER = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], kv_transfer_config=KVTransferConfig(**a["kv"]), **a["kwargs"])
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in a["prompts"]],
                    SamplingParams(max_tokens=a["max_tokens"], temperature=0.0, ignore_eos=True))
print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def run_pd(model_folder: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 900.0,
           **flags) -> list[list[int]]:
    """vLLM's offline disaggregated prefill: an instance on GPU 0 prefills (max_tokens=1) and saves the KV, an
    instance on GPU 1 loads it and decodes. Returns the decode instance's greedy token ids."""
    why = skip_reason(2)
    if why:
        raise RuntimeError(why)
    kwargs = vllm_env.llm_kwargs(**flags)
    with tempfile.TemporaryDirectory(prefix="vllm-pd-") as storage:
        outs = []
        for gpu, role, n in ((0, "kv_producer", 1), (1, "kv_consumer", max_tokens)):
            arg = json.dumps({"model": str(model_folder), "kv": kv_transfer_config(role, storage), "kwargs": kwargs,
                              "prompts": prompts, "max_tokens": n})
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), **vllm_env.setup())
            r = subprocess.run([sys.executable, "-c", _PD_WORKER, arg], env=env, capture_output=True, text=True,
                               timeout=timeout_s, cwd=Path(storage))
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
            if r.returncode or line is None:
                raise RuntimeError(f"vLLM {role} instance failed: {(r.stderr or r.stdout)[-800:]}")
            outs.append(json.loads(line[len("RESULT"):]))
    return outs[1]
