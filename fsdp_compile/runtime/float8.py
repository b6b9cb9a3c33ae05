"""Float8 all-gather: a unit of torchao ``Float8Linear`` weights (tensorwise scaling, ``enable_fsdp_float8_all_gather``)
gathered as float8 bytes, as torchao gathers them for FSDP2 ([Note: float8 all-gather] in docs/architecture.md).

``cast_all_gather_float8(shard, accum, start, ..., weights)`` is the unit's collective pair as one autograd function.
Forward: each weight's amax over this rank's part of the shard, one MAX all-reduce of them over the group, torchao's
scale ``finfo.max / clamp(amax.double(), 1e-12)`` in float32, the shard cast to float8 with its weights' scales, its
bytes all-gathered, and each weight handed out as torchao's ``Float8TrainingTensor`` (so torchao's matmul casts it no
more, in forward or backward). Backward: the weights' gradients (in ``param_dtype``) laid out as the unit's flat
gradient and averaged as ``cast_all_gather_differentiable`` averages it. ``start`` is where this rank's shard begins
in the unit (a 0-d integer tensor): the graphs of all ranks stay the same, only this input differs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsdp_compile._internals import c10d_functional as _c10d
from fsdp_compile.runtime.ops import GradReduction, _Collectives, _reduce, all_gather_nograd, copy_to_device, wait

__all__ = ["Float8Weight", "cast_all_gather_float8", "float8_weight"]


class Float8Weight(NamedTuple):
    """How torchao casts one ``Float8Linear`` weight: its place in the unit, the float8 dtype, its ``LinearMMConfig``
    (as nested tuples: graph arguments are plain values) and whether scales are rounded down to powers of 2."""

    offset: int
    numel: int
    shape: tuple[int, ...]
    float8_dtype: torch.dtype
    mm_config: tuple[tuple[bool, ...], ...]
    round_scales_to_power_of_2: bool


def _scales(shard: torch.Tensor, index: torch.Tensor, weights: tuple[Float8Weight, ...], how: _Collectives
            ) -> torch.Tensor:
    """Each weight's scale (float32, one per weight) from its amax over the whole group (torchao's arithmetic);
    ``index``: each shard element's place in the unit."""
    from torchao.float8.float8_utils import amax_to_scale

    magnitude = shard.abs()
    amax = torch.stack([
        torch.where((index >= w.offset) & (index < w.offset + w.numel), magnitude, 0).amax() for w in weights])
    if how.world_size > 1:
        amax = wait(_c10d.all_reduce(amax, "max", how.group_name), how.group_name)
    return torch.stack([amax_to_scale(amax[j], w.float8_dtype, w.round_scales_to_power_of_2)
                        for j, w in enumerate(weights)])


def _cast(shard: torch.Tensor, index: torch.Tensor, scales: torch.Tensor, weights: tuple[Float8Weight, ...]
          ) -> torch.Tensor:
    """The shard in float8, each element scaled by its weight's scale (padding: by the weight before it; zeros)."""
    from torchao.float8.float8_utils import to_fp8_saturated

    scale = scales[0]
    for j, w in enumerate(weights[1:], 1):
        scale = torch.where(index >= w.offset, scales[j], scale)
    return to_fp8_saturated(shard.to(torch.float32) * scale, weights[0].float8_dtype)


class _GatherFloat8Unit(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, shard: torch.Tensor, accum: torch.Tensor | None, start: torch.Tensor, how: _Collectives,
        weights: tuple[Float8Weight, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.shard_dtype, ctx.how = shard.dtype, how
        ctx.accumulate_unsharded = accum is not None
        if how.device is not None:  # CPU offload: cast on the device the unit computes on, from the shard's dtype
            shard = copy_to_device(shard, how.device, shard.dtype)
        index = torch.arange(shard.numel(), device=shard.device) + start  # each element's place in the unit
        scales = _scales(shard, index, weights, how)
        bits = _cast(shard, index, scales, weights)
        if how.world_size > 1:  # gloo has no float8 dtype: the bytes travel
            bits = all_gather_nograd(bits.view(torch.uint8), how.world_size, how.group_name).view(bits.dtype)
        ctx.mark_non_differentiable(bits, scales)
        return bits, scales, bits.new_zeros((), dtype=how.param_dtype).expand(bits.numel())

    @staticmethod
    def backward(ctx: Any, _bits: None, _scales: None, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The carrier's gradient is the unit's (its weights' gradients laid out flat, zeros elsewhere): averaged."""
        return (*_reduce(ctx, grad.to(ctx.how.param_dtype)), None, None, None)


class _Float8View(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, carried: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, mm_config: tuple[tuple[bool, ...], ...]
    ) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import (
            Float8TrainingTensor,
            GemmInputRole,
            LinearMMConfig,
            ScaledMMConfig,
        )

        config = LinearMMConfig(*(ScaledMMConfig(*gemm) for gemm in mm_config))
        return Float8TrainingTensor(bits, scale, carried.dtype, config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None, None


def float8_weight(
    carrier: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, index: int, weight: tuple[Any, ...]
) -> torch.Tensor:
    """Weight ``index`` of a float8 gather (``weight``: its :class:`Float8Weight` fields) as torchao's
    ``Float8TrainingTensor``: its part of ``bits`` with its scale; its gradient goes to its part of ``carrier``."""
    w = Float8Weight(*weight)
    part = slice(w.offset, w.offset + w.numel)
    return _Float8View.apply(carrier[part].view(w.shape), bits[part].view(w.shape), scales[index], w.mm_config)


def cast_all_gather_float8(
    shard: torch.Tensor,
    accum: torch.Tensor | None,
    start: torch.Tensor,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    grad_reduction: GradReduction,
    world_size: int,
    group_name: str,
    replicas: int,
    replicate_group_name: str | None,
    device: torch.device | None,
    weights: tuple[tuple[Any, ...], ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather one unit of float8 weights (``weights``: :class:`Float8Weight` fields, in the unit's order) as float8
    bytes: (the gathered unit in float8, the weights' scales, the carrier), which :func:`float8_weight` makes into
    weights. The carrier, ``param_dtype`` zeros of the unit's size that take no memory (one element, expanded), is
    what the weights' gradients flow to: its gradient is averaged as ``cast_all_gather_differentiable`` averages a
    unit's (the other arguments are its own); ``start``: this rank's first element of the unit."""
    how = _Collectives(
        param_dtype, reduce_dtype, grad_reduction, world_size, group_name, replicas,
        replicate_group_name if replicas > 1 else None, device,
    )
    return _GatherFloat8Unit.apply(shard, accum, start, how, tuple(Float8Weight(*w) for w in weights))
