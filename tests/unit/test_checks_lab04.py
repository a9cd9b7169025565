"""Lab 04's checks accept the engine's prefix-cache parts and reject each common mistake with a named message."""
from __future__ import annotations

import pytest

from lab_utils.course import learner_parts
from lab_utils.checks import lab04
from lab_utils.engine.kv.block_manager import BlockManager


# correct versions, written independently of the engine's
def hash_block(self, parent_hash, token_ids):
    return hash((parent_hash, token_ids))


def match_prefix(self, req, *, whole_prompt=False, guard=True):
    if not self.enable_prefix_caching:
        return []
    found, name, bs = [], None, self.block_size
    n = req.num_prompt_tokens if whole_prompt else req.num_prompt_tokens - 1
    for i in range(n // bs):
        ids = tuple(req.prompt_token_ids[i * bs:(i + 1) * bs])
        name = self.hash_block(name, ids)
        bid = self.hash_to_block.get(name)
        if bid is None or (guard and self.blocks[bid].token_ids != ids):
            break
        found.append(bid)
    return found


def recycle(self, block_id, *, keep_cached=True, check_owner=True):
    blk = self.blocks[block_id]
    if keep_cached and blk.hash is not None and (not check_owner or self.hash_to_block.get(blk.hash) == block_id):
        self.evictable[block_id] = None
    else:
        blk.hash, blk.token_ids = None, ()
        self.free_ids.append(block_id)


def evict(self, *, oldest=True, forget=True):
    block_id, _ = self.evictable.popitem(last=not oldest)
    blk = self.blocks[block_id]
    if forget:
        self.hash_to_block.pop(blk.hash, None)
        blk.hash, blk.token_ids = None, ()
    return block_id


CHECKS = {"hash_block": (lab04.check_hash_block, hash_block), "match_prefix": (lab04.check_match_prefix, match_prefix),
          "recycle": (lab04.check_recycle, recycle), "evict": (lab04.check_evict, evict)}


@pytest.mark.parametrize("part", list(CHECKS))
def test_accepts_the_reference_and_a_correct_version(part, capsys):
    check, mine = CHECKS[part]
    check(getattr(BlockManager, part), submit=False)
    check(mine, trials=60, seed=5, submit=False)
    assert capsys.readouterr().out.count("random cases agree with the reference") == 2


def test_submit_makes_them_the_engines_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    try:
        for check, mine in CHECKS.values():
            check(mine, trials=10)
        parts = learner_parts.parts(upto="04", quiet=True)
        assert all(parts.is_learners(f"block_manager.{p}") for p in CHECKS)
        assert "def recycle(" in (tmp_path / "block_manager.py").read_text()
    finally:
        learner_parts.forget()


@pytest.mark.parametrize("check, bad, message", [
    (lab04.check_hash_block, lambda self, parent, ids: hash(ids), "does not depend on parent_hash"),
    (lab04.check_hash_block, lambda self, parent, ids: hash((ids, parent)), "hash\\(\\(parent_hash, token_ids\\)\\)"),
    (lab04.check_match_prefix, lambda self, req: match_prefix(self, req, whole_prompt=True),
     "leave at least one prompt token"),
    (lab04.check_match_prefix, lambda self, req: match_prefix(self, req, guard=False), "compare the cached block"),
    (lab04.check_match_prefix, lambda self, req: [], "walk the prompt's full blocks"),
    (lab04.check_recycle, lambda self, bid: recycle(self, bid, keep_cached=False), "stays cached"),
    (lab04.check_recycle, lambda self, bid: recycle(self, bid, check_owner=False), "a duplicate"),
    (lab04.check_evict, lambda self: evict(self, oldest=False), "another block than the least recently used"),
    (lab04.check_evict, lambda self: evict(self, forget=False), "must forget its name"),
])
def test_rejects_mistakes(check, bad, message):
    with pytest.raises(AssertionError, match=message):
        check(bad, submit=False)


@pytest.mark.parametrize("part", list(CHECKS))
def test_not_implemented_propagates(part):
    check, mine = CHECKS[part]

    def todo(*args):
        raise NotImplementedError("hint")

    todo.__signature__ = __import__("inspect").signature(mine)
    with pytest.raises(NotImplementedError):
        check(todo, submit=False)


# --- negative controls for the lab's closing claims ------------------------------------------------------------
def _run() -> dict:
    return dict(hit_rate=0.82, mean_ttft_off_ms=120.0, mean_ttft_on_ms=40.0, ttft_cut_predicted=0.7, replay_s_off=9.0,
                replay_s_on=6.0, hit_rate_by_pool={12: 0.3, 24: 0.6, 48: 0.82}, replies_identical=18, replies=18,
                calls={name: 30 for name in lab04.CACHED_RUN_PARTS})


def test_claims_pass_on_a_good_run(capsys):
    lab04.assert_claims(_run())
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("key, value, message", [
    ("hit_rate", 0.2, "hit rate 0.20 >= 0.5"),
    ("mean_ttft_on_ms", 100.0, "TTFT reduced"),
    ("mean_ttft_on_ms", 90.0, "TTFT reduced"),  # 25%: below 30% where prefill is compute-bound
    ("replay_s_on", 9.5, "finishes faster"),
    ("hit_rate_by_pool", {12: 0.82, 48: 0.82}, "memory pressure evicts"),
    ("replies_identical", 17, "changes no reply"),
    ("replies", 0, "changes no reply"),
    ("calls", {**{name: 30 for name in lab04.CACHED_RUN_PARTS}, "block_manager.evict": 0},
     "never called: block_manager.evict"),  # registered, but the runs never evicted
    ("calls", {}, "never called: block_manager.hash_block"),
])
def test_each_claim_can_fail(key, value, message):
    r = _run()
    r[key] = value
    if key == "replies":
        r["replies_identical"] = 0
    with pytest.raises(AssertionError, match=message):
        lab04.assert_claims(r, show=False)


def test_ttft_claims_follow_the_device():
    """A launch-bound GPU: a hit saves ~3% of TTFT, measured 1% (noise): passes; the CPU's fixed 30% would fail it.
    A compute-bound device whose costs predict 70% must show it."""
    gpu = _run() | dict(mean_ttft_off_ms=6.0, mean_ttft_on_ms=5.94, ttft_cut_predicted=0.03, replay_s_on=9.1)
    text = {t: ok for t, ok in lab04.claims(gpu)}
    assert all(text.values()), [t for t, ok in text.items() if not ok]
    assert any("no slower" in t for t in text)
    for bad in (dict(mean_ttft_on_ms=8.0), dict(replay_s_on=9.6)):  # slower with caching: fails even there
        with pytest.raises(AssertionError):
            lab04.assert_claims(gpu | bad, show=False)
    with pytest.raises(AssertionError, match="TTFT reduced by 40%"):  # 90% predicted, 40% measured (< 0.6 x 90 - 5)
        lab04.assert_claims(_run() | dict(mean_ttft_on_ms=72.0, ttft_cut_predicted=0.9), show=False)


def _commits_partial(self, req):
    """Names the partly filled last block too (rounds up)."""
    B, parent = self.block_size, None
    for i in range(min(-(-req.num_computed_tokens // B), len(req.block_table))):
        ids = tuple(req.token_ids[i * B:(i + 1) * B])
        parent = self.hash_block(parent, ids)
        block = self.blocks[req.block_table[i]]
        if block.hash is None:
            block.hash, block.token_ids = parent, ids
            self.hash_to_block.setdefault(parent, block.block_id)


def test_check_commit_full_blocks_rejects_a_partial_block_and_accepts_the_reference(tmp_path, monkeypatch):
    from lab_utils.engine.kv.block_manager import BlockManager

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="only blocks whose tokens are all computed"):
        lab04.check_commit_full_blocks(_commits_partial)
    lab04.check_commit_full_blocks(BlockManager.commit_full_blocks)


def _names_the_prompt_by_its_ids(self, req):
    """Walks req.prompt_token_ids: every block past the prompt (filled by output tokens) stays unnamed."""
    B, parent = self.block_size, None
    if not self.enable_prefix_caching:
        return
    ids_all = req.prompt_token_ids[:min(req.num_computed_tokens, req.num_tokens)]
    for i in range(len(ids_all) // B):
        ids = tuple(ids_all[i * B:(i + 1) * B])
        parent = self.hash_block(parent, ids)
        block = self.blocks[req.block_table[i]]
        if block.hash is None:
            block.hash, block.token_ids = parent, ids
            self.hash_to_block.setdefault(parent, block.block_id)


def test_commit_that_leaves_output_blocks_unnamed_is_told_so(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from mistake_catalogue import commit_last_block_only, commit_prompt_blocks_only

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    for wrong in (commit_prompt_blocks_only, _names_the_prompt_by_its_ids):
        with pytest.raises(AssertionError) as err:
            lab04.check_commit_full_blocks(wrong)
        assert getattr(err.value, "diagnosis", None) == "commit_output_blocks", str(err.value)
        assert "block_manager.commit_full_blocks (lab 04, my_engine/block_manager.py)" in str(err.value)
    with pytest.raises(AssertionError) as err:  # another mistake: this cause stays silent
        lab04.check_commit_full_blocks(commit_last_block_only)
    assert getattr(err.value, "diagnosis", None) == "commit_every_block" and "all hold output tokens" not in str(err.value)
