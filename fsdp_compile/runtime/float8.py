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

__all__ = ["Float8Weight", "cast_all_gather_float8"]


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
    ) -> tuple[torch.Tensor, ...]:
        from torchao.float8.float8_training_tensor import (
            Float8TrainingTensor,
            GemmInputRole,
            LinearMMConfig,
            ScaledMMConfig,
        )

        ctx.shard_dtype, ctx.how, ctx.weights = shard.dtype, how, weights
        ctx.accumulate_unsharded = accum is not None
        ctx.padded_numel = shard.numel() * how.world_size
        if how.device is not None:  # CPU offload: cast on the device the unit computes on, from the shard's dtype
            shard = copy_to_device(shard, how.device, shard.dtype)
        index = torch.arange(shard.numel(), device=shard.device) + start  # each element's place in the unit
        scales = _scales(shard, index, weights, how)
        bits = _cast(shard, index, scales, weights)
        if how.world_size > 1:  # gloo has no float8 dtype: the bytes travel
            bits = all_gather_nograd(bits.view(torch.uint8), how.world_size, how.group_name).view(bits.dtype)
        return tuple(
            Float8TrainingTensor(
                bits[w.offset : w.offset + w.numel].view(w.shape), scales[j], how.param_dtype,
                LinearMMConfig(*(ScaledMMConfig(*gemm) for gemm in w.mm_config)), GemmInputRole.WEIGHT,
            )
            for j, w in enumerate(weights)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The weights' gradients (a weight nothing read gets zeros: autograd materializes them) laid out as the
        unit's flat gradient, zeros in the padding, and averaged."""
        weights: tuple[Float8Weight, ...] = ctx.weights
        parts, end = [], 0
        for w, grad in zip(weights, grads):
            parts += [grad.new_zeros(w.offset - end), grad.reshape(-1)]
            end = w.offset + w.numel
        parts.append(grads[0].new_zeros(ctx.padded_numel - end))
        return (*_reduce(ctx, torch.cat(parts).to(ctx.how.param_dtype)), None, None, None)


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
) -> tuple[torch.Tensor, ...]:
    """All-gather one unit of float8 weights (``weights``: :class:`Float8Weight` fields, in the unit's order) as float8
    bytes; each weight comes back as a ``Float8TrainingTensor`` of ``param_dtype``. Gradients as
    ``cast_all_gather_differentiable``'s (the other arguments are its own); ``start``: this rank's first element of the
    unit."""
    how = _Collectives(
        param_dtype, reduce_dtype, grad_reduction, world_size, group_name, replicas,
        replicate_group_name if replicas > 1 else None, device,
    )
    return _GatherFloat8Unit.apply(shard, accum, start, how, tuple(Float8Weight(*w) for w in weights))
