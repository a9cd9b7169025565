"""Where a returning turn's prompt came from: the device's prefix cache, the host tier, the shared store, or
recomputed. Counted from the host-tier trace (`returning.run_trace` rows) and from prefill workers sharing a
store (`route_to_other_worker`), so one picture can show every source side by side.

`route_to_other_worker` is lab 14's run of the shared store: turn t of a conversation goes to worker t % 2, so
every returning turn lands on the worker that did not serve the turn before; each turn runs on every pool (with
the store and without), alternating which goes first, so the load that comes and goes hits both alike.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lab_utils.kvstore.returning import TraceTurn, TurnRow

SOURCES = ("device", "host", "store", "recomputed")


@dataclass(frozen=True)
class TurnSources:
    """One returning turn's prompt tokens by source (they add up to its prompt)."""
    conversation: str
    turn: int
    device: int = 0
    host: int = 0
    store: int = 0
    recomputed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.device + self.host + self.store + self.recomputed


def from_trace(rows: Sequence[TurnRow]) -> list[TurnSources]:
    """The returning turns of a host-tier trace run (device, host, recomputed)."""
    return [TurnSources(r.conversation, r.turn, device=r.device_tokens, host=r.host_tokens,
                        recomputed=r.computed_tokens) for r in rows if r.turn > 0]


def totals(turns: Sequence[TurnSources]) -> dict[str, int]:
    """Prompt tokens by source, summed over `turns`."""
    return {s: sum(getattr(t, s) for t in turns) for s in SOURCES}


@dataclass
class RoutedTurn:
    """One turn as every pool ran it on the same worker: each pool's answer (`PrefillWorkers.prefill`), the
    order the pools ran in, and the blocks this turn read from the store in each pool."""
    conversation: str
    turn: int
    worker: int
    prompt_tokens: int
    answers: dict[str, dict] = field(default_factory=dict)
    order: tuple[str, ...] = ()
    store_blocks: dict[str, int] = field(default_factory=dict)

    def sources(self, pool: str, block_size: int) -> TurnSources:
        """Where this turn's prompt came from in `pool`: what the store supplied (its blocks, at most what was
        found cached), the rest of the cached tokens from the worker's own device, the remainder recomputed."""
        a = self.answers[pool]
        cached = a["num_cached_tokens"]
        store = min(self.store_blocks.get(pool, 0) * block_size, cached)
        return TurnSources(self.conversation, self.turn, device=cached - store, store=store,
                           recomputed=a["prompt_tokens"] - cached)


def route_to_other_worker(pools: Mapping[str, object], trace: Sequence[TraceTurn], workers: int = 2,
                          progress=None) -> list[RoutedTurn]:
    """Run `trace` on every pool, turn t of a conversation on worker t % `workers` (a returning turn never lands
    where the turn before it ran); the pools take turns going first. `pools` are `PrefillWorkers` (or anything
    with their `prefill(worker, token_ids) -> dict`)."""
    last_blocks: dict[tuple[str, int], int] = {}  # (pool, worker) -> the worker's blocks read from the store so far
    out = []
    names = list(pools)
    for i, t in enumerate((progress or (lambda x: x))(trace)):
        worker = t.turn % workers
        order = tuple(names if i % 2 == 0 else reversed(names))
        row = RoutedTurn(t.conversation, t.turn, worker, len(t.prompt), order=order)
        for name in order:
            a = pools[name].prefill(worker, list(t.prompt))
            row.answers[name] = a
            seen = a.get("blocks_from_store", 0)
            row.store_blocks[name] = seen - last_blocks.get((name, worker), 0)
            last_blocks[(name, worker)] = seen
        out.append(row)
    return out


def returning_turns(rows: Sequence[RoutedTurn]) -> list[RoutedTurn]:
    """The turns after a conversation's first: each ran on the worker that did not serve the turn before it."""
    return [r for r in rows if r.turn > 0]


def store_traffic(rows: Sequence[RoutedTurn], pool: str) -> dict[str, float]:
    """Bytes read from and written to the store, and seconds spent in store calls, over all of `pool`'s workers
    (each worker's counters are cumulative: its last answer holds its total)."""
    last: dict[int, dict] = {}
    for r in rows:
        last[r.worker] = r.answers[pool]
    keys = ("store_bytes_in", "store_bytes_out", "store_seconds")
    return {k: sum(a.get(k, 0) for a in last.values()) for k in keys}


def leaks(rows: Sequence[RoutedTurn]) -> dict[str, str]:
    """{'<pool> worker <w>': the first leak a worker reported after a turn, or ''}, for every pool and worker."""
    out: dict[str, str] = {}
    for r in rows:
        for pool, a in r.answers.items():
            key = f"{pool} worker {r.worker}"
            out[key] = out.get(key) or a.get("leaked", "no leak report")
    return out


def summarise(rows: Sequence[RoutedTurn], block_size: int, shared: str = "store", apart: str = "apart") -> dict:
    """What lab 14's store claims read from a routed run: the prompt tokens the returning turns computed in
    each pool, the tokens they read from the store, every turn's first token per pool, each worker's leak
    report, and the returning turns' prefill time without / with the store, turn by turn."""
    ret = returning_turns(rows)
    return {
        "store_computed": {p: sum(r.sources(p, block_size).recomputed for r in ret) for p in (shared, apart)},
        "store_read": sum(r.sources(shared, block_size).store for r in ret),
        "store_first_tokens": {p: [r.answers[p]["first_token"] for r in rows] for p in (shared, apart)},
        "store_leaks": leaks(rows),
        "store_ratios": [r.answers[apart]["seconds"] / r.answers[shared]["seconds"] for r in ret],
    }
