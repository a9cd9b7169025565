"""Lab 04's pool sweep runs the learner's `evict`: a replay served one request at a time, in a pool with fewer
blocks than the replay's distinct named prefixes (the notebook's `named_prefixes`), has to evict; a pool that
holds every block of the replay never does (so the count is of real evictions, not of registration)."""
from __future__ import annotations

import functools
import random

import pytest

from lab_utils import LLMEngine, SamplingParams
from lab_utils.course import learner_parts
from lab_utils.checks.claims import parts_called
from lab_utils.checks.lab04 import CACHED_RUN_PARTS
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.course.parts import EngineParts

BS = 16


def _replay() -> list[list[int]]:
    """Three chats of two turns after a shared 100-token system prompt, as lab 04 replays them."""
    rng = random.Random(0)
    system = [rng.randrange(1, 200) for _ in range(100)]
    chats = [[[rng.randrange(1, 200) for _ in range(24)] for _ in range(2)] for _ in range(3)]
    return [system + sum(chat[:turn + 1], []) for turn in range(2) for chat in chats]


def _named_prefixes(requests: list[list[int]]) -> int:
    return len({tuple(p[:k * BS]) for p in requests for k in range(1, len(p) // BS + 1)})


def _parts() -> EngineParts:
    """The reference block-manager parts of lab 04, wrapped so the engine counts them as a learner's."""
    def wrap(name: str):
        ref = getattr(BlockManager, name.split(".")[1])

        @functools.wraps(ref)  # same signature, but a function of its own: a learner's
        def part(*args):
            return ref(*args)
        return part

    return EngineParts({name: wrap(name) for name in CACHED_RUN_PARTS})


def _serve(tiny64, parts: EngineParts, num_blocks: int, requests: list[list[int]]) -> int:
    before = parts.calls.copy()
    config = learner_parts.engine_config("04", enable_prefix_caching=True, block_size=BS, num_gpu_blocks=num_blocks,
                                   max_num_batched_tokens=512, seed=0)
    eng = LLMEngine(tiny64, config, device="cpu", parts=parts)
    for p in requests:  # one at a time, as the lab replays
        eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.block_manager.check_all_free()
    return (parts.calls - before)["block_manager.evict"]


@pytest.fixture(scope="module")
def requests() -> list[list[int]]:
    return _replay()


def test_a_pool_below_the_named_prefixes_evicts(tiny64, requests):
    longest = -(-(max(map(len, requests)) + 4) // BS)
    named = _named_prefixes(requests)
    assert longest < named  # the lab's smallest pool (1x the longest request) is below the bound
    parts = _parts()
    evicted = _serve(tiny64, parts, longest, requests)
    assert evicted > 0
    assert parts_called("the sweep", parts.calls, ["block_manager.evict"])[1]


def test_a_pool_that_holds_the_whole_replay_never_evicts(tiny64, requests):
    parts = _parts()
    assert _serve(tiny64, parts, 4 * _named_prefixes(requests), requests) == 0
    text, ok = parts_called("the sweep", parts.calls, ["block_manager.evict"])
    assert not ok and "never called: block_manager.evict" in text
