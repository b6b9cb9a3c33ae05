"""The suite's time against its budget: reads the durations the last ``python -m pytest`` left (tests/conftest.py
writes ``.test-durations.json``) and prints the slowest files, each worker's busy time and the run's wall time
against the budget docs/testing.md states. Exits 1 over budget, 2 without a record. Not a test: the suite asserts
behaviour, never a timing.

    python tests/budget.py [--top N] [--record PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / ".test-durations.json"
DOC = ROOT / "docs" / "testing.md"
QUICK = "not slow and not ranks"
"""The quick subset's marker expression (docs/testing.md)."""
BUDGET = re.compile(r"<!-- budget: (?P<full>\d+) s full, (?P<quick>\d+) s quick -->")


def budgets(doc: pathlib.Path = DOC) -> dict[str, int]:
    """The budgets docs/testing.md states, in seconds of pytest's wall time: ``full`` (the README's command) and
    ``quick`` (``-m QUICK``)."""
    found = BUDGET.search(doc.read_text())
    if found is None:
        raise SystemExit(f"{doc} states no budget: it needs a line '<!-- budget: N s full, M s quick -->'")
    return {k: int(v) for k, v in found.groupdict().items()}


def report(record: dict, budget: dict[str, int], top: int) -> tuple[str, bool]:
    """The table and whether the run is within its budget (the quick one for the quick subset)."""
    files: dict[str, float] = collections.defaultdict(float)
    workers: dict[str, float] = collections.defaultdict(float)
    for nodeid, test in record["tests"].items():
        files[nodeid.split("::")[0]] += test["seconds"]
        workers[test["worker"]] += test["seconds"]
    args = " ".join(record["args"])
    kind = {None: "full", QUICK: "quick"}.get(record["selection"])
    outcomes = collections.Counter(test["outcome"] for test in record["tests"].values())
    lines = [f"{record['date']}: python -m pytest {args} on {record['cpus']} CPUs, torch {record['torch']}: "
             + ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
             + f"; exit status {record['exit_status']}",
             f"{'seconds':>8}  {'share':>5}  file (slowest {top})"]
    total = sum(files.values())
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{seconds:8.1f}  {seconds / total:5.1%}  {name}")
    lines.append("busy: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())) + f" (sum {total:.0f} s)")
    wall = record["wall_seconds"]
    if kind is None:
        lines.append(f"wall {wall:.0f} s: a selection of the suite, no budget applies (run the README's command)")
        return "\n".join(lines), True
    if record.get("inductor_cache_warm"):
        lines.append(f"wall {wall:.0f} s with Inductor's cache warm from an earlier run: the {kind} budget is for empty "
                     "caches, as in CI's fresh clone (TMPDIR or TORCHINDUCTOR_CACHE_DIR a new folder), no verdict")
        return "\n".join(lines), True
    within = wall <= budget[kind]
    lines.append(f"wall {wall:.0f} s of the {kind} budget {budget[kind]} s: "
                 + ("within" if within else f"OVER by {wall - budget[kind]:.0f} s: make a test cheaper or merge "
                    "(docs/testing.md, 'The budget')"))
    return "\n".join(lines), within


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=12, help="how many of the slowest files to print")
    parser.add_argument("--record", type=pathlib.Path, default=RECORD, help="the durations to read")
    args = parser.parse_args()
    if not args.record.exists():
        print(f"no record at {args.record}: run `python -m pytest` first", file=sys.stderr)
        return 2
    text, within = report(json.loads(args.record.read_text()), budgets(), args.top)
    print(text)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
