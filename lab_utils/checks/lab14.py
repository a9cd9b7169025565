"""Lab 14 checks: the host tier's lookup-and-promote step (`block_manager.promote`), and the lab's claims (the
host tier's, then the shared store's).

`check_promote(fn)` builds small random device pools with a host tier under them (the K/V of a block is its
token ids, so a wrong copy shows), walks a prompt's prefix as `match_prefix` does up to the first block the
device misses, and calls the reference and `fn` on identical copies. It compares what they return and everything
they may touch: the pool (free list, LRU order, names, reference counts), the block's K/V, the tier's entries,
counters and its policy's order. A difference is explained by the usual mistake whose evidence it shows (a
collision taken as a hit, a prefix block evicted to make room, a copy left in the tier, a hit the policy never
heard of, room made before the entry was taken, a block that is not cached afterwards), never by the solution.
"""
from __future__ import annotations

import copy
import random
import types
from collections.abc import Callable, Mapping

import torch

from lab_utils.checks.claims import Claim, need, parts_called, report
from lab_utils.checks.timing import judge, judge_error
from lab_utils.course.parts import LearnerPartError, check_signature
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.kv.host_tier import Entry, HostTier, LRUPolicy, TwoQueuePolicy

PART = "block_manager.promote"


def _where() -> str:
    """'block_manager.promote (lab 14, my_engine/block_manager.py)', as `parts_check.where` words it (the generic
    grader calls this module's `promote_cases`, so this module does not call the grader back)."""
    from lab_utils.course.learner_parts import learner_dir
    from lab_utils.course.parts import PARTS

    return f"{PART} (lab {PARTS[PART].lab}, {learner_dir().name}/{PARTS[PART].component}.py)"


# -- random pools with a host tier ---------------------------------------------------------------------------
class Pool:
    """A block manager with a host tier over a fake device cache: `kv[b]` is block b's K/V, here its token ids."""

    def __init__(self, num_blocks: int, block_size: int, tier_entries: int, policy: str) -> None:
        self.kv = torch.zeros(num_blocks, block_size)
        self.tier = HostTier(tier_entries * block_size * 4, self.copy_out, self.copy_in,
                             LRUPolicy() if policy == "lru" else TwoQueuePolicy())
        self.bm = BlockManager(num_blocks, block_size, True, 0.0, self.tier)

    def copy_out(self, bid: int) -> dict[str, torch.Tensor]:
        return {"kv": self.kv[bid].clone()}

    def copy_in(self, bid: int, saved: dict[str, torch.Tensor]) -> None:
        self.kv[bid].copy_(saved["kv"])

    def put_device(self, name: int, ids: tuple[int, ...], ref_count: int) -> int:
        bid = self.bm.free_ids.pop()
        blk = self.bm.blocks[bid]
        blk.hash, blk.token_ids, blk.ref_count = name, ids, ref_count
        self.bm.hash_to_block[name] = bid
        self.kv[bid] = torch.tensor(ids, dtype=torch.float32)
        if ref_count == 0:
            self.bm.evictable[bid] = None
        return bid

    def put_tier(self, name: int, ids: tuple[int, ...]) -> None:
        saved = {"kv": torch.tensor(ids, dtype=torch.float32)}
        nbytes = saved["kv"].nbytes
        if self.tier.bytes_used + nbytes > self.tier.capacity_bytes:
            return
        self.tier.entries[name] = Entry(ids, saved, nbytes)
        self.tier.bytes_used += nbytes
        self.tier.policy.inserted(name)


def _policy_order(policy) -> list:
    if isinstance(policy, TwoQueuePolicy):
        return [("probation", list(policy.probation)), ("protected", list(policy.protected)),
                ("returned", list(policy.returned))]
    return list(getattr(policy, "order", []))


LRU_KEY = "self.evictable (LRU order, this prompt's hits left out)"


def snapshot(pool: Pool, result: object, hits: list[int] = ()) -> dict:
    """What `promote` may change. The contract fixes which blocks stay cached and the LRU order of the others
    (a hit is never evicted, the least recently used other block goes, the promoted block is the newest); where
    the prompt's own hits sit in that order is the function's choice, so only whether each is still cached counts."""
    bm, tier = pool.bm, pool.tier
    blocks = {b.block_id: (b.hash, b.token_ids, b.ref_count) for b in bm.blocks}
    out = {"returned": result, "self.free_ids": list(bm.free_ids),
           LRU_KEY: [b for b in bm.evictable if b not in hits],
           "this prompt's hits still cached": sorted(b for b in hits if b in bm.evictable),
           "self.hash_to_block": dict(bm.hash_to_block), "blocks (hash, token_ids, ref_count)": blocks,
           "host tier entries": {k: e.token_ids for k, e in tier.entries.items()},
           "host tier bytes_used": tier.bytes_used,
           "host tier counters (hits, blocks_in, bytes_in, dropped)": (tier.hits, tier.blocks_in, tier.bytes_in,
                                                                        tier.dropped),
           "host tier policy order": _policy_order(tier.policy)}
    if isinstance(result, int) and 0 <= result < bm.num_blocks:
        out["K/V of the returned block"] = [int(x) for x in pool.kv[result].tolist()]
    return out


def random_case(seed: int) -> tuple[Pool, int, tuple[int, ...], list[int], str]:
    """A pool, and the call `promote(name, ids, hits)` that `match_prefix` would make at the first block of a
    prompt the device misses: `hits` are the prompt's earlier blocks on the device. Returns a description too."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    n = rng.randint(3, 9)
    pool = Pool(n, bs, rng.randint(1, 4), rng.choice(["lru", "2q"]))
    bm = pool.bm
    tok = lambda: tuple(rng.randrange(1, 50) for _ in range(bs))  # noqa: E731
    j = rng.randint(0, min(3, n - 1))  # the block to promote sits after j device hits
    chain, parent = [], None
    for _ in range(j + 1):
        ids = tok()
        parent = bm.hash_block(parent, ids)
        chain.append((parent, ids))
    hits = [pool.put_device(name, ids, rng.choice([0, 0, 1])) for name, ids in chain[:j]]
    name, ids = chain[j]
    kind = rng.choices(["held", "collision", "absent"], [6, 1, 1])[0]
    if kind == "held":
        pool.put_tier(name, ids)
    elif kind == "collision":
        pool.put_tier(name, tuple(t + 50 for t in ids))
    for _ in range(rng.randint(0, 4)):  # other prefixes in the tier: it may be full
        pool.put_tier(rng.getrandbits(40), tok())
    if kind == "held" and name not in pool.tier.entries:  # the tier filled before: make it hold this one
        pool.tier.entries.clear()
        pool.tier.bytes_used = 0
        pool.tier.policy = LRUPolicy() if isinstance(pool.tier.policy, LRUPolicy) else TwoQueuePolicy()
        pool.put_tier(name, ids)
        for _ in range(rng.randint(0, 3)):
            pool.put_tier(rng.getrandbits(40), tok())
    if isinstance(pool.tier.policy, TwoQueuePolicy) and rng.random() < 0.5:
        pool.tier.policy.returned[name] = None  # this prefix came back before
    for _ in range(rng.randint(0, len(bm.free_ids))):  # other cached or running blocks on the device
        pool.put_device(rng.getrandbits(40), tok(), rng.choice([0, 0, 1]))
    order = list(bm.evictable)
    rng.shuffle(order)
    bm.evictable.clear()
    bm.evictable.update((b, None) for b in order)
    what = (f"block_size={bs}, {n} device blocks ({len(bm.free_ids)} free, {len(bm.evictable)} cached and "
            f"unreferenced), {len(hits)} prefix hit(s) before it, the tier holds {len(pool.tier)} entries "
            f"({type(pool.tier.policy).__name__}) and {'this block' if kind == 'held' else 'this name with other tokens' if kind == 'collision' else 'not this block'}")
    return pool, name, ids, hits, what


def _diagnose(ref: dict, you: dict, pool_ref: Pool, pool_you: Pool, name, ids, hits: list[int],
              had_free: bool = False) -> str | None:
    """The usual mistake whose evidence is in the difference, or None (`had_free`: free blocks before the call)."""
    held = pool_ref.tier.holds(name, ids) or ref["returned"] is not None
    collision = name in pool_ref.tier.entries and not held or (
        ref["returned"] is None and you["returned"] is not None and not held)
    if you["returned"] is not None and ref["returned"] is None and collision:
        return ("the tier holds this name with other token ids: a collision is a miss, never a hit (ask the tier "
                "whether it holds the name with exactly these tokens)")
    bm = pool_you.bm
    lost = [b for b in hits if b == you["returned"] or bm.blocks[b].hash is None
            or bm.hash_to_block.get(bm.blocks[b].hash) != b]
    if lost:
        reused = " and reused it for the promoted block (the one you returned)" if lost[0] == you["returned"] else ""
        return (f"you evicted block {lost[0]}, one of this prompt's earlier blocks (hits={hits}), to make room"
                f"{reused}: the block you promote then has no parent on the device. Only a cached block outside "
                f"`hits` may go (the least recently used of them), or return None when only hits could be evicted")
    if you["returned"] is not None and name in pool_you.tier.entries:
        return ("the block is on the device and still in the host tier: a stale copy (a hit leaves the tier; take "
                "it, do not just read it) that the tier keeps paying bytes for and may hand out again later")
    r_hits, y_hits = ref["host tier counters (hits, blocks_in, bytes_in, dropped)"], \
        you["host tier counters (hits, blocks_in, bytes_in, dropped)"]
    if ref["returned"] is not None and you["host tier policy order"] != ref["host tier policy order"] \
            and you["host tier entries"] == ref["host tier entries"]:
        return ("the entry left the tier but its eviction policy was not told about the hit: take it through the "
                "tier (tier.take), which tells the policy and counts the bytes; the policy would later choose a "
                "name the tier no longer holds")
    if ref["returned"] is not None and y_hits[0] == r_hits[0] - 1 and y_hits[3] > r_hits[3]:
        return ("you made room on the device before taking the entry from the tier: that eviction copied a block "
                "into the full tier, which dropped the very entry you wanted. Take the entry first, then the block")
    if ref["returned"] is not None and you["returned"] is None:
        return "the tier holds this block and a device block can be spared: promote it instead of returning None"
    if ref["returned"] is None and you["returned"] is not None:
        return ("no device block could be spared without evicting one of this prompt's earlier blocks (or the tier "
                "does not hold it): return None")
    r_left, y_left = [b for b in ref[LRU_KEY] if b != ref["returned"]], [b for b in you[LRU_KEY] if b != you["returned"]]
    if ref["returned"] is not None and you["returned"] is not None and set(r_left) != set(y_left):
        gone = [b for b in r_left if b not in y_left]  # cached by the reference, not by you
        if not had_free and gone:  # the reference evicted block ref["returned"] and reused it
            return (f"you evicted block {gone[0]}, but the least recently used cached block outside hits was block "
                    f"{ref['returned']} (the first of self.evictable that is not a hit): evict that one; block "
                    f"{gone[0]} should have stayed cached")
        if had_free:
            return ("a free block was left: take it (self.take_block() hands out free blocks before it evicts) and "
                    "evict nothing")
    rb = you["returned"]
    if isinstance(rb, int) and 0 <= rb < bm.num_blocks:
        blk = bm.blocks[rb]
        if you.get("K/V of the returned block") != list(ids):
            return "the block's K/V was not copied in from the tier (tier.restore(block_id, saved))"
        if blk.hash != name or blk.token_ids != tuple(ids) or bm.hash_to_block.get(name) != rb:
            return ("the promoted block must carry its name and token ids and be findable (self.hash_to_block), "
                    "or the next prompt misses it")
        if blk.ref_count != 0 or rb not in bm.evictable:
            return ("the promoted block must be cached and unreferenced (ref_count 0, newest in self.evictable) as if "
                    "it had never left: admit() takes the reference; else it leaks or is never evicted")
        if you[LRU_KEY] and you[LRU_KEY][-1] != rb:
            return (f"the promoted block must be the newest cached block (last in self.evictable), as a block just "
                    f"used is; yours sits at position {you[LRU_KEY].index(rb) + 1} of {len(you[LRU_KEY])} (hits left "
                    f"out), so the next eviction takes it before older blocks")
    return None


def _first_difference(ref: dict, you: dict) -> str:
    for key in ref:
        if ref[key] != you.get(key):
            return f"afterwards {key} is {you.get(key)!r}; expected {ref[key]!r}"
    extra = [k for k in you if k not in ref]
    return f"afterwards {extra[0]} is {you[extra[0]]!r}; expected nothing" if extra else "states agree"


NO_TIER = ("with no host tier (self.host_tier is None: an engine without kv_offload_bytes still calls promote at "
           "every prefix miss) promote returns None and changes nothing")


def _cases(trials: int, seed: int):
    """The engine without a tier (the contract's first None), then `trials` random pools with one."""
    pool, name, ids, hits, what = random_case(seed * 100_000)
    pool.bm.host_tier = None
    yield "no tier", pool, name, ids, hits, f"{what}, but self.host_tier is None"
    for trial in range(trials):
        yield trial, *random_case(seed * 100_000 + trial)


def promote_cases(fn: Callable, trials: int = 300, seed: int = 0) -> int:
    """Compare `fn` with the engine's `promote` on a pool without a host tier and `trials` random pools with one;
    AssertionError on the first difference (with the likely mistake). Returns the number of random cases."""
    check_signature(PART, fn)
    for trial, pool, name, ids, hits, what in _cases(trials, seed):
        a, b = copy.deepcopy(pool), copy.deepcopy(pool)
        ref_out = BlockManager.promote(a.bm, name, ids, list(hits))
        try:
            you_out = types.MethodType(fn, b.bm)(name, ids, list(hits))
        except NotImplementedError:
            raise
        except (LearnerPartError, Exception) as err:
            cause = NO_TIER if b.bm.host_tier is None else None
            raise AssertionError(f"{_where()}, case {trial} ({what}): your function raised "
                                 f"{type(err).__name__}: {err}\n  called: promote(name, ids={ids}, hits={hits})"
                                 + (f"\n  likely mistake: {cause}" if cause else "")) from err
        ref, you = snapshot(a, ref_out, hits), snapshot(b, you_out, hits)
        if ref == you:
            continue
        cause = NO_TIER if b.bm.host_tier is None else _diagnose(ref, you, a, b, name, ids, hits,
                                                                 had_free=bool(pool.bm.free_ids))
        raise AssertionError(f"{_where()}, case {trial} ({what}): {_first_difference(ref, you)}\n"
                             f"  called: promote(name, ids={ids}, hits={hits})"
                             + (f"\n  likely mistake: {cause}" if cause else ""))
    return trials


def check_promote(fn: Callable, submit: bool = True) -> None:
    """Random pools with a host tier against the engine's promote; then `fn` becomes the engine's part."""
    n = promote_cases(fn)
    print(f"{PART}: {n} random cases agree with the reference (hits on the device, full and empty tiers, "
          f"collisions, LRU and 2Q policies)")
    if submit:
        from lab_utils.course import learner_parts

        learner_parts.submit(PART, fn)


# -- claims ------------------------------------------------------------------------------------------------
TOLERANCE = 0.35  # |predicted - measured| / measured for the returning turns' median TTFT ratio


def claims(r: Mapping) -> list[Claim]:
    """r: `tokens` {setting: [token ids per turn]} (setting "off" first), `near_ties` (optional) {setting: turns
    that part from "off" first at a near-tie of the model's dtype (`teacher_forced.compare_greedy_runs`: the tier
    prefills a shorter tail over cached K/V, another order of the same sums)}, `leaks` {setting: message or ""},
    `returning_prefill` {setting: prefill tokens of returning turns}, `ratio_measured` / `ratio_predicted`
    {tier setting: median TTFT off / with the tier}, `ratio_spread` {tier setting: spread of the measured ratio
    over rounds}, `prefill_curves` (optional) {name: [(tokens, seconds)]}: the measured curves the prediction reads (a
    curve that is not increasing makes a missed prediction NOT JUDGED), `calls` (EngineParts.calls over the tier
    runs); and the shared store's run
    (`kvstore.sources.summarise`): `store_computed` {"store", "apart": prompt tokens the returning turns computed},
    `store_read` (tokens they read from the store), `store_first_tokens` {"store", "apart": first token of every
    turn}, `store_near_ties` (optional: turns whose first tokens part at a near-tie), `store_leaks` {worker: message
    or ""}, `store_ratios` (returning turns' prefill time without / with the store, turn by turn)."""
    need(r, "tokens", "leaks", "returning_prefill", "ratio_measured", "ratio_predicted", "ratio_spread", "calls",
         "store_computed", "store_read", "store_first_tokens", "store_leaks", "store_ratios")
    tokens, base = r["tokens"], r["tokens"]["off"]
    ties = r.get("near_ties", {})
    out: list[Claim] = []
    differ = {s: sum(a != b for a, b in zip(base, t)) + abs(len(base) - len(t)) for s, t in tokens.items() if s != "off"}
    wrong = {s: n - ties.get(s, 0) for s, n in differ.items()}
    out.append((f"greedy outputs identical with every host-tier setting, or parting first at a near-tie of the "
                f"model's dtype ({len(base)} turns; turns that differ: {differ}; of them at a near-tie: "
                f"{ {s: ties.get(s, 0) for s in differ} })", bool(differ) and not any(wrong.values())))
    leaks = {s: m for s, m in r["leaks"].items() if m}
    out.append((f"no KV block leaked: device pool all free and the tier's bytes accounted, in "
                f"{len(r['leaks'])} runs" + (f"; leaked: {leaks}" if leaks else ""), bool(r["leaks"]) and not leaks))
    pre = r["returning_prefill"]
    for s in [s for s in pre if s != "off"]:
        out.append((f"returning turns prefill fewer tokens with the host tier ({s}): {pre[s]} vs {pre['off']} "
                    f"without", pre[s] < pre["off"]))
    errors = {s: abs(p - r["ratio_measured"][s]) / r["ratio_measured"][s] for s, p in r["ratio_predicted"].items()}
    text = ("returning turns' median TTFT, without / with the tier, is what measured copy and prefill costs "
            "predict within " + f"{TOLERANCE:.0%}: " + "; ".join(
                f"{s} measured {r['ratio_measured'][s]:.2f}x, predicted {r['ratio_predicted'][s]:.2f}x "
                f"(error {errors[s]:.0%})" for s in errors))
    claim = judge_error(text, errors, r["ratio_spread"], TOLERANCE, "rerun the trace cell when the machine is quieter")
    bumpy = bumpy_curves(r.get("prefill_curves", {}))
    if claim[1] is False and bumpy:
        claim = (f"{claim[0]} -- NOT JUDGED: the prefill curve the prediction reads is not increasing ({bumpy}: "
                 f"a longer prompt measured faster than a shorter one), so this machine was too busy to tell; rerun "
                 f"the trace cell when the machine is quieter", None)
    out.append(claim)
    out.append(parts_called("the host-tier runs", r["calls"], [PART]))
    out.extend(store_claims(r))
    out.extend(routing_claims(r))
    return out


def bumpy_curves(curves: Mapping[str, list]) -> str:
    """'fresh round 1: 64 tokens 30 ms < 16 tokens 41 ms' for each measured prefill curve (name -> [(tokens,
    seconds)]) in which more tokens took less time; '' when every curve increases."""
    bumps = []
    for name, curve in curves.items():
        pts = sorted(curve)
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if s1 < s0:
                bumps.append(f"{name}: {n1} tokens {1e3 * s1:.0f} ms < {n0} tokens {1e3 * s0:.0f} ms")
                break
    return "; ".join(bumps)


def store_claims(r: Mapping) -> list[Claim]:
    """Two prefill workers, every returning turn routed to the one that did not serve the turn before: with the
    shared store and without (see `claims` for the keys)."""
    computed, read = r["store_computed"], r["store_read"]
    out: list[Claim] = [(
        f"routed to the other worker, returning turns compute fewer prompt tokens with the shared store: "
        f"{computed['store']} vs {computed['apart']} without ({read} read from the store)",
        computed["store"] < computed["apart"] and read > 0)]
    firsts = r["store_first_tokens"]
    out.append(_same_tokens("first tokens identical with and without the store", firsts["apart"], firsts["store"],
                            r.get("store_near_ties", 0)))
    out.append(_no_leak("prefill worker", r["store_leaks"]))
    out.append(judge("returning turns' prefill is faster with the store (time without / with, turn by turn, the "
                     "pools taking turns to go first)", r["store_ratios"], 1.0,
                     "rerun the store cell when the machine is quieter", strict=True))
    return out


def routing_claims(r: Mapping) -> list[Claim]:
    """Two replicas behind a router (section 6): `routing_computed` {"round-robin", "prefix-aware": prompt tokens
    the returning turns computed}, `routing_tokens` {router: token ids of every turn}, `routing_near_ties` (optional:
    turns whose tokens part at a near-tie of the model's dtype), `routing_leaks` {replica: message or ""}. Counted in
    tokens, not timed: true on any device."""
    need(r, "routing_computed", "routing_tokens", "routing_leaks")
    computed, toks = r["routing_computed"], r["routing_tokens"]
    rr, pa = computed["round-robin"], computed["prefix-aware"]
    out: list[Claim] = [(f"routed by prefix, returning turns compute fewer prompt tokens than routed round-robin: "
                         f"{pa} vs {rr}", pa < rr)]
    out.append(_same_tokens("greedy outputs identical under both routers", toks["round-robin"],
                            toks["prefix-aware"], r.get("routing_near_ties", 0)))
    out.append(_no_leak("replica", r["routing_leaks"]))
    return out


def _same_tokens(what: str, a: list, b: list, ties: int) -> Claim:
    """`what`, true when the two runs' tokens are equal turn by turn but for partings at a near-tie."""
    differ = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    return (f"{what}, or parting at a near-tie of the model's dtype ({len(a)} turns; differ: {differ}, at a "
            f"near-tie: {ties})", bool(a) and differ - ties <= 0)


def _no_leak(kind: str, leaks: Mapping[str, str]) -> Claim:
    """No KV block leaked on any `kind`: every one reported, each with an empty message."""
    leaked = {k: m for k, m in leaks.items() if m}
    return (f"no KV block leaked on any {kind} ({len(leaks)} {kind}s" + (f"; leaked: {leaked})" if leaked else ")"),
            bool(leaks) and not leaked)


def assert_claims(r: Mapping, show: bool = True) -> None:
    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
