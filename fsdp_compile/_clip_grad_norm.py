"""Gradient clipping over the whole sharded model: the global norm, summed over every rank of each unit's
group, then every rank scales its pieces' gradients by the same factor.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a sharded model sees only this rank's
pieces: each rank would clip with the norm of its own shard (a different factor per rank, and not the
model's norm). Call :func:`clip_grad_norm_` instead.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile._step_in_backward import refuse_inside_step_in_backward
from fsdp_compile._unit import sharded_units

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of a module sharded by ``fsdp_compile.shard()`` to a total norm of ``max_norm``,
    in place, and return the total norm of the gradients before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` does for an unsharded model (same arguments, same result).

    A collective: every rank of the units' process group calls it, after backward and before
    ``optimizer.step()``. The norm of each unit is summed over its group (one all-reduce per group); a
    parameter that is no piece of a unit (e.g. added after ``shard()``) counts as replicated, once."""
    refuse_inside_step_in_backward(sharded_units(module), "clip_grad_norm_", (
        "clipping needs every gradient before any step, and step_in_backward steps each unit as its gradient lands. "
        "Clip without it: backward, clip_grad_norm_, optimizer.step()"))
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type}")
    by_group: dict[dist.ProcessGroup, tuple[torch.device, list[torch.Tensor]]] = {}
    pieces = set()
    for unit in sharded_units(module):  # every rank has the same units: the same all-reduces
        _, grads = by_group.setdefault(unit.group, (unit.compute_device, []))  # offload: host grads, device sums
        for piece in unit.pieces:
            pieces.add(piece.param)
            if piece.param.grad is not None and piece.param.grad.numel():  # a rank's piece may be empty
                grads.append(piece.param.grad)
    replicated = [p.grad for p in module.parameters() if p not in pieces and p.grad is not None and p.grad.numel()]
    parts = [_norm_part(grads, device, norm_type, foreach, group) for group, (device, grads) in by_group.items()]
    parts.append(_norm_part(replicated, parts[0].device, norm_type, foreach, None))
    if norm_type == math.inf:
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot be "
            "clipped; set error_if_nonfinite=False to clip anyway"
        )
    torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, total, foreach=foreach)
    return total


def _norm_part(
    grads: list[torch.Tensor],
    device: torch.device,
    norm_type: float,
    foreach: bool | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """These gradients' share of the total, summed over ``group``: the sum of |g|^p (for inf: the max |g|)."""
    local = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach).to(device)
    if norm_type != math.inf:
        local = local**norm_type
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=group)
    return local
