"""Choose the route of a graph's all-gathers (``all_gather="auto"``) and of its gradient exchanges
(``grad_reduce="auto"``), once per compiled graph, from what was measured.

All-gathers, measured on H100s with NVLink (0.95B Llama-style model, bf16 compute; benchmarks/NOTES.md, runs 19,
22, 23, 28-30; "both": the gradient exchanges on copy engines too):

| ranks | tokens/GPU | NCCL | copy engines | NCCL + CUDA graphs | copy engines + CUDA graphs | both + CUDA graphs |
|---|---|---|---|---|---|---|
| 2 | 4096 | 61.9 ms | **59.0** | 61.6 | **59.0** | - |
| 2 | 1024 | 46.6 | 47.8 | 31.3 (30.1) | 28.2 (28.8) | **(26.2, 25.9)** |
| 4 | 4096 | **61.9** (61.3) | 64.2 | - | - | - |
| 4 | 1024 | **50.0** | 51.6 | **29.2** (28.0) | 32.1 (30.4) | (29.8) |

(step ms, median of 3 runs on 2 GPUs, one run on 4; in brackets single runs of runs 28-30, each against its
own run only: over 4 ranks the peer copies then ran on one stream per peer, and both on copy engines without
CUDA graphs took 78.6 ms at 4096, host-bound.) Over 2 ranks the copy engines win (one peer copy per
all-gather, the SMs left to the matmuls) or tie (1024 without CUDA graphs: runs of 36.5-54.6 ms against
45.6-48.1, a launch-bound step); over 4 each all-gather is 3 peer copies and two barriers, and NCCL wins.
The measured all-gathers were 4 KB (the root unit) to 131 MB, every unit on the same route, so the choice
goes by the group's size, not the collective's.

Gradient exchanges: over 2 ranks on copy engines with the all-gathers (1024 + CUDA graphs the fastest route,
runs 28 and 30; at 4096 within the runs' spread, runs 26-28). Over 4 ranks, without CUDA graphs, on copy
engines beside NCCL all-gathers (run 45, 4 H200s, 4096 tokens/GPU, one run): 55.1 ms a step against NCCL's
55.4, forward+backward 52.8 against 55.7, **32.7 ms of host time against 50.9** (NCCL's all-to-all over 4
ranks is SendRecv kernels on the SMs, and costs host time), and no NCCL all-to-all buffers: **1214 MiB** less
GPU memory outside the allocator (``tests/test_gpu_overlap.py``, benchmarks/NOTES.md experiments 20-21). With
CUDA graphs over 4 ranks that pairing was not measured: NCCL there (both on copy engines + CUDA graphs were
slower than NCCL, run 29).

Anything the copy engines need and cannot be checked for (CUDA tensors, symmetric memory in this torch, every
rank on this host, peer access between its GPUs) falls back to NCCL, with the reason. The ranks then agree on
the routes like on the collectives (``fsdp_compile/_agree.py``): ranks that chose differently raise instead of
waiting for each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from fsdp_compile._internals import MissingTorchFeature, symm_mem

__all__ = ["RouteChoice", "choose_route"]

Direction = Literal["all_gather", "grad_reduce"]

COPY_ENGINE_RANKS: dict[tuple[Direction, bool], frozenset[int]] = {
    ("all_gather", False): frozenset({2}),
    ("all_gather", True): frozenset({2}),
    ("grad_reduce", False): frozenset({2, 4}),
    ("grad_reduce", True): frozenset({2}),
}
"""(direction, CUDA graphs) -> the group sizes whose collectives ``auto`` puts on copy engines (the tables above)."""

_WHY = {
    "all_gather": ("all-gathers", "over 4, NCCL was faster: 61.9 vs 64.2 ms a step at 4096 tokens/GPU",
                   "copy-engine all-gathers were measured faster (59.0 vs 61.9 ms a step at 4096 tokens/GPU; 28.2 "
                   "vs 31.3 ms with CUDA graphs at 1024)"),
    "grad_reduce": ("gradient exchanges", "not measured over more ranks, nor over 4 with CUDA graphs",
                    "copy-engine exchanges leave the SMs to the matmuls and need no NCCL all-to-all buffers (over 4 "
                    "ranks, one run: a step of 55.1 vs 55.4 ms at 4096 tokens/GPU, 32.7 vs 50.9 ms of host time, "
                    "1214 MiB less GPU memory)"),
}
"""Per direction: what its collectives are called, why not more ranks, why copy engines."""


@dataclass(frozen=True)
class RouteChoice:
    route: Literal["nccl", "copy_engine"]
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def choose_route(
    direction: Direction, group_sizes: Collection[int], devices: Collection[torch.device], cudagraphs: bool = False
) -> RouteChoice:
    """The route for a graph's all-gathers or gradient exchanges (``direction``), which run over groups of
    ``group_sizes`` ranks on ``devices``, with or without CUDA graphs."""
    noun, fewer, faster = _WHY[direction]
    if not group_sizes:
        return RouteChoice("nccl", f"no {noun} in this graph")
    if any(d.type != "cuda" for d in devices):
        return RouteChoice("nccl", f"{noun} on {', '.join(sorted({d.type for d in devices}))}: copy engines "
                                   "need CUDA tensors")
    ranks = COPY_ENGINE_RANKS[(direction, cudagraphs)]
    if not set(group_sizes) <= ranks:
        over = " and ".join(map(str, sorted(ranks))) + " ranks" + (" with CUDA graphs" if cudagraphs else "")
        return RouteChoice("nccl", f"groups of {sorted(set(group_sizes))} ranks: {noun} go on copy engines over "
                                   f"{over} only ({fewer})")
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or int(local) < int(world):
        return RouteChoice("nccl", f"cannot tell that every rank is on this host (LOCAL_WORLD_SIZE={local}, "
                                   f"WORLD_SIZE={world}; torchrun sets both): peer copies need one host")
    try:
        symm_mem.module()
    except MissingTorchFeature as e:
        return RouteChoice("nccl", str(e))
    here = torch.cuda.current_device()
    others = [d for d in range(torch.cuda.device_count()) if d != here]
    if not others or not all(torch.cuda.can_device_access_peer(here, d) for d in others):
        return RouteChoice("nccl", f"GPU {here} has no peer access to every other visible GPU ({others})")
    return RouteChoice("copy_engine", f"{sorted(set(group_sizes))} ranks on one host with peer access: {faster}")
