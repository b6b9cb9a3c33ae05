"""A torchrun script that trains with CUDA graphs and ends with ``destroy_process_group()`` exits (2 GPUs).

It used to hang there on every rank: a live CUDA graph that captured NCCL kernels keeps their communicator
in use, and NCCL's teardown waits for it (``fsdp_compile._internals.release_cuda_graphs``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"
EXIT_WITHIN_S = 30


ROUTES = pytest.mark.parametrize(
    "all_gather, grad_reduce", [("nccl", "nccl"), ("copy_engine", "nccl"), ("copy_engine", "copy_engine")],
    ids=["nccl", "copy_engine", "copy_engine-exchange"],
)


def _train_with_cuda_graphs(all_gather: str, grad_reduce: str, env: dict[str, str] | None = None) -> float:
    """Run the example with CUDA graphs on 2 GPUs; check it printed its parity line and exited 0; return how
    long after that line it exited (s)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE),
        "--steps", "3", "--cudagraphs", "--all-gather", all_gather, "--grad-reduce", grad_reduce,
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[tuple[float, str]] = []  # (when it was read, the line)
    stdout = proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in stdout))
    reader.start()
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    ended = time.monotonic()
    output = "".join(line for _, line in lines)
    last_step = [t for t, line in lines if line.startswith("parity vs unsharded")]
    assert last_step, output[-3000:]
    assert "OK" in output and proc.returncode == 0, output[-3000:]
    return ended - last_step[0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@ROUTES
def test_a_torchrun_script_with_cuda_graphs_exits_after_destroy_process_group(
    all_gather: str, grad_reduce: str, tmp_path: Path
) -> None:
    """Run twice with one Inductor cache: the second run loads its graphs from the caches (no pass runs), so
    each memory-plan slab is reserved at a graph's first run, inside the CUDA graphs' warm-up: it must not land
    in their memory pool (``_internals.outside_graph_pools``; it did on torch 2.11 for the NCCL route), and that
    run must train and exit as the first did."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for run in ("first", "second"):
        exited_after = _train_with_cuda_graphs(all_gather, grad_reduce, env)
        assert exited_after < EXIT_WITHIN_S, f"the {run} run exited {exited_after:.0f} s after its last step"
        assert any((tmp_path / "fxgraph").iterdir()), "the first run wrote nothing to Inductor's FX graph cache"
