"""A learner's server as the hub starts it: write the learner copies (never over the learner's work), then Jupyter.

Runs as the learner, in their home: `lab_utils student --keep-existing` writes `~/student/` (only the copies that
are missing; a lab the learner changed is kept), then `jupyterhub-singleuser` starts with the hub's arguments.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from lab_utils.paths import REPO_ROOT

    home = Path(os.environ.get("HOME") or Path.home())
    labs = Path(os.environ.get("LAB_LABS_DIR") or REPO_ROOT / "labs")
    from lab_utils.__main__ import main as lab_utils

    rc = lab_utils(["student", "--out", str(home / "student"), "--labs-dir", str(labs), "--keep-existing", "--quiet"])
    if rc:
        print(f"lab_utils student exited {rc}: starting Jupyter with what is there", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub.singleuser", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
