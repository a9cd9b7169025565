"""Lab 04's checker accepts a correct hash chain and rejects each common mistake with a useful message."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab04
from lab_utils.engine.block_manager import block_hash


def good(ids, bs):
    out, parent = [], None
    for i in range(len(ids) // bs):
        parent = block_hash(parent, tuple(ids[i * bs:(i + 1) * bs]))
        out.append(parent)
    return out


def test_accepts_correct(capsys):
    lab04.check_block_hashes(good, seed=0)
    lab04.check_block_hashes(good)
    assert "check_block_hashes passed" in capsys.readouterr().out


def _partial_too(ids, bs):
    out, parent = [], None
    for i in range(-(-len(ids) // bs)):
        parent = block_hash(parent, tuple(ids[i * bs:(i + 1) * bs]))
        out.append(parent)
    return out


def _unchained(ids, bs):
    return [block_hash(None, tuple(ids[i * bs:(i + 1) * bs])) for i in range(len(ids) // bs)]


def _parent_ids(ids, bs):
    out, prev = [], None
    for i in range(len(ids) // bs):
        blk = tuple(ids[i * bs:(i + 1) * bs])
        out.append(block_hash(prev, blk))
        prev = blk
    return out


def _plain_hash(ids, bs):
    return [hash(tuple(ids[i * bs:(i + 1) * bs])) for i in range(len(ids) // bs)]


@pytest.mark.parametrize("bad, message", [
    (_partial_too, "partial last block"),
    (_unchained, "chain it to the previous"),
    (_parent_ids, "token ids, not its hash"),
    (_plain_hash, "not hash"),
    (lambda ids, bs: None, "returned None"),
    (lambda ids, bs: good(ids, bs)[::-1], "expected"),
])
def test_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab04.check_block_hashes(bad, seed=1)


def test_not_implemented_propagates():
    def todo(ids, bs):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab04.check_block_hashes(todo, seed=0)
