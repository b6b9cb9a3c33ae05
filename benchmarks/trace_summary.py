"""Where a profiled step's time goes, from the benchmark's traces (``train_bench.py --trace-dir``).

    python benchmarks/trace_summary.py TRACE_DIR [--steps 2] [--top 12]

Per trace (one system, point and rank), per step: GPU time by kernel class (matmul, attention, NCCL
all-gather / reduce-scatter, other) and how much of each class ran beside communication (compute slowed
down by communication shows as more time than in the bound's trace), the largest kernels, where the exposed
communication is (the collectives with the most time beside no compute, at their offset from the trace's
first kernel) and the longest gaps with no kernel at all (launch-bound stretches, host waits), and the
largest host-side ops (inclusive time).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from collections import defaultdict
from collections.abc import Iterator

from fsdp_compile.testing.profile import intersect, is_communication, length, union

CLASSES = (
    ("allgather", ("allgather",)),
    ("reducescatter", ("reducescatter",)),
    ("nccl_other", ("nccl",)),
    ("symm_mem_barrier", ("symmetric_memory",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "mm_")),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in CLASSES if any(k in low for k in keys)), "other")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize(path: str, steps: int, top: int) -> Iterator[str]:
    events = [e for e in _load(path) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_communication(e["name"])])
    by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        cls = kernel_class(e["name"])
        by_class[cls][0] += e["dur"]
        by_class[cls][1] += 1
        if not is_communication(e["name"]):
            by_class[cls][2] += length(intersect([(e["ts"], e["ts"] + e["dur"])], comm))
        named = by_name[e["name"][:90]]
        named[0] += e["dur"]
        named[1] += 1
    first = min(e["ts"] for e in kernels)
    last = max(e["ts"] + e["dur"] for e in kernels)
    yield f"== {os.path.basename(path)}: GPU span {(last - first) / 1e3 / steps:.2f} ms/step, {len(kernels) // steps} kernels/step"
    for cls, (dur, n, beside) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
        yield (f"   {cls:14s} {dur / 1e3 / steps:8.2f} ms/step  {int(n) // steps:5d} kernels  "
               f"{beside / 1e3 / steps:6.2f} ms of it beside NCCL")
    yield "   top kernels (ms/step, count/step):"
    for name, (dur, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        yield f"     {dur / 1e3 / steps:7.2f} {int(n) // steps:5d}  {name}"
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_communication(e["name"])])
    exposed = [(e["dur"] - length(intersect([(e["ts"], e["ts"] + e["dur"])], compute)), e) for e in kernels
               if is_communication(e["name"])]
    yield "   most exposed collectives (ms exposed / ms long, at ms from the first kernel):"
    for alone, e in sorted(exposed, key=lambda x: -x[0])[:top]:
        yield f"     {alone / 1e3:6.2f} / {e['dur'] / 1e3:6.2f} at {(e['ts'] - first) / 1e3:7.2f}  {e['name'][:70]}"
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    idle = sorted(((b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:])), reverse=True)
    yield "   longest gaps with no kernel (ms, at ms from the first kernel): " + ", ".join(
        f"{gap / 1e3:.2f} at {(at - first) / 1e3:.2f}" for gap, at in idle[:top])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation", "python_function")]
    own = _self_times(host)
    host_by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for e, alone in zip(host, own):
        named = host_by_name[f"{e.get('cat')}:{e['name'][:70]}"]
        named[0] += e["dur"]
        named[1] += 1
        named[2] += alone
    for title, key in (("inclusive", 0), ("self: less the ops they call", 2)):
        if host_by_name:
            yield f"   host ops, {title} (ms/step, count/step):"
            for name, times in sorted(host_by_name.items(), key=lambda kv: -kv[1][key])[:top]:
                yield f"     {times[key] / 1e3 / steps:7.2f} {int(times[1]) // steps:5d}  {name}"


def _self_times(events: list[dict]) -> list[float]:
    """Each host event's duration less that of the events nested directly inside it on its thread."""
    own = [float(e["dur"]) for e in events]
    by_thread: dict[tuple, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        stack: list[int] = []
        for i in sorted(indices, key=lambda i: (events[i]["ts"], -events[i]["dur"])):
            start = events[i]["ts"]
            while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= start:
                stack.pop()
            if stack:
                own[stack[-1]] -= events[i]["dur"]
            stack.append(i)
    return own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if not os.path.isdir(args.trace_dir):
        parser.error(f"{args.trace_dir} is not a folder (give train_bench.py's --trace-dir)")
    for name in sorted(os.listdir(args.trace_dir)):
        if name.endswith((".json", ".json.gz")):
            for line in summarize(os.path.join(args.trace_dir, name), args.steps, args.top):
                print(line)


if __name__ == "__main__":
    main()
