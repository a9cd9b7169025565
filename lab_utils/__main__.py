"""The command line: `python -m lab_utils <command> ...`.

Each command lives next to the idea it serves, in a module exposing `register(subparsers)`;
this file only lists them, so adding a command never means editing a long file.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (command, module that defines `register(subparsers)`) -- imported lazily so that
# `python -m lab_utils prepare` does not pay for FastAPI, vLLM or sentence-transformers.
COMMANDS: dict[str, str] = {
    "prepare": "lab_utils.models.prepare",
    "generate": "lab_utils.engine.cli",
    "bench": "lab_utils.bench.cli",
    "run-labs": "lab_utils.labs_runner",
    "student": "lab_utils.course.learner_copies",
    "rag-eval": "lab_utils.rag.cli",
    "serve": "lab_utils.server.cli",
    "grade": "lab_utils.workshop.gradebook",
    "workshop": "lab_utils.workshop.cli",
    "bench-kernel": "lab_utils.checks.bench_kernel",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab_utils", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            # still list it in --help without importing its module
            sub.add_parser(name, help=f"(see `python -m lab_utils {name} --help`)")
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
