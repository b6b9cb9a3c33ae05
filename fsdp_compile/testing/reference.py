"""The unsharded single-process reference that sharded training must match."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fsdp_compile._causal_lm import CausalLMLoss
from fsdp_compile._unit import sharded_units

__all__ = ["CausalLMLoss", "assert_bitwise", "full_grads", "micro_batch_step", "reference_step", "rel_error"]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def reference_step(ref: nn.Module, tokens: torch.Tensor, param_dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """Forward and backward of the unsharded ``ref`` (called as ``ref(inputs, targets) -> loss``) on the
    global batch ``tokens``; leaves gradients in the reference's own dtype on ``ref`` and returns the loss.

    Same dtype: one pass over the global batch (what averaging over ranks must equal).
    Mixed precision: what the sharded model computes, in one process: each rank's micro-batch forward and
    backward in ``param_dtype``, gradients cast to the reference dtype and averaged there. Frozen parameters get
    no gradient, as in ``ref``'s own backward.
    """
    dtype = next(ref.parameters()).dtype
    if param_dtype == dtype:
        loss = ref(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.detach()
    low = copy.deepcopy(ref).to(param_dtype)
    losses = []
    for micro in tokens.chunk(world_size):
        loss = low(micro[:, :-1], micro[:, 1:])
        loss.backward()
        losses.append(loss.detach().to(dtype))
        for p, q in zip(ref.parameters(), low.parameters()):
            if q.grad is None:  # frozen
                continue
            grad = q.grad.to(dtype) / world_size
            p.grad = grad if p.grad is None else p.grad + grad
        low.zero_grad()
    return torch.stack(losses).mean()


def micro_batch_step(ref: nn.Module, tokens: torch.Tensor, world_size: int) -> torch.Tensor:
    """Forward and backward of the unsharded ``ref`` on each rank's micro-batch, the gradients averaged and added to
    those the parameters hold (zero them for a step of its own; keep them to accumulate): what the sharded model
    computes. Not one pass over the whole batch, nor ``(loss / world_size).backward()``: Hugging Face's RMSNorm
    computes in float32, so the gradients of a float64 Llama are rounded to float32 there, and scaling before that
    rounding or after it differs by ~1e-7 for 3 ranks (not for 2: exact in binary). Parameters that do not require
    a gradient are left as they are."""
    grads = {p: p.grad for p in ref.parameters() if p.grad is not None}
    ref.zero_grad()
    losses = []
    for micro in tokens.chunk(world_size):
        loss = ref(micro[:, :-1], micro[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        for p in ref.parameters():
            if p.grad is not None:
                grads[p] = grads.get(p, 0) + p.grad / world_size
                p.grad = None
    for p, grad in grads.items():
        p.grad = grad
    return torch.stack(losses).mean()


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full gradient of every parameter of a sharded module, by its first name (a collective)."""
    grads = {}
    for state in sharded_units(module):
        for slot, grad in zip(state.layout.slots, state.all_gather_pieces_nograd(lambda piece: piece.grad, state.flat)):
            grads[slot.names[0]] = grad
    return grads


def assert_bitwise(got: Any, want: Any, where: str = "") -> None:
    """``got`` equals ``want`` bit for bit: nested dicts (same keys, same order), tensors, other values."""
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_bitwise(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    else:
        assert got == want, where
