"""Choose the route of a graph's all-gathers (``all_gather="auto"``) and of its gradient exchanges
(``grad_reduce="auto"``), once per compiled graph, from what was measured: copy engines over the group sizes where
they were measured faster (``route_measurements.json``, beside this file; docs/measurements.md, "Routes"), NCCL
otherwise. The measured all-gathers spanned every unit's size on one route, so the choice goes by the group's size.

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
from pathlib import Path
from typing import Any, Literal

import torch

from fsdp_compile._internals import MissingTorchFeature, symm_mem

__all__ = ["Collective", "RouteChoice", "Routes", "choose_route", "resolve_routes"]

Direction = Literal["all_gather", "grad_reduce"]
Route = Literal["nccl", "copy_engine"]

_MEASURED = json.loads(Path(__file__).with_name("route_measurements.json").read_text())


def _copy_engines_won(row: dict[str, Any]) -> bool:
    return row["nccl"] is not None and row["copy_engine"] is not None and row["copy_engine"] < row["nccl"]


COPY_ENGINE_RANKS = frozenset(row["ranks"] for row in _MEASURED["rows"] if _copy_engines_won(row))
"""The group sizes whose collectives ``auto`` puts on copy engines, both directions, with or without CUDA graphs:
those where copy engines beat NCCL in a measured step."""


def _evidence(group_sizes: Collection[int]) -> str:
    """Per group size, the first measured step where copy engines beat NCCL, as a reason quotes it."""
    quoted = []
    for size in sorted(set(group_sizes)):
        row = next(r for r in _MEASURED["rows"] if r["ranks"] == size and _copy_engines_won(r))
        graphs = " with CUDA graphs" if row["cudagraphs"] else ""
        quoted.append(f"{size} ranks: {row['copy_engine']} vs {row['nccl']} ms a step{graphs} at "
                      f"{row['tokens_per_gpu']} tokens/GPU")
    return "; ".join(quoted)


def _why_copy_engines(direction: Direction, group_sizes: Collection[int]) -> str:
    if direction == "all_gather":
        return f"copy-engine all-gathers were measured faster ({_evidence(group_sizes)}) and leave the SMs to matmuls"
    saved = [f"{mib} MiB less GPU memory over {size} ranks" for size, mib in
             sorted(_MEASURED["exchange_memory_saved_mib"].items()) if int(size) in set(group_sizes)]
    return ("copy-engine exchanges leave the SMs to the matmuls and need no NCCL all-to-all buffers ("
            + "; ".join([_evidence(group_sizes), *saved]) + ")")


_NOUN = {"all_gather": "all-gathers", "grad_reduce": "gradient exchanges"}


@dataclass(frozen=True)
class RouteChoice:
    route: Route
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def choose_route(direction: Direction, group_sizes: Collection[int], devices: Collection[torch.device]) -> RouteChoice:
    """The route for a graph's all-gathers or gradient exchanges (``direction``), which run over groups of
    ``group_sizes`` ranks on ``devices``."""
    noun = _NOUN[direction]
    if not group_sizes:
        return RouteChoice("nccl", f"no {noun} in this graph")
    if any(d.type != "cuda" for d in devices):
        return RouteChoice("nccl", f"{noun} on {', '.join(sorted({d.type for d in devices}))}: copy engines "
                                   "need CUDA tensors")
    if not set(group_sizes) <= COPY_ENGINE_RANKS:
        over = " and ".join(map(str, sorted(COPY_ENGINE_RANKS)))
        return RouteChoice("nccl", f"groups of {sorted(set(group_sizes))} ranks: {noun} go on copy engines over "
                                   f"{over} ranks only (not measured over more ranks)")
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
    why = _why_copy_engines(direction, group_sizes)
    return RouteChoice("copy_engine", f"{sorted(set(group_sizes))} ranks on one host with peer access: {why}")


@dataclass(frozen=True)
class Collective:
    """What the routes depend on, of one unit's all-gather over more than one rank."""

    unit: str
    world_size: int
    grad_reduction: str
    """``"reduce_scatter"`` or ``"exchange"`` (gradients in ``param_dtype``, summed wider: an all-to-all)."""
    device: torch.device


@dataclass(frozen=True)
class Routes:
    """The routes of one compiled graph's collectives, resolved once, before the ranks agree on them: each
    option as given, or what ``"auto"`` chose and why (``chosen``)."""

    all_gather: Route
    grad_reduce: Route
    chosen: tuple[tuple[Direction, RouteChoice], ...] = ()

    def describe(self) -> str:
        """The routes as the ranks compare them, where ``"auto"`` chose one ("" otherwise)."""
        return f"{self.all_gather}/{self.grad_reduce}" if self.chosen else ""


def resolve_routes(all_gather: str, grad_reduce: str, memory_plan: bool, collectives: Collection[Collective]) -> Routes:
    """The routes of a graph's ``collectives`` under the options ``all_gather`` and ``grad_reduce`` (``"auto"``:
    :func:`choose_route`); a fixed ``grad_reduce="copy_engine"`` is checked against the units."""
    reduce_scatters = sorted({c.unit for c in collectives if c.grad_reduction == "reduce_scatter"})
    if grad_reduce == "copy_engine" and reduce_scatters:
        raise ValueError(
            f"grad_reduce='copy_engine' runs the gradient exchanges (gradients in param_dtype, summed in "
            f"reduce_dtype) on copy engines, but units {reduce_scatters} reduce-scatter instead (their reduce_dtype "
            "is their param_dtype, or MixedPrecision(exchange_grads_in_param_dtype=False)): use grad_reduce='nccl' "
            "or 'auto' for them"
        )
    exchanges = [c for c in collectives if c.grad_reduction == "exchange"]
    routes: dict[str, str] = {"all_gather": all_gather, "grad_reduce": grad_reduce}
    chosen: list[tuple[Direction, RouteChoice]] = []
    for option, routed in (("all_gather", collectives), ("grad_reduce", exchanges)):
        if routes[option] != "auto":
            continue
        choice = choose_route(option, {c.world_size for c in routed}, {c.device for c in routed})
        if option == "grad_reduce" and choice.route == "copy_engine" and not memory_plan:
            choice = RouteChoice("nccl", "memory_plan=False: no planned slots to push the gradients into")
        routes[option] = choice.route
        chosen.append((option, choice))
    return Routes(routes["all_gather"], routes["grad_reduce"], tuple(chosen))  # type: ignore[arg-type]
