"""Static batching pays for its finished members: they stay in the batch as padding rows until it ends."""
from __future__ import annotations

import pytest

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.model_runner import pad_decode_rows


def _run(model_tok, scheduler: str, lens: list[int], max_num_seqs: int = 4) -> LLMEngine:
    eng = LLMEngine(model_tok, EngineConfig(scheduler=scheduler, max_num_seqs=max_num_seqs), device="cpu")
    prompts = [[100 + 7 * i + j for j in range(5 + i)] for i in range(len(lens))]
    eng.outs = eng.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in lens])
    eng.block_manager.check_all_free()
    return eng


def test_static_decode_steps_run_the_whole_batch(tiny64):
    lens = [2, 9, 4, 1, 6, 3]  # batch 1 = first 4 (longest 9), batch 2 = last 2 (longest 6)
    eng = _run(tiny64, "static", lens)
    decode_steps = [s for s in eng.step_log if all(n == 1 for _, n in s["requests"])]
    assert decode_steps, "no decode step was logged"
    sizes = {len(s["requests"]) + s["num_padding"] for s in decode_steps}
    assert sizes == {4, 2}, f"static decode steps ran {sizes} rows; each batch should keep its full size"
    assert sum(s["num_padding"] for s in eng.step_log) > 0
    assert [len(o.token_ids) for o in eng.outs] == lens  # padding rows never extend an output


def test_padding_changes_no_token(tiny64):
    lens = [2, 9, 4, 1, 6, 3]
    static, cont = _run(tiny64, "static", lens), _run(tiny64, "continuous", lens)
    assert [o.token_ids for o in static.outs] == [o.token_ids for o in cont.outs]
    assert all(s.get("num_padding", 0) == 0 for s in cont.step_log)


def test_pad_decode_rows_copies_the_longest_context():
    out = pad_decode_rows([5, 6], [3, 9], [4, 10], [1, 1], [[0], [1]], [0, 1], 2)
    ids, pos, ctx, q, tables, last = out
    assert ids == [5, 6, 6, 6] and pos == [3, 9, 9, 9] and ctx == [4, 10, 10, 10]
    assert tables == [[0], [1], [1], [1]] and last == [0, 1, 2, 3] and q == [1] * 4
    # a speculative verify entry (several tokens): the padding row copies its last token, one token long
    ids, pos, ctx, q, tables, last = pad_decode_rows([5, 7, 8, 6], [8, 9, 10, 3], [11, 4], [3, 1], [[1], [0]],
                                                     [0, 1, 2, 3], 1)
    assert ids[-1] == 8 and pos[-1] == 10 and ctx[-1] == 11 and q == [3, 1, 1] and tables[-1] == [1] and last[-1] == 4
    with pytest.raises(ValueError, match="num_padding"):
        pad_decode_rows([5, 6], [3, 9], [4, 10], [1, 1], [[0], [1]], [0, 1], -1)
