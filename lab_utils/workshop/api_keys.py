"""One API key per learner for the room's shared `lab_utils serve` (labs 08 and 12).

The hub gives each learner's server `OPENAI_BASE_URL` (the shared server) and `OPENAI_API_KEY`, which the openai
client and `lab_utils bench --backend http` read. A learner's key is HMAC-SHA256(the room's secret, their name):
the same at every spawn, different for every learner, and written at their first spawn to `api_keys.txt` in the
hub's state folder (one `KEY NAME` line per learner, readable by the hub's user only), so the instructor can see
whose key a request used and revoke one by changing the secret.

`lab_utils serve --api-key-file api_keys.txt` accepts any key in the file and reads it again as it changes, so
each learner sends their own key. A `serve` without that flag (an older checkout) is given the room's one key
(`--api-key`), and every learner that key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

KEY_FILE_FLAG = "--api-key-file"


def serve_takes_key_file() -> bool:
    """Whether `python -m lab_utils serve` accepts a file of keys (KEY_FILE_FLAG)."""
    import argparse

    from lab_utils.server.cli import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    return any(KEY_FILE_FLAG in a.option_strings for a in sub.choices["serve"]._actions)


class LearnerKeys:
    """Each learner's key, derived from the room's secret; `key_for` records it in `path` the first time."""

    def __init__(self, path: Path, secret: str) -> None:
        self.path, self.secret = Path(path), secret

    def key_for(self, name: str) -> str:
        key = "lab-" + hmac.new(self.secret.encode(), name.encode(), hashlib.sha256).hexdigest()[:40]
        if name not in self.names():
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(f"{key} {name}\n")
        return key

    def names(self) -> dict[str, str]:
        """{learner: key} of the keys written so far."""
        if not self.path.exists():
            return {}
        pairs = (line.split() for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip())
        return {name: key for key, name in pairs}
