"""The seam for the learner's code: parts plug into the real engine, wrong parts fail with named messages,
saved parts carry into later labs."""
from __future__ import annotations

import pytest

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.course import learner_parts
from lab_utils.checks import parts_check
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.course.parts import PARTS, EngineParts, LearnerPartError
from lab_utils.engine.request import Status
from lab_utils.engine.scheduler import SchedulerOutput


def reference(name: str):
    return PARTS[name].reference()


CORE = [n for n in PARTS if PARTS[n].lab <= "04"]  # the parts check_part knows (labs 01-04)


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    learner_parts.forget()
    yield tmp_path / "my_engine"
    learner_parts.forget()


@pytest.mark.parametrize("name", CORE)
def test_the_reference_passes_its_own_check(name):
    assert parts_check.check_part(name, reference(name), trials=40) >= 10  # cases with something to call it on


# -- wrong parts, each caught with a message that names the mistake ------------------------------------------
def no_retire(self):
    out = SchedulerOutput()
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            break
        out.scheduled.append((req, self.start(req, n)))
        budget -= n
    if not out.scheduled:
        for req in list(self.running):
            if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
                out.scheduled.append((req, 1))
    return out


def skips_the_head(self):
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    for req in list(self.waiting)[1:2] + list(self.waiting)[:1]:
        n = req.num_tokens - req.num_computed_tokens
        if len(self.running) < self.config.max_num_seqs and self.can_start(req, n):
            self.waiting.remove(req)
            self.waiting.appendleft(req)
            out.scheduled.append((req, self.start(req, n)))
    if not out.scheduled:
        for req in list(self.running):
            if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
                out.scheduled.append((req, 1))
    return out


def grow_takes_first(self, req, num_tokens):
    for _ in range(self.blocks_needed(num_tokens) - len(req.block_table)):
        if not self.num_free_blocks:
            return False
        req.block_table.append(self.take_block())
    return True


def release_ignores_count(self, block_id):
    self.blocks[block_id].ref_count = 0
    self.recycle(block_id)


def preempts_the_oldest(self, req, num_tokens, out):
    while not self.bm.grow(req, num_tokens):
        victim = self.running[0]
        self.preempt(victim)
        out.preempted.append(victim)
        if victim is req:
            return False
    return True


def slots_off_by_one(block_tables, context_lens, query_lens, block_size):
    return [t[p // block_size] * block_size + p % block_size
            for t, c, q in zip(block_tables, context_lens, query_lens) for p in range(c - q + 1, c + 1)
            if p // block_size < len(t)] or [0]


def hash_without_parent(self, parent_hash, token_ids):
    return hash(token_ids)


def stops_on_eos_always(req, token, eos_ids, max_model_len):
    if token in eos_ids or token in req.params.stop_token_ids:
        return "stop"
    return "length" if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len else None


def counts_all_tokens(req, token, eos_ids, max_model_len):
    if (token in eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
        return "stop"
    return "length" if req.num_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len else None


def evict_newest(self):
    bid, _ = self.evictable.popitem(last=True)
    blk = self.blocks[bid]
    self.hash_to_block.pop(blk.hash, None)
    blk.hash, blk.token_ids = None, ()
    return bid


@pytest.mark.parametrize("name, wrong, words", [
    ("scheduler.schedule_continuous", no_retire, "retire"),
    ("scheduler.schedule_continuous", skips_the_head, "schedule_continuous"),
    ("block_manager.grow", grow_takes_first, "change nothing"),
    ("block_manager.release", release_ignores_count, "last reference"),
    ("scheduler.make_room", preempts_the_oldest, "newest"),
    ("attention.slot_mapping", slots_off_by_one, "slot"),
    ("block_manager.evict", evict_newest, "least recently used"),
    ("engine.stop_reason", stops_on_eos_always, "ignore_eos"),
    ("engine.stop_reason", counts_all_tokens, "output tokens only"),
])
def test_a_wrong_part_fails_its_check_with_a_named_message(name, wrong, words):
    with pytest.raises(AssertionError, match=words):
        parts_check.check_part(name, wrong, trials=150)


def test_a_hash_without_its_parent_gives_wrong_tokens_in_the_engine():
    parts = EngineParts({"block_manager.hash_block": hash_without_parent})
    with pytest.raises(AssertionError, match="different tokens|hash"):
        parts_check.check_part("block_manager.hash_block", hash_without_parent, trials=50)
    with pytest.raises(AssertionError, match="different tokens"):
        parts_check.check_in_engine(parts, "04", num_requests=16)


def test_the_engine_runs_the_learners_part(tiny64):
    calls = []

    def counting_grow(self, req, num_tokens):
        calls.append(num_tokens)
        return BlockManager.grow(self, req, num_tokens)

    eng = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=64, block_size=4), device="cpu",
                    parts=EngineParts({"block_manager.grow": counting_grow}))
    out = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert calls and len(out.token_ids) == 6
    assert type(eng.block_manager).__name__ == "LearnerBlockManager" and eng.parts.is_learners("block_manager.grow")


def test_a_broken_part_stops_the_engine_with_the_parts_name_not_a_deep_traceback(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=1, num_gpu_blocks=64, block_size=4),
                    device="cpu", parts=EngineParts({"scheduler.schedule_continuous": no_retire}))
    with pytest.raises(LearnerPartError, match="retire finished requests"):
        eng.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=3, ignore_eos=True))

    def crashes(self, block_id):
        raise IndexError("oops")

    eng = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=64, block_size=4), device="cpu",
                    parts=EngineParts({"block_manager.release": crashes}))
    with pytest.raises(LearnerPartError, match=r"your block_manager.release raised IndexError: oops"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))


def test_a_leaking_release_is_caught_in_the_engine():
    def never_frees(self, block_id):
        self.blocks[block_id].ref_count -= 1

    with pytest.raises(AssertionError, match="leaked|never finished|stopped"):
        parts_check.check_in_engine(EngineParts({"block_manager.release": never_frees}), "02", num_requests=12)


def test_wrong_signature_is_refused():
    with pytest.raises(TypeError, match="takes 1 parameter"):
        EngineParts({"block_manager.grow": lambda self: True})
    with pytest.raises(KeyError, match="unknown engine part"):
        EngineParts({"block_manager.allocate": lambda self, r, n: True})


def test_saved_parts_carry_into_a_later_lab_and_missing_ones_fall_back(learner_dir, capsys):
    learner_parts.submit("scheduler.schedule_continuous", reference("scheduler.schedule_continuous"))
    assert (learner_dir / "scheduler.py").exists()
    learner_parts.forget()  # a new kernel: only the file is left
    parts = learner_parts.parts(upto="02")
    printed = capsys.readouterr().out
    assert parts.is_learners("scheduler.schedule_continuous") and not parts.is_learners("block_manager.grow")
    assert "my_engine/scheduler.py" in printed and "you have not written it yet" in printed
    # the saved function is a real one the engine can run
    summary = parts_check.check_in_engine(parts, "01", num_requests=8)
    assert summary["tokens_equal"]


def test_engine_config_grows_with_the_labs():
    c1, c2, c3, c4 = (learner_parts.engine_config(lab) for lab in ("01", "02", "03", "04"))
    assert (c1.kv_layout, c1.scheduler, c1.enable_chunked_prefill, c1.enable_prefix_caching) == \
        ("contiguous", "continuous", False, False)
    assert (c2.kv_layout, c2.scheduler) == ("paged", "continuous")
    assert (c3.scheduler, c3.enable_chunked_prefill, c3.enable_prefix_caching) == ("token_budget", True, False)
    assert c4.enable_prefix_caching and learner_parts.engine_config("07").enable_prefix_caching
    assert learner_parts.engine_config("01", max_num_seqs=3).max_num_seqs == 3


def test_the_engines_version_is_shown_only_after_the_learners_passed(capsys):
    learner_parts.show_reference("block_manager.grow")
    assert "once yours has passed its check" in capsys.readouterr().out
    learner_parts.submit("block_manager.grow", reference("block_manager.grow"))
    learner_parts.show_reference("block_manager.grow")
    shown = capsys.readouterr().out
    assert "The engine's own `grow`" in shown and "take_block()" in shown


def test_the_slot_mapping_runs_in_its_own_lab_only(capsys):
    learner_parts.submit("attention.slot_mapping", reference("attention.slot_mapping"))
    learner_parts.submit("block_manager.grow", reference("block_manager.grow"))
    assert learner_parts.parts(upto="02").is_learners("attention.slot_mapping")
    later = learner_parts.parts(upto="03")
    assert not later.is_learners("attention.slot_mapping") and later.is_learners("block_manager.grow")
    assert "later labs use the engine's fast version" in capsys.readouterr().out


def test_an_engine_stuck_by_a_leaking_release_names_the_part_its_lab_and_its_file(tiny64):
    def never_frees(self, block_id):
        self.blocks[block_id].ref_count -= 1    # forgets to hand the block back at zero

    parts = EngineParts({"block_manager.release": never_frees},
                        {"block_manager.release": "yours (my_engine/block_manager.py)"})
    eng = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=8, block_size=4, max_num_seqs=2), device="cpu", parts=parts)
    with pytest.raises(LearnerPartError, match=r"no progress.*block_manager.release \(lab 02, yours "
                                               r"\(my_engine/block_manager.py\)\)"):
        eng.generate([[1, 2, 3, 4, 5]] * 6, SamplingParams(max_tokens=6, ignore_eos=True))
