"""`python -m lab_utils bench-kernel` and the board's kernel leaderboard: the saved kernel is checked and timed in
a child process (a correct one gets µs and a fraction of the bound, a wrong one its mistake, a hanging one a
timeout), one JSON line is printed and appended, and the board ranks the room's lines."""
from __future__ import annotations

import json

import pytest

from lab_utils.checks import bench_kernel
from lab_utils.kernels import triton_env
from lab_utils.workshop import board

triton, WHY = triton_env.load()
needs_triton = pytest.mark.skipif(triton is None, reason=WHY)
SMALL = {"batch": 2, "context": 40, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 8}


def correct_launcher(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    from lab_utils.engine.attention import paged_attention_reference

    lens = [int(c) for c in context_lens]
    tables = [row[:-(-c // block_size)].tolist() for row, c in zip(block_tables, lens)]
    return paged_attention_reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), block_size)


def unscaled_launcher(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    from lab_utils.engine.attention import paged_attention_reference

    lens = [int(c) for c in context_lens]
    tables = [row[:-(-c // block_size)].tolist() for row, c in zip(block_tables, lens)]
    return paged_attention_reference(q * q.shape[-1] ** 0.5, k_cache, v_cache, tables, lens, [1] * len(lens),
                                     block_size)


def hanging_launcher(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    import time

    while True:
        time.sleep(1)


def _save(tmp_path, monkeypatch, launcher):
    from lab_utils.course import learner_parts
    from lab_utils.kernels import learner_kernel

    folder = tmp_path / "my_engine"
    monkeypatch.setenv("LAB_LEARNER_DIR", str(folder))
    try:
        learner_kernel.save("kernel.paged_decode", launcher)
    finally:
        learner_parts.forget()
    return folder


@needs_triton
def test_a_correct_kernel_gets_a_time_and_a_fraction(tmp_path, monkeypatch, capsys):
    from lab_utils.__main__ import main

    folder = _save(tmp_path, monkeypatch, correct_launcher)
    args = ["bench-kernel", "--dir", str(folder), "--name", "ada", "--cases", "3", "--repeats", "1"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["correct"] is True and line["error"] is None and line["name"] == "ada"
    assert line["part"] == "kernel.paged_decode" and line["device"] == triton_env.device()
    assert line["us_per_call"] > 0 and 0 < line["fraction_of_bound"] <= 1 and line["shape"]["batch"] == 2
    saved = (tmp_path / bench_kernel.RESULTS_NAME).read_text().splitlines()
    assert json.loads(saved[-1]) == line


@needs_triton
def test_a_wrong_kernel_is_a_line_naming_its_mistake(tmp_path, monkeypatch):
    folder = _save(tmp_path, monkeypatch, unscaled_launcher)
    line = bench_kernel.run(folder, shape=SMALL, cases=4, repeats=1, name="bob")
    assert line["correct"] is False and line["us_per_call"] is None
    assert "kernel.paged_decode" in line["error"] and "AssertionError" in line["error"]


@needs_triton
def test_a_hanging_kernel_is_stopped(tmp_path, monkeypatch):
    folder = _save(tmp_path, monkeypatch, hanging_launcher)
    line = bench_kernel.run(folder, shape=SMALL, cases=1, repeats=1, timeout_s=15, name="cy")
    assert line["correct"] is False and "no result within 15 s" in line["error"]


def test_nothing_saved_and_bad_arguments(tmp_path):
    line = bench_kernel.run(tmp_path / "my_engine", shape=SMALL, cases=1, repeats=1, name="dee")
    assert line["correct"] is False
    assert ("no kernel.paged_decode in" in line["error"] and "check" in line["error"]) or \
        "needs triton" in line["error"]
    with pytest.raises(ValueError, match="not a kernel part"):
        bench_kernel.run(tmp_path, part="scheduler.schedule_continuous")
    with pytest.raises(ValueError, match="num-splits"):
        bench_kernel.run(tmp_path, part="kernel.paged_decode_split")
    with pytest.raises(ValueError, match="share"):
        bench_kernel.run(tmp_path, shape={"batch": 1, "context": 8, "q_heads": 3, "kv_heads": 2})


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


def test_the_board_ranks_the_rooms_kernels(tmp_path):
    base = {"part": "kernel.paged_decode", "device": "cuda", "shape": {"batch": 64, "context": 4096}}
    _write(tmp_path / "alice" / "student" / board.KERNEL_RESULTS, [
        {**base, "correct": True, "us_per_call": 90.0, "fraction_of_bound": 0.5, "time": 1},
        {**base, "correct": True, "us_per_call": 60.0, "fraction_of_bound": 0.75, "time": 2},
        {**base, "correct": False, "error": "AssertionError: tail", "time": 3},  # a later failure keeps her best
        '{"half a line',
    ])
    _write(tmp_path / "bob" / board.KERNEL_RESULTS, [
        {**base, "correct": True, "us_per_call": 70.0, "fraction_of_bound": 0.64, "time": 1, "name": "alice"}])
    _write(tmp_path / "cy" / board.KERNEL_RESULTS, [{**base, "correct": False, "error": "no result", "time": 1}])
    _write(tmp_path / ".hidden" / board.KERNEL_RESULTS, [{**base, "correct": True, "us_per_call": 1.0}])
    rows = board.kernel_ranking(str(tmp_path))
    assert [(r["learner"], r["rank"], r["us_per_call"]) for r in rows] == [
        ("alice", 1, 60.0), ("bob", 2, 70.0), ("cy", None, None)]  # the learner is the folder, not the line's name
    page = board.kernels_html(rows)
    assert page.index("alice") < page.index("bob") < page.index("cy") and "no result" in page and "0.75" in page
