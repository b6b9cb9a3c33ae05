"""Plots from train_bench.py's JSON files: step time vs tokens per GPU, and peak memory bars.

    python benchmarks/plot.py benchmarks/results/bench_*.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="train_bench.py --out files (points are merged)")
    parser.add_argument("--out", default=".", help="folder for step_time.png and memory.png")
    args = parser.parse_args()
    rows, meta = [], {}
    for path in args.json:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        rows += data["results"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    title = f"{meta['model']} Llama, {meta['world_size']}x {meta['card']}, torch {meta['torch']}"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        points = sorted((r["tokens_per_gpu"], r["median_step_ms"]) for r in rows if r["system"] == system)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
    ax.set(xscale="log", yscale="log", xlabel="tokens per GPU", ylabel="median step time (ms)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "step_time.png"), dpi=120)

    points = sorted({r["tokens_per_gpu"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        peaks = {r["tokens_per_gpu"]: r["peak_gib"] or 0.0 for r in rows if r["system"] == system}
        ax.bar([j + i * width for j in range(len(points))], [peaks.get(p, 0.0) for p in points], width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))], [str(p) for p in points])
    ax.set(xlabel="tokens per GPU", ylabel="peak memory (GiB, max_memory_allocated)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "memory.png"), dpi=120)


if __name__ == "__main__":
    main()
