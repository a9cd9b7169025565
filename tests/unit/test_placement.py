"""Labs 09/10 honour DEVICE: NCCL one rank per GPU with >= 2 GPUs, a stated CPU path on one GPU, gloo on CPU;
P/D workers on different GPUs where there are two, an explicit memory split on one. GPU counts are given."""
from __future__ import annotations

import pytest

from lab_utils.engine.config import EngineConfig
from lab_utils.parallel import placement as pl
from lab_utils.parallel import vllm_side


def test_parallel_placement_by_gpu_count():
    two = pl.parallel_placement("cuda", 2, gpus=2)
    assert (two.device, two.backend) == ("cuda", "nccl") and "one rank per GPU" in two.note
    one = pl.parallel_placement("cuda", 2, gpus=1)
    assert (one.device, one.backend) == ("cpu", "gloo") and "one GPU" in one.note
    cpu = pl.parallel_placement("cpu", 2)
    assert (cpu.device, cpu.backend, cpu.gpus) == ("cpu", "gloo", 0)


def test_pd_placement_by_gpu_count():
    two = pl.pd_placement("cuda", gpus=2)
    assert (two.prefill, two.decode, two.gpu_memory_utilization) == ("cuda:0", "cuda:1", None)
    one = pl.pd_placement("cuda", gpus=1)
    assert one.prefill == one.decode == "cuda:0" and 2 * one.gpu_memory_utilization <= 0.9
    assert pl.pd_placement("cpu").prefill == "cpu"


@pytest.mark.parametrize("gpus", [1, 2])
def test_disaggregated_cluster_places_workers_and_splits_a_shared_gpu(monkeypatch, gpus):
    from lab_utils.disagg.router import DisaggregatedCluster

    monkeypatch.setattr(pl, "_gpus", lambda device: 0 if str(device) == "cpu" else gpus)
    c = DisaggregatedCluster("tiny-random", EngineConfig(max_num_seqs=4), device="cuda")
    assert c.dtype == "bfloat16"  # the engine's GPU default, not fp32
    if gpus == 2:
        assert (c.placement.prefill, c.placement.decode) == ("cuda:0", "cuda:1")
        assert c.prefill_config.gpu_memory_utilization == 0.9
    else:
        assert c.placement.prefill == c.placement.decode == "cuda:0"
        assert c.prefill_config.gpu_memory_utilization == c.decode_config.gpu_memory_utilization == 0.4
        explicit = DisaggregatedCluster("tiny-random", EngineConfig(num_gpu_blocks=64), device="cuda")
        assert explicit.prefill_config.gpu_memory_utilization == 0.9  # an explicit pool is left alone
    cpu = DisaggregatedCluster("tiny-random", device="cpu")
    assert cpu.dtype == "float32" and cpu.placement.prefill == "cpu"


def test_vllm_side_configs_and_skip_reason():
    assert vllm_side.kv_transfer_config("kv_producer", "/s") == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/s"}}
    assert vllm_side.kv_transfer_config("kv_both", connector="NixlConnector") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="kv_producer"):
        vllm_side.kv_transfer_config("prefill")
    assert vllm_side.tp_kwargs(2)["tensor_parallel_size"] == 2
    import torch

    if torch.cuda.device_count() < 2:
        assert "needs 2 GPUs" in vllm_side.skip_reason()
        with pytest.raises(RuntimeError, match="needs 2 GPUs"):
            vllm_side.run_tp("/m", [[1, 2]], 2)
