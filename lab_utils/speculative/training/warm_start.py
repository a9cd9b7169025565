"""Continue a head's training from a shipped checkpoint (`--init-from`), keeping its history honest.

Why: on a CPU a second run on a larger corpus is cheaper from the first run's weights than from scratch. The
result then carries the earlier run: its commands come first in the card's "Reproduce" block, and the learning
curve continues the earlier one (positions counted from the start of the first run), so it still reads as
acceptance against all training seen.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def load_into(module: torch.nn.Module, loaded: torch.nn.Module) -> None:
    """Copy `loaded`'s weights and draft vocabulary into `module` (same shapes)."""
    module.load_state_dict(loaded.state_dict())
    module.vocab = getattr(loaded, "vocab", None)


def prior_run(folder: str | Path) -> dict:
    """The earlier run's train_result.json (ValueError naming the fix if it has none)."""
    path = Path(folder) / "train_result.json"
    if not path.exists():
        raise ValueError(f"--init-from {folder}: no train_result.json there; give a folder a training script wrote")
    return json.loads(path.read_text())


def chain(result: dict, prior: dict, out: str, init_from: str) -> dict:
    """`result` with the earlier run(s) in front: curve, commands and totals (positions, seconds) add up; its own
    `steps`, `positions_seen` and `seconds` stay this run's."""
    pos0 = prior.get("total_positions_seen", prior["positions_seen"])
    runs = prior.get("runs") or [{k: prior[k] for k in ("command", "positions_seen", "seconds", "steps")}]
    curve = prior.get("learning_curve", []) if prior.get("runs") else [dict(p, run=1) for p in
                                                                          prior.get("learning_curve", [])]
    curve += [dict(p, positions=p["positions"] + pos0, run=len(runs) + 1) for p in result["learning_curve"]]
    this = {k: result[k] for k in ("command", "positions_seen", "seconds", "steps")}
    command = (prior["command"] + f"\ncp -r {out} {init_from}   # the weights to continue from\n"
               + result["command"])
    return dict(result, learning_curve=curve, runs=runs + [this], command=command, total_positions_seen=pos0 +
                result["positions_seen"], total_seconds=prior.get("total_seconds", prior["seconds"]) + result["seconds"])


def runs_line(r: dict) -> str:
    """A model card's bullet on the runs behind a chained checkpoint ("" for a single run)."""
    if not r.get("runs"):
        return ""
    each = "; ".join(f"run {i + 1}: {x['steps']} steps, {x['positions_seen']:,} positions, {x['seconds'] / 60:.0f} min"
                     for i, x in enumerate(r["runs"]))
    return (f"- {len(r['runs'])} runs, each from the previous one's weights ({each}); in all "
            f"{r['total_positions_seen']:,} positions in {r['total_seconds'] / 60:.0f} min. The lines below are the "
            f"last run's.\n")


def start_label(r: dict, untrained: str = "untrained") -> str:
    """What the "before" column of a card measured: untrained weights, or the last run's start."""
    return f"at the start of run {len(r['runs'])}" if r.get("runs") else untrained
