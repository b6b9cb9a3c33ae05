"""The two ops the passes work with (and a unit of torchao's float8 weights: ``fsdp_compile.runtime.float8``).

* ``fsdp_compile::unshard`` — a marker, never executed: under ``torch.compile`` every read of a sharded
  parameter becomes one call ``unshard(flat_shard, accum, offset, numel, shape, dtype, device, start)`` (``device``:
  where the parameter is computed on, the shard's own or, with CPU offload, the one it is copied to; ``start``: for a
  unit gathered as float8, where this rank's shard begins in it, ``fsdp_compile.runtime.float8``). The backend's
  ``insert_collectives`` pass replaces all markers of one unit by ONE all-gather
  (``cast_all_gather_differentiable``) and a view per parameter. A marker that survives means the graph was
  compiled by another backend.
* ``cast_all_gather_differentiable(shard, accum, ...)`` — the unit's collective pair as one autograd
  function: forward casts the flat shard to ``param_dtype`` and all-gathers it; backward averages the
  gradient over the group in ``reduce_dtype`` and casts it back to the shard's dtype. ``grad_reduction``
  says how: ``"reduce_scatter"`` in ``reduce_dtype``, or ``"exchange"`` (``reduce_dtype`` wider than the
  gradient's ``param_dtype``): the gradient is exchanged in ``param_dtype`` and each rank sums its parts in
  ``reduce_dtype``, the same sums at a fraction of the bytes. Its body uses only ``_c10d_functional`` ops,
  so AOTAutograd traces it into the forward and backward graphs.
  With ``accum`` (a full-size leaf tensor in ``reduce_dtype``; gradient sync switched off), backward does
  no collective: the full gradient goes to ``accum`` and autograd accumulates it there across
  micro-batches; ``shard`` gets none (see ``set_requires_gradient_sync``).
  HSDP (``replicas`` > 1: the unit is sharded over its group and replicated over a second group of
  ``replicas`` ranks): the reduced gradient shard is then averaged over the replicas (an all-reduce in
  ``reduce_dtype``), so every replica holds the average over all ranks.
  CPU offload (``device``: the device the unit computes on, its shard in host memory): the shard is copied there
  first (``copy_to_device``), and the reduced gradient back to the host (``copy_to_host``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fsdp_compile._internals import c10d_functional as _c10d
from fsdp_compile.runtime import gloo_wait, host_copies

__all__ = [
    "GradReduction",
    "KEEP_GATHERED",
    "all_gather_nograd",
    "all_reduce_avg",
    "all_to_all_avg",
    "cast_all_gather_differentiable",
    "copy_to_device",
    "copy_to_host",
    "reduce_scatter_avg",
    "unshard",
    "wait",
]

GradReduction = Literal["reduce_scatter", "exchange"]
"""How a unit's gradient is averaged over its group: a reduce-scatter in ``reduce_dtype``, or an all-to-all
in the gradient's own dtype followed by each rank's sum of its parts in ``reduce_dtype``."""

KEEP_GATHERED = "fsdp_compile.keep_gathered"
"""Key in a ``cast_all_gather_differentiable`` node's ``meta["custom"]`` (which tracing copies onto the nodes
it becomes): the unit is not resharded after forward."""



def wait(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """``wait_tensor`` of a functional collective's output. Run eagerly over gloo, where a wait in flight cannot be
    aborted, the group's failure channel waits instead: a failure on another rank ends it (``RankFailed``).
    Traced (compiled graphs), it is ``wait_tensor`` itself."""
    if type(tensor) is torch.Tensor and tensor.device.type == "cpu" and gloo_wait.wait(tensor, group_name):
        return tensor
    return _c10d.wait_tensor(tensor)


def all_gather_nograd(tensor: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Functional all-gather of a 1-D tensor along dim 0, waited for; no cast. Not for autograd: call it
    under ``torch.no_grad()`` or inside an autograd function."""
    return wait(_c10d.all_gather_into_tensor(tensor, world_size, group_name), group_name)


def reduce_scatter_avg(tensor: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Functional reduce-scatter (average over the group) of a 1-D tensor along dim 0, waited for."""
    return wait(_c10d.reduce_scatter_tensor(tensor.contiguous(), "avg", world_size, group_name), group_name)


def all_reduce_avg(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Functional all-reduce (average over the group), waited for."""
    return wait(_c10d.all_reduce(tensor, "avg", group_name), group_name)


def all_to_all_avg(tensor: torch.Tensor, reduce_dtype: torch.dtype, world_size: int, group_name: str) -> torch.Tensor:
    """What ``reduce_scatter_avg(tensor.to(reduce_dtype))`` computes, with ``tensor`` sent in its own dtype:
    every rank sends each other rank that rank's part of ``tensor`` (all-to-all), then averages the parts it
    received in ``reduce_dtype`` (each part divided by the world size, then summed in rank order). Bitwise
    equal for 2 ranks; for more, NCCL's ring may sum in another order (rounding of ``reduce_dtype`` only)."""
    part = tensor.numel() // world_size
    splits = [part] * world_size
    parts = wait(_c10d.all_to_all_single(tensor.contiguous(), splits, splits, group_name), group_name)
    return (parts.view(world_size, part).to(reduce_dtype) / world_size).sum(0)  # NCCL's avg: scale, then sum


_NOT_OUR_GRAPH = (
    "a sharded parameter was read inside a graph that the fsdp_compile backend did not compile; compile the model "
    "with torch.compile(model, backend='fsdp_compile') (or backend=fsdp_compile.backend(...)); a block compiled on its "
    "own likewise: torch.compile(block, backend='fsdp_compile')"
)


@torch.library.custom_op("fsdp_compile::unshard", mutates_args=())
def unshard(
    flat: torch.Tensor, accum: torch.Tensor | None, offset: int, numel: int, shape: list[int], dtype: torch.dtype,
    device: torch.device, start: torch.Tensor | None = None,
) -> torch.Tensor:
    raise RuntimeError(_NOT_OUR_GRAPH)


@unshard.register_fake
def _(
    flat: torch.Tensor, accum: torch.Tensor | None, offset: int, numel: int, shape: list[int], dtype: torch.dtype,
    device: torch.device, start: torch.Tensor | None = None,
) -> torch.Tensor:
    return flat.new_empty(shape, dtype=dtype, device=device)


def _unshard_backward(ctx: Any, grad: torch.Tensor) -> None:
    """Another backend traced a training step through a marker (AOTAutograd calls this while it traces backward):
    the same message as the marker's at run time, not autograd's "no autograd formula was registered"."""
    raise RuntimeError(_NOT_OUR_GRAPH)


unshard.register_autograd(_unshard_backward)


@torch.library.custom_op("fsdp_compile::copy_to_device", mutates_args=())
def copy_to_device(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """CPU offload: a unit's shard copied from host memory to ``device``, cast to ``dtype`` (the parameters'),
    asynchronously (on the current stream: what reads it is ordered after it). Moves the narrower dtype's bytes where
    the shard has a current host copy in it (``fsdp_compile.runtime.host_copies``). Always a new tensor (on CPU the
    copy stands for the transfer)."""
    return host_copies.copy_to_device(host, device, dtype)


@copy_to_device.register_fake
def _(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(host, device=device, dtype=dtype)


@torch.library.custom_op("fsdp_compile::copy_to_host", mutates_args=())
def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """CPU offload: a reduced gradient copied to host memory (pinned when it comes from a GPU), on a side stream,
    overlapping the rest of backward; ready when backward returns, or earlier for whoever waits for it
    (``fsdp_compile.runtime.host_copies``)."""
    return host_copies.copy_to_host(tensor)


@copy_to_host.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@dataclass(frozen=True)
class _Collectives:
    """A unit's collective settings, as ``_GatherUnit`` keeps them for its backward."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_reduction: GradReduction
    world_size: int
    group_name: str
    replicas: int
    replicate_group_name: str | None
    device: torch.device | None
    """CPU offload: the device the shard is copied to (its gradient back from); None: not offloaded."""


class _GatherUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, accum: torch.Tensor | None, how: _Collectives) -> torch.Tensor:  # type: ignore[override]
        ctx.shard_dtype = shard.dtype
        ctx.how = how
        ctx.accumulate_unsharded = accum is not None
        if how.device is not None:
            shard = copy_to_device(shard, how.device, how.param_dtype)
        if how.world_size == 1:  # one rank: offloaded, or replicated only (HSDP with a shard dimension of one rank)
            return shard.to(how.param_dtype, copy=how.device is None)
        return all_gather_nograd(shard.to(how.param_dtype), how.world_size, how.group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*_reduce(ctx, grad), None)


def _reduce(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A gathered unit's gradient (full, flat) averaged as ``ctx.how`` says: (the shard's gradient, the accumulator's)."""
    how: _Collectives = ctx.how
    if ctx.accumulate_unsharded:
        return None, grad.to(how.reduce_dtype)
    if how.world_size == 1:
        reduced = grad.to(how.reduce_dtype)
    elif how.grad_reduction == "exchange":
        reduced = all_to_all_avg(grad, how.reduce_dtype, how.world_size, how.group_name)
    else:
        reduced = reduce_scatter_avg(grad.to(how.reduce_dtype), how.world_size, how.group_name)
    if how.replicate_group_name is not None:
        reduced = all_reduce_avg(reduced, how.replicate_group_name)
    reduced = reduced.to(ctx.shard_dtype)
    return (reduced if how.device is None else copy_to_host(reduced)), None


def cast_all_gather_differentiable(
    shard: torch.Tensor,
    accum: torch.Tensor | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    grad_reduction: GradReduction,
    world_size: int,
    group_name: str,
    replicas: int = 1,
    replicate_group_name: str | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """All-gather one unit's flat shard, cast to ``param_dtype``. Differentiable: gradients are averaged over
    the group in ``reduce_dtype`` (by ``grad_reduction``), then over the ``replicas`` (HSDP: the group named
    ``replicate_group_name``), and reach ``shard`` in its own dtype, or, with ``accum``, reach ``accum``
    unreduced. One rank, not replicated: no collective. ``device``: CPU offload, the host shard copied there
    first (``copy_to_device``), its reduced gradient copied back (``copy_to_host``)."""
    if world_size == 1 and replicas == 1 and accum is None and device is None:
        return shard.to(param_dtype)
    how = _Collectives(
        param_dtype, reduce_dtype, grad_reduction, world_size, group_name, replicas,
        replicate_group_name if replicas > 1 else None, device,
    )
    return _GatherUnit.apply(shard, accum, how)
