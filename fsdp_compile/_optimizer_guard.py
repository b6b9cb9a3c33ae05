"""A guard against an optimizer built before ``shard()``: it holds the parameters ``shard()`` replaced, so it
would train nothing. Its first ``step()`` raises instead; and warns where its weight decay reaches no weight matrix
(``_param_groups``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_compile._param_groups import warn_if_no_matrix_decays

__all__ = ["mark_replaced", "watch_optimizers"]

_REPLACED_ATTR = "_fsdp_compile_replaced"
"""On an original parameter that shard() replaced: its name."""

_optimizer_hook: RemovableHandle | None = None
_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def mark_replaced(param: torch.nn.Parameter, name: str, by: str = "shard()") -> None:
    """Record that ``by`` (``shard()``, or ``to_empty()`` of a model sharded on meta) replaced ``param`` (named
    ``name``) by a sharded piece."""
    setattr(param, _REPLACED_ATTR, (name, by))


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: refuse to step an optimizer that holds parameters shard() replaced."""
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            replaced = getattr(param, _REPLACED_ATTR, None)
            if replaced is not None:
                name, by = replaced
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {name!r} as it was before {by} replaced it with a "
                    f"sharded piece, so this optimizer would train nothing: build the optimizer after {by}, from "
                    "model.parameters() (or model.named_parameters())"
                )
    warn_if_no_matrix_decays(optimizer)
    _checked_optimizers.add(optimizer)


def watch_optimizers() -> None:
    """Install the guard (once per process) on every optimizer's ``step()``."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)
