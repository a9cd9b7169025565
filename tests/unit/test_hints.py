"""Hints that teach: every exercise has three levels of help, and what the learner reads before asking (the
exercise's markdown, its docstring, the `NotImplementedError` text, the first hint) keeps a measured distance
from the solution's code.

The distance rule, applied to the solution region's code (comments dropped):
- **no line**: no non-trivial line of the solution appears in the text, whitespace removed on both sides (so a
  line wrapped over two markdown lines, or spaced differently, still counts). A line is *trivial* when it holds
  fewer than two identifiers (Python keywords, literals and punctuation do not count): `return True`, `else:`,
  `break`, `return out`, `if n == 1:` say nothing a contract does not.
- **no three statements**: each logical statement of the solution (a compound statement is its header line)
  becomes its sequence of identifiers; statements with fewer than two are dropped as trivial. No window of three
  consecutive statements (of all of them, when the solution has fewer) may appear in the text in order, each
  statement's identifiers contiguous in the text's identifier stream (prose words count as identifiers, so
  "remove req from self.running" does not spell `self.running.remove(req)`).
Level 3 (pseudo-code) is exempt, but it must not parse as Python and must not hold a non-trivial solution line.
"""
from __future__ import annotations

import ast
import io
import json
import keyword
import re
import subprocess
import sys
import textwrap
import tokenize

import nbformat
import pytest

from lab_utils import hints
from lab_utils.course import learner_copies
from lab_utils.hint_texts import HINTS

LABS = sorted((learner_copies.REPO_ROOT / "labs").glob("*.ipynb"))
_KEYWORDS = set(keyword.kwlist)
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ------------------------------------------------------------------------------------------ the measure
def identifiers(code: str) -> list[str]:
    return [w for w in _WORD_RE.findall(code) if w not in _KEYWORDS and w != "_"]


def code_line_identifiers(line: str) -> list[str]:
    """Identifiers of one line of code (string literals and comments left out)."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return identifiers(line.split("#", 1)[0])
    return [t.string for t in toks if t.type == tokenize.NAME and t.string not in _KEYWORDS and t.string != "_"]


def solution_lines(body: str) -> list[str]:
    """The non-trivial lines of a solution (comment and blank lines dropped, trailing comments cut)."""
    out = []
    for line in body.split("\n"):
        code = _strip_comment(line).strip()
        if code and len(code_line_identifiers(code)) >= 2:
            out.append(code)
    return out


def _strip_comment(line: str) -> str:
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line
    for t in toks:
        if t.type == tokenize.COMMENT:
            return line.strip()[:t.start[1]]
    return line


def statements(body: str) -> list[list[str]]:
    """Identifier sequences of the solution's logical statements, in order; the trivial ones dropped."""
    out, cur = [], []
    for t in tokenize.generate_tokens(io.StringIO(textwrap.dedent(body) + "\n").readline):
        if t.type == tokenize.NAME and t.string not in _KEYWORDS and t.string != "_":
            cur.append(t.string)
        elif t.type in (tokenize.NEWLINE, tokenize.ENDMARKER) or (t.type == tokenize.OP and t.string == ":"
                                                                    and _ends_header(t)):
            if len(cur) >= 2:
                out.append(cur)
            cur = []
    return out


def _ends_header(tok) -> bool:
    """A `:` at the end of a physical line closes a compound statement's header (`for x in y:`)."""
    return tok.line.rstrip().endswith(":") and tok.end[1] == len(tok.line.rstrip())


def _find(seq: list[str], stream: list[str], start: int) -> int:
    """End of the first contiguous occurrence of `seq` in `stream` at or after `start`; -1 if none."""
    n = len(seq)
    for i in range(start, len(stream) - n + 1):
        if stream[i:i + n] == seq:
            return i + n
    return -1


def distance_problems(text: str, body: str) -> list[str]:
    """Why `text` is too close to the solution `body` (empty when it keeps its distance)."""
    problems = []
    squeezed = re.sub(r"\s+", "", text)
    for line in solution_lines(body):
        if re.sub(r"\s+", "", line) in squeezed:
            problems.append(f"holds the solution line {line!r}")
    stmts, stream = statements(body), identifiers(text)
    k = min(3, len(stmts))
    for w in range(len(stmts) - k + 1) if k else ():
        pos = 0
        for seq in stmts[w:w + k]:
            pos = _find(seq, stream, pos)
            if pos < 0:
                break
        else:
            problems.append("spells out statements " + " / ".join(" ".join(s) for s in stmts[w:w + k]))
    return problems


# --------------------------------------------------------------------------- the exercises of the labs
def _exercises():
    """(id, solution body, texts the learner reads before asking: name -> text) for every exercise."""
    out = []
    for path in LABS:
        nb = nbformat.read(path, as_version=4)
        lab = learner_copies.lab_number(path.name)
        for i in learner_copies.exercise_cells(nb):
            src = nb.cells[i].source
            before = next((nb.cells[j].source for j in range(i - 1, -1, -1) if nb.cells[j].cell_type == "markdown"),
                          "")
            docs = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(src))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            lines = src.split("\n")
            for r in learner_copies.find_regions(src):
                ex_id = learner_copies.exercise_id(lab, src, r)
                body = "\n".join(lines[r.start + 1:r.end])
                out.append((ex_id, body, {"markdown": before, "docstrings": "\n".join(docs),
                                          "NotImplementedError": r.hint}))
    return out


EXERCISES = _exercises()
IDS = [e[0] for e in EXERCISES]


def test_every_exercise_has_an_id_and_three_levels_of_hints():
    assert all(IDS), "every solution region is a function's body, so it has an id"
    assert len(set(IDS)) == len(IDS), f"exercise ids repeat: {sorted(i for i in IDS if IDS.count(i) > 1)}"
    assert set(IDS) == set(HINTS), (f"no hints for {sorted(set(IDS) - set(HINTS))}; "
                                    f"hints for no exercise {sorted(set(HINTS) - set(IDS))}")
    for ex_id, levels in HINTS.items():
        assert len(levels) == 3 and all(t.strip() for t in levels), ex_id
        assert len(set(levels)) == 3, f"{ex_id}: each level says something new"
    assert {i.split(".")[0] for i in IDS} == {p.name[:2] for p in LABS}, "every lab has an exercise with hints"


@pytest.mark.parametrize("ex_id, body, texts", EXERCISES, ids=IDS)
def test_first_hint_and_exercise_text_keep_their_distance(ex_id, body, texts):
    checked = dict(texts, **{"hint level 1": HINTS[ex_id][0]})
    problems = [f"{name}: {p}" for name, text in checked.items() for p in distance_problems(text, body)]
    assert not problems, f"{ex_id} gives its code away (state the contract instead):\n" + "\n".join(problems)


@pytest.mark.parametrize("ex_id, body, texts", EXERCISES, ids=IDS)
def test_pseudo_code_is_not_the_solution_in_python(ex_id, body, texts):
    text = HINTS[ex_id][2]
    with pytest.raises(SyntaxError):
        ast.parse(textwrap.dedent(text))
    squeezed = re.sub(r"\s+", "", text)
    copied = [line for line in solution_lines(body) if re.sub(r"\s+", "", line) in squeezed]
    assert not copied, f"{ex_id}: level 3 copies solution lines {copied}"


# ----------------------------------------------------------------------- the measure catches a giveaway
GROW = '''\
missing = self.blocks_needed(num_tokens) - len(req.block_table)
if missing > self.num_free_blocks:
    return False
for _ in range(missing):
    req.block_table.append(self.take_block())
return True'''
MAKE_ROOM = '''\
while not self.bm.grow(req, num_tokens):
    victim = self.running[-1]
    self.preempt(victim)
    out.preempted.append(victim)
    if victim is req:
        return False
return True'''
PREEMPT = '''\
self.running.remove(req)
self.num_preemptions += 1
req.metrics.preemptions += 1
self.bm.free(req)
req.num_computed_tokens = 0
req.status = Status.WAITING
self.waiting.appendleft(req)'''


def test_the_measure_flags_hints_that_recite_the_code():
    old_grow = ("Hint: missing = self.blocks_needed(num_tokens) - len(req.block_table); if missing > "
                "self.num_free_blocks return False before touching anything; else append self.take_block() "
                "`missing` times and return True")
    old_make_room = ("Hint: loop while not self.bm.grow(req, num_tokens): victim = self.running[-1]; "
                     "self.preempt(victim); out.preempted.append(victim); if victim is req: return False.")
    paraphrased = "until self.bm.grow(req, num_tokens) works: victim is self.running's last; self preempt victim"
    assert any("solution line" in p for p in distance_problems(old_grow, GROW))
    assert any("spells out" in p for p in distance_problems(old_make_room, MAKE_ROOM))
    assert [p for p in distance_problems(paraphrased, MAKE_ROOM) if "solution line" in p] == []
    assert any("spells out" in p for p in distance_problems(paraphrased, MAKE_ROOM)), "paraphrased code is code"
    assert distance_problems("x = 1\nself.bm.free(req)", PREEMPT) == ["holds the solution line 'self.bm.free(req)'"]
    contract = ("Afterwards the request is off the batch, holds no blocks, has nothing computed, and is the "
                "first to be admitted again; both preemption counters went up by one.")
    assert distance_problems(contract, PREEMPT) == []
    assert solution_lines("return True\nelse:\nbreak\nreturn out  # done\nreturn hash((a, b))") == [
        "return hash((a, b))"]


# ----------------------------------------------------------------------------- asking, counting, stats
def test_hint_prints_the_level_and_counts_the_request(tmp_path, monkeypatch, capsys):
    log = tmp_path / "hints.json"
    monkeypatch.setenv("LAB_HINTS_LOG", str(log))
    hints.hint("02.grow")
    hints.hint("02.grow", 3)
    hints.hint("02.grow", 3)
    hints.hint("04.evict", 2)
    said = capsys.readouterr().out
    assert " ".join(HINTS["02.grow"][0].split()) in " ".join(said.split())  # level 1 is wrapped to the screen
    assert HINTS["02.grow"][2] in said and 'hint("02.grow", 2)' in said  # pseudo-code keeps its lines
    assert json.loads(log.read_text()) == {"02.grow": {"1": 1, "3": 2}, "04.evict": {"2": 1}}
    table = hints.hints_table(log).splitlines()
    assert table[1].split() == ["02.grow", "1", "0", "2", "3"] and table[-1].split()[-1] == "4"


def test_unknown_exercise_or_level_is_refused_with_the_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_HINTS_LOG", str(tmp_path / "hints.json"))
    with pytest.raises(ValueError, match=r"no exercise '02\.gorw'.*02\.grow.*13\.advance_matcher"):
        hints.hint("02.gorw")
    with pytest.raises(ValueError, match="the levels are 1"):
        hints.hint("02.grow", 4)
    assert not (tmp_path / "hints.json").exists(), "a refused request is not counted"


def test_stats_reports_hints_asked_and_keeps_its_thresholds(tmp_path):
    out = tmp_path / "student"
    out.mkdir()
    (out / hints.LOG_NAME).write_text(json.dumps({"01.stop_reason": {"1": 2, "2": 1}}))

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "lab_utils", "student", "--stats", "--out", str(out), *extra],
                              check=False, capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in __import__("os").environ.items() if k != "LAB_HINTS_LOG"})

    ok = cli("--min-total", "120", "--max-exercise", "40")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "labs 00-04" in ok.stdout and "hints asked" in ok.stdout
    row = next(line for line in ok.stdout.splitlines() if line.startswith("01.stop_reason"))
    assert row.split() == ["01.stop_reason", "2", "1", "0", "3"]
    assert cli("--min-total", "100000").returncode == 1
    (out / hints.LOG_NAME).unlink()
    assert "none asked yet" in cli().stdout


def test_learner_copy_says_how_to_ask_for_a_hint(tmp_path):
    learner_copies.write_student_copies(learner_copies.REPO_ROOT / "labs", tmp_path, quiet=True)
    copy = nbformat.read(tmp_path / "02_paged_kv_cache.ipynb", as_version=4)
    cell = next(c.source for c in copy.cells if "def grow(" in c.source)
    lines = cell.split("\n")
    i = next(k for k, line in enumerate(lines) if "raise NotImplementedError" in line)
    assert lines[i - 1] == learner_copies.hint_line("    ", "02.grow")
    ns: dict = {}
    exec(compile(lines[i - 1].split("# Stuck? ", 1)[1].split(";")[0], "<hint line>", "exec"), ns)
    assert ns["hint"] is hints.hint
    text = "\n".join(c.source for p in LABS for c in nbformat.read(tmp_path / p.name, as_version=4).cells)
    ids = re.findall(r'hint\("([0-9]{2}\.\w+)"\) gives', text)
    assert sorted(ids) == sorted(IDS)
