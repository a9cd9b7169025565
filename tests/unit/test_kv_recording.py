"""`run_recording` (lab 02's KV pool over time) counts every engine step, the last one included."""
from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.kv.memory import run_recording


def test_steps_count_every_engine_step_and_records_the_resident_ones(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(max_num_seqs=4, block_size=4, kv_cache_memory_bytes=1 << 20), device="cpu")
    prompts = [[5 + i] * (3 + 2 * i) for i in range(5)]
    run = run_recording(eng, prompts, [SamplingParams(max_tokens=4 + i, ignore_eos=True) for i in range(5)])
    assert run.steps == eng.num_steps > 0
    assert len(run.records) == run.steps - 1  # the last step leaves nothing resident to record
    assert [len(o.token_ids) for o in run.outputs] == [4, 5, 6, 7, 8]
