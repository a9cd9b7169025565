"""A head trained in two runs (`--init-from`): weights carried over, curve and commands chained, totals add up."""
from __future__ import annotations

import pytest
import torch

from lab_utils.speculative.medusa import MedusaHeads
from lab_utils.speculative.training.warm_start import chain, load_into, prior_run, runs_line


def _run(cmd: str, positions: int, seconds: int, curve: list[tuple[int, float]]) -> dict:
    return {"command": cmd, "positions_seen": positions, "seconds": seconds, "steps": positions // 100,
            "learning_curve": [{"positions": p, "first": a} for p, a in curve]}


def test_chained_runs_continue_the_curve_and_list_every_command():
    first = _run("python train.py --a", 1000, 60, [(500, 0.3), (1000, 0.4)])
    second = chain(_run("python train.py --b --init-from /tmp/x", 400, 30, [(200, 0.45), (400, 0.5)]),
                   first, "data/models/h", "/tmp/x")
    assert [p["positions"] for p in second["learning_curve"]] == [500, 1000, 1200, 1400]
    assert [p["run"] for p in second["learning_curve"]] == [1, 1, 2, 2]
    assert second["positions_seen"] == 400 and second["total_positions_seen"] == 1400
    assert second["total_seconds"] == 90 and len(second["runs"]) == 2
    lines = second["command"].splitlines()
    assert lines[0] == "python train.py --a" and lines[1].startswith("cp -r data/models/h /tmp/x")
    assert lines[2].endswith("--init-from /tmp/x")
    third = chain(_run("python train.py --c", 100, 10, [(100, 0.55)]), second, "data/models/h", "/tmp/y")
    assert third["learning_curve"][-1] == {"positions": 1500, "first": 0.55, "run": 3}
    assert third["total_positions_seen"] == 1500 and len(third["runs"]) == 3
    assert third["command"].count("cp -r") == 2
    assert runs_line(first) == "" and "3 runs" in runs_line(third) and "1,500 positions" in runs_line(third)


def test_load_into_copies_weights_and_draft_vocabulary(tmp_path):
    a, b = MedusaHeads(16, 2), MedusaHeads(16, 2)
    torch.nn.init.normal_(a.heads[0].linear.weight)
    a.vocab = torch.tensor([3, 1, 2])
    load_into(b, a)
    assert torch.equal(b.heads[0].linear.weight, a.heads[0].linear.weight) and torch.equal(b.vocab, a.vocab)
    with pytest.raises(ValueError, match="no train_result.json"):
        prior_run(tmp_path)
