"""Full (unsharded) state dicts of a sharded module."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_compile._shard import sharded_units

__all__ = ["full_state_dict"]


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Original parameter and buffer names -> full tensors, on every rank (a collective: call it on all).

    Keys and order are those of ``module.state_dict()`` before sharding; both names of a tied weight map
    to the same tensor, as ``nn.Module.state_dict`` gives them.
    """
    full_params: dict[int, torch.Tensor] = {}
    for state in sharded_units(module):
        gathered = state.gather_full()
        for piece, slot, _, _ in state.pieces:
            full_params[id(piece)] = gathered[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    return {
        key: full_params[id(value)] if id(value) in full_params else value.detach().clone()
        for key, value in module.state_dict(keep_vars=True).items()
    }
