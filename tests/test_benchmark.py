"""Smoke test of the benchmark program: it runs on CPU (2 gloo ranks, tiny model), its loss guard holds and
the plots are drawn from its JSON. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_benchmark_runs_on_cpu_and_all_systems_agree(tmp_path: "os.PathLike[str]") -> None:
    out = os.path.join(tmp_path, "bench.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "benchmarks/train_bench.py",
           "--model", "tiny-untied", "--tokens", "32", "--steps", "3", "--warmup", "1", "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss guard (all systems vs fsdp2_eager, rtol 0.02): OK" in proc.stdout
    assert "| fsdp_compile |" in proc.stdout and "| vs FSDP2 eager |" in proc.stdout
    with open(out) as f:
        data = json.load(f)
    systems = {r["system"] for r in data["results"]}
    assert systems == {"no_comm_bound", "no_comm_bound_cudagraphs", "fsdp2_eager", "fsdp2_compile", "simplefsdp", "fsdp_compile",
                       "fsdp_compile_no_overlap", "fsdp_compile_reduce_scatter", "fsdp_compile_cudagraphs"}
    assert all(len(r["losses"]) == 3 for r in data["results"])
    # Each system is gone before the next one is measured (its memory would count in the next peak).
    assert all(r["extra"]["model_freed"] for r in data["results"]), [r["system"] for r in data["results"]]

    subprocess.run([sys.executable, "benchmarks/plot.py", out, "--out", str(tmp_path)], cwd=ROOT, check=True)
    assert os.path.exists(os.path.join(tmp_path, "step_time.png"))
