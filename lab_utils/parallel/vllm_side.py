"""vLLM's own versions of labs 09 and 10, next to the lab's: `tensor_parallel_size` and disaggregated prefill
(`kv_transfer_config`). They need two GPUs (one per rank / per instance); elsewhere `skip_reason` says why not.

- TP: `LLM(model, tensor_parallel_size=2)` splits every layer's heads and MLP columns over two GPUs with NCCL
  all-reduces, as `lab_utils.parallel` does with its two ranks. vLLM splits whole heads only, so it refuses
  SmolLM2 at TP=2 (9 query heads, 3 KV heads; `kv_heads.vllm_tp_refusal`): its TP run uses `VLLM_TP_MODEL`, the
  Llama-3.2-1B shape with random weights, written to a folder (`random_weights_folder`) so that vLLM loads the
  very weights the lab's ranks draw.
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
from lab_utils.parallel.kv_heads import check_vllm_tp

VLLM_TP_MODEL = "llama-3.2-1b-random"  # 32 query heads, 8 KV heads: any TP size up to 8 that vLLM accepts


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


def random_weights_folder(name: str, folder: str | Path | None = None, seed: int = 0,
                          device: str = "cpu") -> Path:
    """Write a registered random-weight model (the weights `load_model(name, seed=seed)` draws on `device`; CPU
    and CUDA generators differ) as a Hugging Face folder vLLM loads: config.json, model.safetensors (fp32, the
    tied lm_head left out as HF does) and its tokenizer's files. Returns the folder (default: the course cache)."""
    import shutil

    from safetensors.torch import save_file

    from lab_utils.models.loader import load_model, tokenizer_folder
    from lab_utils.models.registry import REGISTRY
    from lab_utils.paths import cache_dir

    spec = REGISTRY.get(name)
    if spec is None or spec.kind != "random":
        randoms = sorted(n for n, r in REGISTRY.items() if r.kind == "random")
        raise ValueError(f"{name!r} is not a registered random-weight model: choose one of {randoms}")
    out = Path(folder) if folder is not None else cache_dir() / "models" / f"{name}-seed{seed}-{device}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(name, device=device, dtype=torch.float32, seed=seed)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    if spec.config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors.part"), metadata={"format": "pt"})
    config = dict(spec.config, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer_folder(name).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    (out / "model.safetensors.part").rename(out / "model.safetensors")  # last: a folder with it is complete
    return out


def check_folder_tp(model_folder: str | Path, tensor_parallel_size: int) -> None:
    """Raise ValueError, as vLLM would and before it starts, when the folder's head counts do not split over
    `tensor_parallel_size` GPUs the way vLLM splits them."""
    cfg = json.loads((Path(model_folder) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    check_vllm_tp(heads, cfg.get("num_key_value_heads", heads), tensor_parallel_size, str(model_folder))


def run_tp(model_folder: str, prompts: list[list[int]], max_tokens: int, tensor_parallel_size: int = 2,
           **flags) -> list[list[int]]:
    """Greedy token ids from vLLM with `tensor_parallel_size` GPUs (raises where `skip_reason()` is not None, or
    where vLLM would refuse the model's head counts: `check_folder_tp`, before vLLM starts)."""
    why = skip_reason(tensor_parallel_size)
    if why:
        raise RuntimeError(why)
    check_folder_tp(model_folder, tensor_parallel_size)
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
