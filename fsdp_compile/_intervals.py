"""Reading profiler traces: which GPU events communicate, and time intervals (start, end): their union, total
length and overlap."""

from __future__ import annotations

__all__ = ["Intervals", "intersect", "is_communication", "is_host_copy", "length", "union"]

Intervals = list[tuple[float, float]]


def is_communication(kernel_name: str) -> bool:
    """A NCCL kernel, a peer-to-peer copy or a symmetric-memory kernel (the copy-engine collectives' barriers,
    which spin until the peers get there: waiting for communication, not compute), of a GPU trace's kernels and
    copies. Inductor names its own kernels after the ops they fuse, e.g.
    ``triton_poi_fused_all_gather_into_tensor_0``, a cast: not these."""
    low = kernel_name.lower()
    return "nccl" in low or "PtoP" in kernel_name or "symmetric_memory" in low


def is_host_copy(kernel_name: str) -> bool:
    """A copy between host and device memory (CPU offload's transfers; the profiler names them "Memcpy HtoD
    (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)")."""
    return "HtoD" in kernel_name or "DtoH" in kernel_name


def union(intervals: Intervals) -> Intervals:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs: Intervals, ys: Intervals) -> Intervals:
    """The overlap of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if start < end:
            out.append((start, end))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out
