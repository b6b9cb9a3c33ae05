"""Weight decay by the parameters' own shapes: after ``shard()`` every parameter the optimizer sees is a 1-D piece, so
the usual grouping by ``p.dim() >= 2`` (nanoGPT's, many training scripts') would decay nothing. ``decay_groups`` builds
those groups from each piece's whole shape; the optimizer guard warns where a step finds the trap."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fsdp_compile._unit import SHAPE_ATTR, full_shape

__all__ = ["decay_groups", "warn_if_no_matrix_decays"]


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The usual two parameter groups of ``module``'s trainable parameters: weight decay on the matrices (the weights
    of two or more dimensions, by :func:`full_shape`), none on the rest (biases, norms' scales); for any optimizer,
    ``torch.optim.AdamW(fsdp_compile.decay_groups(model, 0.1), lr=...)``. Sharded or not."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if len(full_shape(p)) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if len(full_shape(p)) < 2], "weight_decay": 0.0},
    ]


def warn_if_no_matrix_decays(optimizer: torch.optim.Optimizer) -> None:
    """Warn if ``optimizer`` asks for weight decay but its decaying groups hold none of the sharded matrices it trains,
    which all sit in groups without it: the ``p.dim() >= 2`` grouping of 1-D pieces."""
    groups = [(group.get("weight_decay", 0.0) > 0, p) for group in optimizer.param_groups for p in group["params"]]
    matrices = [(decays, p) for decays, p in groups if hasattr(p, SHAPE_ATTR) and len(full_shape(p)) >= 2]
    asked = any(group.get("weight_decay", 0.0) > 0 for group in optimizer.param_groups)
    if asked and matrices and not any(decays for decays, _ in matrices):
        warnings.warn(
            f"fsdp_compile: {type(optimizer).__name__} decays none of the {len(matrices)} weight matrices of the "
            "sharded model: its groups with weight_decay > 0 hold none, all sit in groups without it. After shard() "
            "every parameter is a 1-D piece of its unit's shard, so a grouping by p.dim() >= 2 puts them all in the "
            "no-decay group: group by fsdp_compile.full_shape(p) (the whole parameter's shape), or build the groups "
            "with fsdp_compile.decay_groups(model, weight_decay)",
            UserWarning, stacklevel=3,
        )
