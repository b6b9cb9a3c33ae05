"""The trace analysis behind the GPU overlap test and the benchmark's columns (CPU, synthetic traces)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fsdp_compile.testing.profile import communication_overlap, trace_steps


def _kernel(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start}


def _write_trace(folder: "os.PathLike[str]", events: list[dict]) -> str:
    path = os.path.join(folder, "trace.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_communication_overlap_splits_the_timeline(tmp_path: "os.PathLike[str]") -> None:
    events = [
        _kernel("ncclDevKernel_AllGather_RING_LL", 0, 10_000),  # us; half of it beside the first matmul
        _kernel("nvjet_gemm", 5_000, 15_000),
        _kernel("triton_poi_fused", 20_000, 30_000),  # after 5 ms with nothing running
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40_000},  # host: not GPU time
    ]
    path = _write_trace(tmp_path, events)
    got = communication_overlap(path, steps=1)
    assert got == pytest.approx({"comm": 10.0, "exposed": 5.0, "overlapped": 5.0, "compute": 20.0, "host_copy": 0.0,
                                "host_copy_exposed": 0.0, "idle": 5.0})
    assert communication_overlap(path, steps=2)["compute"] == pytest.approx(10.0)


def test_the_copy_engine_collectives_barriers_are_communication(tmp_path: "os.PathLike[str]") -> None:
    """A symmetric-memory barrier spins on the side stream until the peers reach it: time waiting for the
    collective, not compute (counted as compute, it hid the copy-engine route's exposed waits)."""
    events = [
        _kernel("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)", 0, 4_000),
        _kernel("Memcpy PtoP (Device -> Device)", 4_000, 6_000),
        _kernel("nvjet_gemm", 5_000, 8_000),
    ]
    path = _write_trace(tmp_path, events)
    got = communication_overlap(path, steps=1)
    assert got == pytest.approx({"comm": 6.0, "exposed": 5.0, "overlapped": 1.0, "compute": 3.0, "host_copy": 0.0,
                                "host_copy_exposed": 0.0, "idle": 0.0})


def test_copies_between_host_and_device_are_counted_apart_with_their_exposed_part(
        tmp_path: "os.PathLike[str]") -> None:
    """CPU offload's step split: its copies are neither compute nor communication; exposed where no kernel runs."""
    events = [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 6_000},
        _kernel("nvjet_gemm", 4_000, 10_000),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 9_000, "dur": 3_000},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 20_000, "dur": 1_000},
    ]
    got = communication_overlap(_write_trace(tmp_path, events), steps=1)
    assert got == pytest.approx({"comm": 0.0, "exposed": 0.0, "overlapped": 0.0, "compute": 7.0, "host_copy": 9.0,
                                 "host_copy_exposed": 6.0, "idle": 8.0})


def test_trace_steps_leaves_the_warm_up_step_out(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(tmp_path, "trace.json")

    def step(i: int) -> None:
        with torch.profiler.record_function(f"step_{i}"):
            torch.ones(8).sum()

    trace_steps(step, 2, path, host=True)
    with open(path) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"step_1", "step_2"} <= names and "step_0" not in names
