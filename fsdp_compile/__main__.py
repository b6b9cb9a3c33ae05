"""``python -m fsdp_compile explain DIR [--trace FILE]`` (also the console script ``fsdp-compile``): what the
compiler did, from the folder ``FSDP_COMPILE_DUMP=DIR`` wrote (:mod:`fsdp_compile.explain`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from fsdp_compile import explain
from fsdp_compile._pictures import read_trace


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_compile", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("explain", help=explain.__doc__.split("\n\n")[0])
    command.add_argument("dump", help="the folder FSDP_COMPILE_DUMP (or backend(dump=...)) wrote")
    command.add_argument("--trace", help="a profiler's Chrome trace (torch.profiler's export_chrome_trace)")
    args = parser.parse_args(argv)
    try:
        dump = explain.load(args.dump)
    except FileNotFoundError as e:
        print(f"fsdp_compile explain: {e}", file=sys.stderr)
        return 2
    if not any(dump.graphs.values()):
        print(f"fsdp_compile explain: {args.dump} holds no compiled graph with FSDP units: was the model sharded "
              "with fsdp_compile.shard() and compiled with the fsdp_compile backend?", file=sys.stderr)
        return 2
    if args.trace and not os.path.exists(args.trace):
        print(f"fsdp_compile explain: no trace file {args.trace}", file=sys.stderr)
        return 2
    trace = read_trace(args.trace) if args.trace else None
    lines = [explain.report(dump, trace)]
    for name, svg in explain.pictures(dump, trace).items():
        (dump.root / name).write_text(svg)
        lines.append(f"wrote {dump.root / name}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # the reader stopped early (``| head``): the pictures are written all the same
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
