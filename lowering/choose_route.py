"""Choose the route of a graph's all-gathers (``all_gather="auto"``) and of its gradient exchanges
(``grad_reduce="auto"``), once per compiled graph, from what was measured.

Measured (0.95B Llama-style model, bf16 compute; step ms; benchmarks/NOTES.md, the run in the last column;
"mixed": NCCL all-gathers with copy-engine gradient exchanges; **bold**: the fastest; 3 runs where marked):

| GPUs | tokens/GPU | CUDA graphs | NCCL both ways | mixed | copy engines both ways | run |
|---|---|---|---|---|---|---|
| 2 H100 | 4096 | no | 61.9 (3 runs) | - | **59.0** (3 runs; the all-gathers) | 22 |
| 2 H200 | 4096 | no | 56.2 (3 runs) | - | **51.9** (3 runs) | 47 |
| 2 H200 | 4096 | yes | 57.1 | 54.6 | **53.1** | 49 |
| 2 H200 | 1024 | yes | 25.6 | 23.0 | **21.4** | 48 |
| 4 H200 | 4096 | no | - | 54.0 (3 runs) | **52.7** (3 runs) | 53 |
| 4 H200 | 1024 | yes | 24.5 | - | **19.9**; 19.5 in run 54 | 52 |
| 4 H200 | 1024 | no | 45.9 | **42.7** | 45.9; 42.2 in run 54 | 55 |

Over 2 ranks the copy engines win (one peer copy per all-gather, the SMs left to the matmuls). At 1024
tokens/GPU without CUDA graphs every route is host-bound (31-48 ms to enqueue a step of 16-22 ms of compute)
and the spread of such steps hides the routes: the same graphs took 40.6 and 51.5 ms in run 48. Over 4 ranks
the copy engines lost to NCCL until experiment 23 (runs 29, 38, 40, 51: 29.3 vs 25.2 ms at 1024 with CUDA
graphs, run 51): every rank copied from its peers in rank order, so all of them read rank 0 first; in ring
order, one copy after another (``fsdp_compile._slots.ring_order``), a block's all-gather takes 0.25 ms against
0.45 before and NCCL's 0.28, and slows the matmuls beside it 1.06-1.09x against NCCL's 1.24-1.54x
(``benchmarks/gemm_contention.py``, run 53).
The copy-engine exchanges also need no NCCL all-to-all buffers: over 4 ranks **1214 MiB** less GPU memory
outside the allocator (``tests/test_gpu_overlap.py``, experiment 20). Over more ranks: not measured, NCCL. The
measured all-gathers were 4 KB (the root unit) to 131 MB, every unit on the same route, so the choice goes by
the group's size, not the collective's.

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

COPY_ENGINE_RANKS = frozenset({2, 4})
"""The group sizes whose collectives ``auto`` puts on copy engines, both directions, with or without CUDA graphs
(the tables above)."""

_WHY = {
    "all_gather": ("all-gathers", "not measured over more ranks",
                   "copy-engine all-gathers were measured faster (2 ranks: 59.0 vs 61.9 ms a step at 4096 tokens/GPU; "
                   "4 ranks, with the exchanges on copy engines too: 19.9 vs 24.5 ms with CUDA graphs at 1024) and "
                   "leave the SMs to the matmuls"),
    "grad_reduce": ("gradient exchanges", "not measured over more ranks",
                    "copy-engine exchanges leave the SMs to the matmuls and need no NCCL all-to-all buffers (over 4 "
                    "ranks: 19.9 vs 24.5 ms a step with CUDA graphs at 1024 tokens/GPU, the all-gathers on copy "
                    "engines too; 1214 MiB less GPU memory)"),
}
"""Per direction: what its collectives are called, why not more ranks, why copy engines."""


@dataclass(frozen=True)
class RouteChoice:
    route: Literal["nccl", "copy_engine"]
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def choose_route(direction: Direction, group_sizes: Collection[int], devices: Collection[torch.device]) -> RouteChoice:
    """The route for a graph's all-gathers or gradient exchanges (``direction``), which run over groups of
    ``group_sizes`` ranks on ``devices``."""
    noun, fewer, faster = _WHY[direction]
    if not group_sizes:
        return RouteChoice("nccl", f"no {noun} in this graph")
    if any(d.type != "cuda" for d in devices):
        return RouteChoice("nccl", f"{noun} on {', '.join(sorted({d.type for d in devices}))}: copy engines "
                                   "need CUDA tensors")
    if not set(group_sizes) <= COPY_ENGINE_RANKS:
        over = " and ".join(map(str, sorted(COPY_ENGINE_RANKS)))
        return RouteChoice("nccl", f"groups of {sorted(set(group_sizes))} ranks: {noun} go on copy engines over "
                                   f"{over} ranks only ({fewer})")
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
