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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize("all_gather, grad_reduce", [("nccl", "nccl"), ("copy_engine", "nccl"),
                                                     ("copy_engine", "copy_engine")],
                         ids=["nccl", "copy_engine", "copy_engine-exchange"])
def test_a_torchrun_script_with_cuda_graphs_exits_after_destroy_process_group(
    all_gather: str, grad_reduce: str
) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(EXAMPLE),
        "--steps", "3", "--cudagraphs", "--all-gather", all_gather, "--grad-reduce", grad_reduce,
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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
    assert ended - last_step[0] < EXIT_WITHIN_S, f"exited {ended - last_step[0]:.0f} s after its last step"
