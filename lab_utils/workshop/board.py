"""The instructor's board: a JupyterHub service showing the room as learners x checks, for admins only.

The hub starts it (`services` in the written jupyterhub_config.py) at /services/board/. Every request is
authenticated by the hub (HubOAuth: a browser session or an API token) and needs the scope
`access:services!service=board`, which only admins hold: a learner gets 403. Pages:
    /services/board/            the grid: last result per check (attempts), the exercise each learner is on and
                                for how long they have been stuck on it
    /services/board/grades.csv  the gradebook (as `python -m lab_utils grade`)
    /services/board/room.json   the same rows as JSON
    /services/board/kernels     the kernel leaderboard: each learner's `bench-kernel` lines (lab 16), ranked
    /services/board/kernels.json  the same ranking as JSON
"""
from __future__ import annotations

import argparse
import html
import json
import os
import signal
import time

from lab_utils.workshop import gradebook

KERNEL_RESULTS = ".kernel_bench.jsonl"  # what `python -m lab_utils bench-kernel` appends to, beside my_engine/


def _kernel_lines(home: str) -> list[dict]:
    """The bench-kernel lines under one home (hidden folders and symlinks not followed, as the gradebook)."""
    lines = []
    for root, dirs, files in os.walk(home):
        level = len(os.path.relpath(root, home).split(os.sep)) if root != home else 0
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and level < gradebook.MAX_DEPTH
                         and not os.path.islink(os.path.join(root, d)))
        if KERNEL_RESULTS in files:
            with open(os.path.join(root, KERNEL_RESULTS), encoding="utf-8", errors="replace") as f:
                for text in f:
                    try:
                        line = json.loads(text)
                    except ValueError:
                        continue  # a half-written line: the next run appends a whole one
                    if isinstance(line, dict):
                        lines.append(line)
    return lines


def kernel_ranking(homes: str) -> list[dict]:
    """One row per learner, kernel part and device: their fastest correct line (else their latest one). Rows
    ranked correct first, then by microseconds per call; the learner is the home folder's name, never a field."""
    best: dict[tuple, dict] = {}
    for home in sorted(os.listdir(homes)):
        path = os.path.join(homes, home)
        if not os.path.isdir(path) or home.startswith("."):
            continue
        for line in _kernel_lines(path):
            key = (home, line.get("part"), line.get("device"), json.dumps(line.get("shape"), sort_keys=True))
            row = {"learner": home, "part": line.get("part"), "device": line.get("device"),
                   "correct": bool(line.get("correct")), "us_per_call": line.get("us_per_call"),
                   "fraction_of_bound": line.get("fraction_of_bound"), "shape": line.get("shape"),
                   "error": line.get("error"), "time": line.get("time", 0)}
            old = best.get(key)
            if old is None or _better(row, old):
                best[key] = row
    rows = sorted(best.values(), key=lambda r: (not r["correct"], r["us_per_call"] or float("inf"), r["learner"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank if r["correct"] else None
    return rows


def _better(new: dict, old: dict) -> bool:
    if new["correct"] != old["correct"]:
        return new["correct"]
    if new["correct"]:
        return (new["us_per_call"] or float("inf")) < (old["us_per_call"] or float("inf"))
    return new["time"] >= old["time"]


def kernels_html(rows: list[dict], title: str = "Kernel leaderboard") -> str:
    """The ranking as a table: rank, learner, part, device, µs per call, fraction of the KV-bytes bound."""
    body = []
    for r in rows:
        frac = "" if r["fraction_of_bound"] is None else f"{r['fraction_of_bound']:.3g}"
        us = "" if r["us_per_call"] is None else f"{r['us_per_call']:,.1f}"
        status = "&#10003;" if r["correct"] else f"&#10007; {html.escape(str(r['error'] or ''))}"
        body.append(f"<tr><td>{r['rank'] or ''}</td><th>{html.escape(r['learner'])}</th>"
                    f"<td>{html.escape(str(r['part']))}</td><td>{html.escape(str(r['device']))}</td>"
                    f"<td>{us}</td><td>{frac}</td><td class='{'ok' if r['correct'] else 'bad'}'>{status}</td></tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="refresh" content="30"><style>
body{{font-family:sans-serif}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 6px;
font-size:13px}} .ok{{background:#dfd}} .bad{{background:#fdd}}</style></head><body><h1>{html.escape(title)}</h1>
<p>Each learner's fastest correct run of <code>python -m lab_utils bench-kernel</code> (lab 16), per part and
device; the fraction is of the time reading the KV bytes takes at the measured bandwidth. <a href="./">the room</a></p>
<table><tr><th>rank</th><th>learner</th><th>part</th><th>device</th><th>µs per call</th><th>of the bound</th>
<th>correct</th></tr>
{''.join(body)}</table></body></html>"""


def grid_html(learners: list[gradebook.Learner], title: str = "The room") -> str:
    """One table: a row a learner, a column a check; the stuck column first so the instructor sees who needs help."""
    checks = gradebook.checks_of(learners)
    head = "".join(f"<th title='lab {html.escape(lab)}'>{html.escape(lab)}<br>{html.escape(c.removeprefix('check_'))}"
                   f"</th>" for lab, c in checks)
    body = []
    for me in sorted(learners, key=lambda m: -m.stuck_s):
        stuck = ""
        if me.stuck_s:
            stuck = f"{me.stuck_s / 60:.0f} min on {html.escape(me.current[1].removeprefix('check_'))}"
        cells = []
        for key in checks:
            c = me.cells.get(key)
            if c is None:
                cells.append("<td></td>")
                continue
            tip = html.escape(c.last_result + (f" (likely cause: {c.likely_cause})" if c.likely_cause else ""), True)
            mark, cls = ("&#10003;", "ok") if c.passed else ("&#10007;", "bad")
            cells.append(f"<td class='{cls}' title='{tip}'>{mark} {c.attempts}</td>")
        done = sum(c.passed for c in me.cells.values())
        body.append(f"<tr><th>{html.escape(me.name)}</th><td>{done}</td><td class='stuck'>{stuck}</td>"
                    f"{''.join(cells)}</tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="refresh" content="30"><style>
body{{font-family:sans-serif}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 6px;
text-align:center;font-size:13px}} .ok{{background:#dfd}} .bad{{background:#fdd}} .stuck{{color:#a00;white-space:nowrap}}
</style></head><body><h1>{html.escape(title)}</h1>
<p>{len(learners)} learners, {len(checks)} checks run so far; updated {time.strftime('%H:%M:%S')} (every 30 s).
A cell: &#10003; passed or &#10007; failing, and the attempts; hover for the last message.
<a href="grades.csv">gradebook (CSV)</a> <a href="kernels">kernel leaderboard</a></p>
<table><tr><th>learner</th><th>passed</th><th>stuck</th>{head}</tr>
{''.join(body)}</table></body></html>"""


def make_app(homes: str, prefix: str):
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
    from tornado import web

    class Board(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self, what: str = "") -> None:
            learners = gradebook.room(homes) if what in ("", None, "grades.csv", "room.json") else []
            if what == "grades.csv":
                self.set_header("Content-Type", "text/csv; charset=utf-8")
                self.write(gradebook.to_csv(learners))
            elif what == "room.json":
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"learners": [m.name for m in learners], "rows": gradebook.rows(learners)}))
            elif what == "kernels":
                self.write(kernels_html(kernel_ranking(homes)))
            elif what == "kernels.json":
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"rows": kernel_ranking(homes)}))
            else:
                self.write(grid_html(learners))

    return web.Application([
        (prefix + "oauth_callback", HubOAuthCallbackHandler),
        (prefix + r"(grades\.csv|room\.json|kernels|kernels\.json)?", Board),
    ], cookie_secret=os.urandom(32))


def main(argv: list[str] | None = None) -> None:
    from urllib.parse import urlparse

    from tornado.ioloop import IOLoop

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--homes", required=True, help="folder with one home per learner")
    args = p.parse_args(argv)
    # the hub stops its services with SIGINT: honour it even when started from a shell that ignores it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app = make_app(args.homes, os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/board/"))
    app.listen(url.port, url.hostname)
    IOLoop.current().start()


if __name__ == "__main__":
    main()
