"""Where things live: the repo's data folder and the user's cache of prepared models."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


def cache_dir() -> Path:
    """`LAB_UTILS_CACHE`, default `~/.cache/lab_utils`: prepared models are built here once, never committed."""
    return Path(os.environ.get("LAB_UTILS_CACHE", Path.home() / ".cache" / "lab_utils")).expanduser()
