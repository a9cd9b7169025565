"""Routing across replicas: send a returning conversation to the engine that still holds its prefix.

A service runs several engines (replicas) behind a router. Round-robin spreads requests evenly but sends a
conversation's next turn wherever the counter points, usually not where its history's KV sits, so that engine
computes the whole history again. A prefix-aware router keeps its own index of which blocks it has sent to which
replica and sends a request to the replica with the longest cached prefix:

- **SGLang's router** (`sglang-router`, policy `cache_aware`, its default) keeps an *approximate* radix tree per
  worker built from the requests it routed (it never sees the workers' evictions); a request whose best match covers
  at least `--cache-threshold` of it (default 0.5) goes to that worker, any other to the worker with the smallest
  tree (the most free cache), and when the workers' loads are far apart it balances by load instead.
- **NVIDIA Dynamo's KV router** builds an *exact* index from the KV events its workers publish (blocks stored and
  removed) and scores each worker by its overlap against its load.

`PrefixAware` here is SGLang's rule at its smallest: per replica an index of block names bounded by that replica's
pool (least recently routed dropped first: the router's guess of what the engine evicted), a match threshold, the
smallest index for the rest; no load term, since `run` sends one request at a time. `RoundRobin` is the baseline.
`run` sends a trace through a router, one turn at a time, and records per turn which replica served it, how many of
its prompt tokens the router expected cached and how many the engine found (`num_cached_tokens`), so the index's
guesses are checked against the engines' own counts.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from lab_utils.kvstore.returning import TraceTurn
from lab_utils.kvstore.tier import stable_names


class RoundRobin:
    """Request i goes to replica i mod n, whatever it carries."""
    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas, self._next = num_replicas, 0

    def choose(self, prompt: Sequence[int]) -> tuple[int, int]:
        """(replica, prompt tokens the router expects cached there: unknown to round-robin, so 0)."""
        replica, self._next = self._next, (self._next + 1) % self.num_replicas
        return replica, 0

    def record(self, replica: int, prompt: Sequence[int]) -> None:
        """Round-robin keeps no index."""


class PrefixAware:
    """Longest cached prefix wins when it covers at least `threshold` of the prompt; otherwise the replica whose
    index is smallest. Each replica's index holds at most `capacity_blocks` block names (its pool's size)."""
    name = "prefix-aware"

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, threshold: float = 0.5) -> None:
        if num_replicas < 1 or block_size < 1 or capacity_blocks < 1:
            raise ValueError(f"num_replicas, block_size and capacity_blocks must be >= 1, got {num_replicas}, "
                             f"{block_size}, {capacity_blocks}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is a share of the prompt in [0, 1], got {threshold}")
        self.num_replicas, self.block_size = num_replicas, block_size
        self.capacity_blocks, self.threshold = capacity_blocks, threshold
        self.index: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def matched_blocks(self, replica: int, names: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks the router believes `replica` holds."""
        n = 0
        for name in names:
            if name not in self.index[replica]:
                break
            n += 1
        return n

    def choose(self, prompt: Sequence[int]) -> tuple[int, int]:
        names = stable_names(list(prompt), self.block_size)
        matches = [self.matched_blocks(r, names) for r in range(self.num_replicas)]
        best = max(range(self.num_replicas), key=lambda r: (matches[r], -r))
        expected = matches[best] * self.block_size
        if matches[best] and expected >= self.threshold * len(prompt):
            return best, expected
        emptiest = min(range(self.num_replicas), key=lambda r: (len(self.index[r]), r))
        return emptiest, matches[emptiest] * self.block_size

    def record(self, replica: int, prompt: Sequence[int]) -> None:
        """The replica now holds the prompt's full blocks: most recent last, the oldest dropped beyond capacity."""
        index = self.index[replica]
        for name in stable_names(list(prompt), self.block_size):
            index[name] = None
            index.move_to_end(name)
        while len(index) > self.capacity_blocks:
            index.popitem(last=False)


@dataclass
class RoutedTurn:
    """One turn as a router sent it: the replica, the prompt tokens it expected cached there, what the engine found
    cached, the time to first token and the output."""
    conversation: str
    turn: int
    replica: int
    prompt_tokens: int
    expected_cached: int
    cached_tokens: int
    ttft_s: float
    token_ids: list[int] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _check(engines: Sequence, router) -> None:
    if len(engines) != router.num_replicas:
        raise ValueError(f"{len(engines)} engines for a router over {router.num_replicas} replicas")


def _send(engines: Sequence, turn: TraceTurn, params, router) -> RoutedTurn:
    replica, expected = router.choose(turn.prompt)
    out = engines[replica].generate([list(turn.prompt)], params)[0]
    router.record(replica, turn.prompt)
    return RoutedTurn(turn.conversation, turn.turn, replica, len(turn.prompt), expected, out.num_cached_tokens,
                      out.metrics.ttft, list(out.token_ids))


def run(engines: Sequence, trace: Sequence[TraceTurn], params, router) -> list[RoutedTurn]:
    """Every turn of `trace`, one at a time, on the replica `router` chooses (each replica an `LLMEngine`)."""
    _check(engines, router)
    return [_send(engines, t, params, router) for t in trace]


def run_side_by_side(setups: dict, trace: Sequence[TraceTurn], params, progress=None) -> dict[str, list[RoutedTurn]]:
    """`setups` {name: (engines, router)}: every turn through each setup in turn, the setups taking turns to go
    first, so load that comes and goes on the machine hits them alike."""
    for engines, router in setups.values():
        _check(engines, router)
    rows: dict[str, list[RoutedTurn]] = {name: [] for name in setups}
    names = list(setups)
    turns = progress(trace, desc="turns") if progress else trace
    for i, t in enumerate(turns):
        for name in names[i % len(names):] + names[:i % len(names)]:
            engines, router = setups[name]
            rows[name].append(_send(engines, t, params, router))
    return rows


def summary(rows: Sequence[RoutedTurn]) -> dict:
    """Returning turns (turn > 0): prompt tokens computed and cached, how often the router's expectation was the
    engine's count, and each replica's share of the turns."""
    back = [r for r in rows if r.turn > 0]
    per_replica: dict[int, int] = {}
    for r in rows:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    return {"returning_turns": len(back), "computed": sum(r.computed_tokens for r in back),
            "cached": sum(r.cached_tokens for r in back), "prompt_tokens": sum(r.prompt_tokens for r in back),
            "expected_right": sum(r.expected_cached <= r.cached_tokens for r in back),
            "turns_per_replica": dict(sorted(per_replica.items()))}
