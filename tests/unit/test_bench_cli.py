"""`python -m lab_utils bench` and `generate` end to end on the tiny model, via `main([...])`."""
from __future__ import annotations

import json

import pytest

from lab_utils.__main__ import main

KEYS = ["backend", "model", "output_throughput", "request_throughput", "total_token_throughput", "request_goodput",
        "duration", "completed", "total_input_tokens", "total_output_tokens"] + [
    f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")]


@pytest.mark.parametrize("backend, extra", [
    ("lab", ["--scheduler", "continuous", "--no-enable-prefix-caching", "--block-size", "8",
             "--max-num-batched-tokens", "64", "--kv-cache-dtype", "auto", "--enforce-eager"]),
    ("hf", []),
])
def test_bench_writes_every_key(tmp_path, capsys, backend, extra):
    out, wl = tmp_path / "r.json", tmp_path / "wl.json"
    argv = ["bench", "--backend", backend, "--model", "tiny-random", "--device", "cpu", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "4", "--length-dist", "longtail", "--request-rate", "inf",
            "--max-num-seqs", "2", "--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000", "--seed", "1",
            "--workload", str(wl), "--json", str(out)] + extra
    assert main(argv) == 0
    res = json.loads(out.read_text())
    missing = [k for k in KEYS if k not in res]
    assert not missing, missing
    assert res["backend"] == backend and res["model"] == "tiny-random" and res["completed"] == 4
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["workload"]["length_dist"] == "longtail" and res["workload"]["request_rate"] == "inf"
    assert res["total_output_tokens"] == sum(json.loads(wl.read_text())["requests"][i]["output_len"] for i in range(4))
    if backend == "lab":
        assert res["config"]["scheduler"] == "continuous" and res["config"]["enable_prefix_caching"] is False
        assert res["config"]["block_size"] == 8
    else:
        assert res["config"]["batch_size"] == 2
    text = capsys.readouterr().out
    assert "output tok/s" in text and "wrote" in text
    # a second run reads the saved workload back (same prompts, by hash)
    assert main(argv) == 0
    assert json.loads(out.read_text())["workload"]["sha256"] == res["workload"]["sha256"]
    assert main(["bench", "--compare", str(out), str(out)]) == 0


def test_bench_rejects_bad_values(capsys):
    assert main(["bench", "--backend", "lab", "--model", "tiny-random", "--device", "cpu", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--request-rate", "0"])


def test_generate(capsys):
    assert main(["generate", "--model", "tiny-random", "--device", "cpu", "--prompt", "Hello there",
                 "--prompt", "To be", "--max-tokens", "3", "--ignore-eos", "--scheduler", "static"]) == 0
    out = capsys.readouterr().out
    assert out.count("[3 tokens, finish=length") == 2 and "'To be'" in out


def test_engine_flags_map_to_engine_config():
    import argparse

    from lab_utils.engine.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args([
        "--max-num-seqs", "3", "--max-num-batched-tokens", "128", "--block-size", "8", "--no-enable-prefix-caching",
        "--kv-cache-dtype", "fp8", "--enforce-eager", "--scheduler", "static",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (3, 128, 8)
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_dtype == "fp8" and cfg.enforce_eager is True
    assert cfg.scheduler == "static" and cfg.speculative.num_speculative_tokens == 2
    default = engine_config_from_args(p.parse_args([]))
    assert default.enable_prefix_caching is True and default.scheduler == "token_budget"
