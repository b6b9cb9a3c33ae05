"""Plots from train_bench.py's JSON files: step time vs tokens per GPU (median over the runs, the range as
error bars), and peak memory bars (CUDA-graph systems hatched: ``max_memory_allocated`` leaves out their
graphs' pool, so those bars are not comparable; the JSON's ``reserved_gib`` counts it).

    python benchmarks/plot.py benchmarks/results/bench_*.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import Result, points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="train_bench.py --out files (points are merged)")
    parser.add_argument("--out", default=".", help="folder for step_time.png and memory.png")
    args = parser.parse_args()
    results, meta = [], {}
    for path in args.json:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        results += [Result(**{"repeat": 0, **r}) for r in data["results"]]
    sweep = points(results)
    systems = list(dict.fromkeys(row.system for point in sweep for row in point.rows))
    title = f"{meta['model']} Llama, {meta['world_size']}x {meta['card']}, torch {meta['torch']}"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        rows = [(p.tokens_per_gpu, row) for p in sweep for row in p.rows if row.system == system]
        x = [t for t, _ in rows]
        y = [row.step_ms for _, row in rows]
        err = [[row.step_ms - row.step_range[0] for _, row in rows], [row.step_range[1] - row.step_ms for _, row in rows]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=system)
    tight = [(p.tokens_per_gpu, p.tight_bound_ms()) for p in sweep if p.tight_bound_ms() is not None]
    if tight:
        ax.plot([t for t, _ in tight], [ms for _, ms in tight], "k--", label="tight bound (local fwd+bwd + 1/world optimizer)")
    ax.set(xscale="log", yscale="log", xlabel="tokens per GPU", ylabel="step time (ms, median over runs)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "step_time.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        rows = {p.tokens_per_gpu: row for p in sweep for row in p.rows if row.system == system}
        comparable = all(r.peak_comparable for row in rows.values() for r in row.runs)
        label = system if comparable else f"{system} (CUDA graphs: pool not counted, not comparable)"
        peaks = [(rows[p.tokens_per_gpu].median("peak_gib") or 0.0) if p.tokens_per_gpu in rows else 0.0 for p in sweep]
        ax.bar([j + i * width for j in range(len(sweep))], peaks, width, label=label, hatch=None if comparable else "//")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sweep))], [str(p.tokens_per_gpu) for p in sweep])
    ax.set(xlabel="tokens per GPU", ylabel="peak memory (GiB, max_memory_allocated)", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "memory.png"), dpi=120)


if __name__ == "__main__":
    main()
