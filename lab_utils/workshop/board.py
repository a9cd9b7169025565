"""The instructor's board: a JupyterHub service showing the room as learners x checks, for admins only.

The hub starts it (`services` in the written jupyterhub_config.py) at /services/board/. Every request is
authenticated by the hub (HubOAuth: a browser session or an API token) and needs the scope
`access:services!service=board`, which only admins hold: a learner gets 403. Pages:
    /services/board/            the grid: last result per check (attempts), the exercise each learner is on and
                                for how long they have been stuck on it
    /services/board/grades.csv  the gradebook (as `python -m lab_utils grade`)
    /services/board/room.json   the same rows as JSON
"""
from __future__ import annotations

import argparse
import html
import json
import os
import signal
import time

from lab_utils.workshop import gradebook


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
<a href="grades.csv">gradebook (CSV)</a></p>
<table><tr><th>learner</th><th>passed</th><th>stuck</th>{head}</tr>
{''.join(body)}</table></body></html>"""


def make_app(homes: str, prefix: str):
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
    from tornado import web

    class Board(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self, what: str = "") -> None:
            learners = gradebook.room(homes)
            if what == "grades.csv":
                self.set_header("Content-Type", "text/csv; charset=utf-8")
                self.write(gradebook.to_csv(learners))
            elif what == "room.json":
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"learners": [m.name for m in learners], "rows": gradebook.rows(learners)}))
            else:
                self.write(grid_html(learners))

    return web.Application([
        (prefix + "oauth_callback", HubOAuthCallbackHandler),
        (prefix + r"(grades\.csv|room\.json)?", Board),
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
