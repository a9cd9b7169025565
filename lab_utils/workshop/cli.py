"""`python -m lab_utils workshop`: write the hub's config for one box and start JupyterHub (or only write it)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from lab_utils.paths import REPO_ROOT, cache_dir
from lab_utils.workshop import gpu, sizing
from lab_utils.workshop.config import WorkshopOptions, write


def gpu_room(args: argparse.Namespace) -> gpu.GpuRoom | None:
    """The GPU settings from --gpus/--gpu-mem (None without --gpus)."""
    if not args.gpus:
        return None
    devices = [d.strip() for d in args.gpus.split(",") if d.strip()]
    mem = int(args.gpu_mem * gpu.GiB) if args.gpu_mem else gpu.device_memory(devices)
    return gpu.GpuRoom(tuple(devices), mem, args.learners, server=args.serve is not None)


def options(args: argparse.Namespace) -> WorkshopOptions:
    return WorkshopOptions(
        state=Path(args.state).resolve(), homes=Path(args.homes).resolve(), cache=Path(args.cache).resolve(),
        labs=Path(args.labs).resolve(), share=sizing.share(args.learners), admins=list(args.admin), ip=args.ip,
        port=args.port, hub_port=args.port + 81, proxy_api_port=args.port + 1, board_port=args.port + 2,
        code=args.code or os.environ.get("WORKSHOP_CODE") or None, cull_after_s=args.cull_after * 60,
        gpu=gpu_room(args), serve_model=args.serve, serve_port=args.port + 3)


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
    print(f"config: {path}\nroom: {o.share}" + (f"\ngpu: {o.gpu}" if o.gpu else "") +
          (f"\nserver: {o.serve_model} on 127.0.0.1:{o.serve_port} (keys in {o.state}/api_keys.txt)"
           if o.serve_model else "") + f"\nhub: http://{o.ip}:{o.port}/  (board: /services/board/, "
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
                   "take port+1, port+2 and port+81; --serve port+3)")
    p.add_argument("--code", help="a shared workshop code as the password (default: sign-up with approval; "
                   "or set WORKSHOP_CODE)")
    p.add_argument("--state", default=str(Path.home() / ".lab_workshop"), help="hub database, secret, config")
    p.add_argument("--homes", default="/home", help="one folder per learner")
    p.add_argument("--cache", default=str(cache_dir()), help="the prepared models, shared read-only")
    p.add_argument("--labs", default=str(REPO_ROOT / "labs"), help="the labs learner copies are made from")
    p.add_argument("--cull-after", type=int, default=60, metavar="MIN", help="stop servers idle this long")
    p.add_argument("--gpus", metavar="IDS", help="a GPU box: devices for the learners' kernels, comma-separated "
                   "indices or GPU-/MIG- UUIDs, given round-robin (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="memory of each --gpus device (a MIG slice's own; "
                   "default: asked of torch)")
    p.add_argument("--serve", metavar="MODEL", help="run one shared `lab_utils serve` of MODEL for labs 08 and 12 "
                   "(port+3); each learner gets OPENAI_BASE_URL and an API key")
    p.add_argument("--write-only", action="store_true", help="write the config and stop")
    p.set_defaults(func=_run)
