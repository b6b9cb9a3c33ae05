"""Communication/compute overlap read off a profiler trace (Chrome trace JSON of CUDA kernels)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_compile._intervals import intersect, is_communication, is_host_copy, length, union

__all__ = ["communication_overlap", "gpu_activity", "intersect", "is_communication", "length", "outside_allocator_mib",
           "trace_steps", "union"]


def gpu_activity(trace_path: str) -> list[tuple[str, float, float]]:
    """The trace's kernels and copies: (name, start, end), in µs."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [
        (e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]


def outside_allocator_mib() -> float:
    """MiB of GPU memory in use (the driver's count) that the caching allocator does not hold: the CUDA context,
    NCCL's own buffers, symmetric memory. After the GPU's work so far, with the allocator's free blocks returned."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**20


def communication_overlap(trace_path: str, steps: int = 1) -> dict[str, float]:
    """Per step, in ms: ``comm`` (time any NCCL kernel or peer-to-peer copy runs), ``exposed`` (of that,
    the time no other kernel runs), ``overlapped`` (comm - exposed), ``compute`` (time any other kernel
    or device copy runs), ``host_copy`` (time a copy between host and device runs: CPU offload's transfers),
    ``host_copy_exposed`` (of that, the time no kernel runs) and ``idle`` (time between the trace's first and
    last event when none runs: launch gaps, host waits, a host optimizer step)."""
    comm, host_copy, compute = [], [], []
    for name, start, end in gpu_activity(trace_path):
        kind = comm if is_communication(name) else host_copy if is_host_copy(name) else compute
        kind.append((start, end))
    comm_u, host_copy_u, compute_u = union(comm), union(host_copy), union(compute)
    kernels = union(comm_u + compute_u)
    busy = union(kernels + host_copy_u)
    overlapped = length(intersect(comm_u, compute_u))
    total = length(comm_u)
    idle = busy[-1][1] - busy[0][0] - length(busy) if busy else 0.0
    per_step = {"comm": total, "exposed": total - overlapped, "overlapped": overlapped,
                "compute": length(compute_u), "host_copy": length(host_copy_u),
                "host_copy_exposed": length(host_copy_u) - length(intersect(host_copy_u, kernels)), "idle": idle}
    return {k: v / 1e3 / steps for k, v in per_step.items()}


def trace_steps(step: Callable[[int], object], steps: int, path: str, *, host: bool = False) -> None:
    """Run ``step(0)`` .. ``step(steps)`` under the profiler and write the Chrome trace of the last
    ``steps`` to ``path``. The ranks of the default group (if any) start together, and the first step is
    the profiler's warm-up, not traced: a rank that starts late, or the profiler's own start-up, would
    make the trace show kernels waiting instead of the schedule. The GPU finishes the warm-up step before
    tracing starts: the host runs ahead of the GPU, so the warm-up step's kernels would otherwise land in
    the trace (docs/measurements.md, "Profiler warm-up"). ``host``: trace host-side ops too."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if host:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    if dist.is_initialized():
        dist.barrier()
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for i in range(1 + steps):
            step(i)
            if i == 0:
                sync()
            prof.step()
        sync()
    prof.export_chrome_trace(path)
