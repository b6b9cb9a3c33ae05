"""What a sharded module is made of: its units, their sizes and settings, and the full parameter count
(``sum(p.numel() for p in model.parameters())`` counts only this rank's shard); and keeping buffers, which
are not sharded, in sync across ranks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile._layout import unit_label
from fsdp_compile._unit import UnitState, sharded_units

__all__ = ["ShardingSummary", "UnitSummary", "describe", "sync_buffers"]


@dataclass(frozen=True)
class UnitSummary:
    fqn: str
    """The unit's module."""
    name: str
    """How plans and graphs name it: its fqn, then ``[part]`` for one parameter group of a unit with several."""
    num_parameters: int
    """Elements of the unit's parameters (each tied weight once)."""
    padded_numel: int
    shard_numel: int
    """Elements each rank holds (padding included)."""
    param_dtype: str
    gather_dtype: str
    """What its all-gather moves under compile: ``param_dtype``, or float8 for torchao's float8 weights."""
    gather_bytes: int
    """Bytes each rank sends in its all-gather (its shard, in ``gather_dtype``)."""
    reduce_dtype: str
    grad_reduction: str
    reshard_after_forward: bool


@dataclass(frozen=True)
class ShardingSummary:
    world_size: int
    """Ranks each unit is sharded over."""
    replicas: int
    """HSDP: how many copies of that sharding there are (1: none)."""
    num_parameters: int
    """Elements of the whole model's parameters, as the unsharded model counts them."""
    num_local_parameters: int
    """Elements of this rank's pieces (what ``sum(p.numel() for p in model.parameters())`` gives)."""
    units: tuple[UnitSummary, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def __str__(self) -> str:
        lines = [
            f"{len(self.units)} units over {self.world_size} ranks"
            + (f" x {self.replicas} replicas (HSDP)" if self.replicas > 1 else "")
            + f": {self.num_parameters:,} parameters "
            f"({self.num_local_parameters:,} on this rank)",
            "| unit | parameters | per rank | param dtype | gathered as | reduce dtype | gradient reduction | reshard |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {unit_label(u.name)} | {u.num_parameters:,} | {u.shard_numel:,} | {u.param_dtype} | {gathered(u)} | "
            f"{u.reduce_dtype} | {u.grad_reduction} | {u.reshard_after_forward} |"
            for u in self.units
        ]
        return "\n".join(lines)


def gathered(unit: UnitSummary | dict[str, Any]) -> str:
    """A unit's all-gather in a table: its dtype and the bytes each rank sends."""
    u = unit if isinstance(unit, dict) else asdict(unit)
    if "gather_dtype" not in u:  # a dump from before float8 all-gathers
        return str(u["param_dtype"])
    return f"{u['gather_dtype']}, {u['gather_bytes']:,} B a rank"


def _summary(u: UnitState) -> UnitSummary:
    return UnitSummary(
        fqn=u.layout.fqn,
        name=u.layout.name,
        num_parameters=sum(slot.numel for slot in u.layout.slots),
        padded_numel=u.layout.padded_numel,
        shard_numel=u.layout.shard_numel,
        param_dtype=str(u.param_dtype),
        gather_dtype=str(u.gather_dtype),
        gather_bytes=u.layout.shard_numel * u.gather_dtype.itemsize,
        reduce_dtype=str(u.reduce_dtype),
        grad_reduction=u.grad_reduction if u.trainable else "none (frozen)",
        reshard_after_forward=u.reshard_after_forward,
    )


def units_json(units: Iterable[UnitState]) -> str:
    """The unit table of a compiled graph (each unit once, in the order given) as JSON: the artifact
    ``fsdp_compile_units``, which ``python -m fsdp_compile explain`` reads."""
    unique = {id(u): u for u in units}.values()
    return json.dumps([{**asdict(_summary(u)), "world_size": u.world_size, "replicas": u.replicas,
                        "parameters": [name for slot in u.layout.slots for name in slot.names]} for u in unique])


def describe(module: nn.Module) -> ShardingSummary:
    """The units of a module ``shard()`` has sharded, with their sizes, and the full parameter count."""
    units = sharded_units(module)
    summaries = tuple(_summary(u) for u in units)
    return ShardingSummary(
        world_size=units[0].world_size,
        replicas=units[0].replicas,
        num_parameters=sum(s.num_parameters for s in summaries),
        num_local_parameters=sum(p.numel() for p in module.parameters()),
        units=summaries,
    )


@torch.no_grad()
def sync_buffers(module: nn.Module, *, average: bool = False) -> None:
    """Make the module's buffers (not sharded: each rank keeps its own, as with FSDP2, e.g. BatchNorm's
    running statistics) equal on every rank of the units' group and, with HSDP, of its replicas: rank 0's
    values (``average=False``, as DDP broadcasts them), or, for floating-point buffers, their mean over the
    ranks (``average=True``; other buffers: rank 0's). A collective: call it on every rank, e.g. before
    evaluation or a checkpoint."""
    for group in sharded_units(module)[0].groups:  # HSDP: within each replica, then across the replicas
        for buffer in module.buffers():
            if average and buffer.is_floating_point():
                dist.all_reduce(buffer, group=group)
                buffer.div_(dist.get_world_size(group))
            else:
                dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
