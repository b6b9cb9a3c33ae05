"""What a refused call must leave as it was: a module's structure, parameters, hooks and values."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

__all__ = ["assert_unchanged", "module_snapshot"]

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def module_snapshot(model: nn.Module) -> list[tuple[Any, ...]]:
    """Per submodule: its name, class, parameter objects (with their shape, dtype and ``requires_grad``), buffer
    objects, hooks and attribute names; then every parameter's and buffer's value (a copy; none on meta or fake)."""
    structure = [
        (name, type(m), dict(m._parameters), dict(m._buffers), sorted(vars(m)),
         [(p.shape, p.dtype, p.requires_grad) for p in m._parameters.values() if p is not None],
         [list(getattr(m, hooks)) for hooks in _HOOKS])
        for name, m in model.named_modules(remove_duplicate=False)
    ]
    values = [(k, v.detach().clone()) for k, v in [*model.named_parameters(), *model.named_buffers()]
              if not v.is_meta and not is_fake(v)]  # no values to compare
    return structure + values


def assert_unchanged(before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]) -> None:
    assert len(before) == len(after)
    for was, now in zip(before, after):
        if isinstance(was[1], torch.Tensor):
            assert was[0] == now[0]
            torch.testing.assert_close(now[1], was[1], rtol=0, atol=0, msg=was[0])
        else:
            assert was == now, was[0]
