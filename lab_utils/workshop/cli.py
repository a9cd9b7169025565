"""`python -m lab_utils workshop`: write the hub's config for one box and start JupyterHub (or only write it)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from lab_utils.paths import REPO_ROOT, cache_dir
from lab_utils.workshop import sizing
from lab_utils.workshop.config import WorkshopOptions, write


def options(args: argparse.Namespace) -> WorkshopOptions:
    return WorkshopOptions(
        state=Path(args.state).resolve(), homes=Path(args.homes).resolve(), cache=Path(args.cache).resolve(),
        labs=Path(args.labs).resolve(), share=sizing.share(args.learners), admins=list(args.admin), ip=args.ip,
        port=args.port, hub_port=args.port + 81, proxy_api_port=args.port + 1, board_port=args.port + 2,
        code=args.code or os.environ.get("WORKSHOP_CODE") or None, cull_after_s=args.cull_after * 60)


def _run(args: argparse.Namespace) -> int:
    if not args.admin:
        print("name at least one instructor: --admin NAME (repeat for more)", file=sys.stderr)
        return 2
    try:
        o = options(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    path = write(o)
    print(f"config: {path}\nroom: {o.share}\nhub: http://{o.ip}:{o.port}/  (board: /services/board/, "
          f"{'shared code' if o.code else 'sign up at /hub/signup, approve at /hub/authorize'})")
    if o.code:
        print(f"instructors log in with the password {o.admin_password} (also in the config)")
    if args.write_only:
        return 0
    if shutil.which("configurable-http-proxy") is None:
        print("configurable-http-proxy not installed: npm install -g configurable-http-proxy", file=sys.stderr)
        return 1
    os.chdir(o.state)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub", "-f", str(path)])


def register(sub) -> None:
    p = sub.add_parser("workshop", help="JupyterHub for a room on one box (learner copies, limits, board)")
    p.add_argument("--admin", action="append", default=[], metavar="NAME", help="an instructor (repeatable)")
    p.add_argument("--learners", type=int, default=10, help="the room's size: sets each learner's share")
    p.add_argument("--ip", default="127.0.0.1", help="interface to listen on (the room's; put TLS in front)")
    p.add_argument("--port", type=int, default=8000, help="public port (the proxy API, the board and the hub "
                   "take port+1, port+2 and port+81)")
    p.add_argument("--code", help="a shared workshop code as the password (default: sign-up with approval; "
                   "or set WORKSHOP_CODE)")
    p.add_argument("--state", default=str(Path.home() / ".lab_workshop"), help="hub database, secret, config")
    p.add_argument("--homes", default="/home", help="one folder per learner")
    p.add_argument("--cache", default=str(cache_dir()), help="the prepared models, shared read-only")
    p.add_argument("--labs", default=str(REPO_ROOT / "labs"), help="the labs learner copies are made from")
    p.add_argument("--cull-after", type=int, default=60, metavar="MIN", help="stop servers idle this long")
    p.add_argument("--write-only", action="store_true", help="write the config and stop")
    p.set_defaults(func=_run)
