"""Eager mode (no torch.compile): reshard after forward through saved-tensor hooks.

While a unit's forward runs, its gathered buffer is registered here; autograd then saves, instead of a
view of that buffer, a ``_SavedView`` (where the view was). The unit is dropped after its forward, and
gathered again once when backward first unpacks one of its views; the re-gathered buffer is dropped when
its last saved view has been unpacked (or garbage collected, if backward never runs).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch._dynamo.utils import counters

if TYPE_CHECKING:
    from fsdp_compile._shard import UnitState

__all__ = ["live_gathers", "pack", "unpack"]


class _SavedView:
    """What autograd keeps, in eager mode, instead of a view of a gathered unit: where the view was. The
    unit is gathered again when backward first needs it (reshard after forward)."""

    __slots__ = ("__weakref__", "state", "offset", "shape", "stride", "release")

    def __init__(self, state: UnitState, tensor: torch.Tensor) -> None:
        self.state = state
        self.offset = tensor.storage_offset()
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        state._pending += 1
        # A view that is never unpacked (no backward) still releases the unit when autograd drops it.
        self.release = weakref.finalize(self, state._release_regathered)


live_gathers: dict[int, UnitState] = {}
"""Eager mode: storage address of each unit's gathered buffer while its forward runs -> the unit."""


def pack(tensor: torch.Tensor) -> torch.Tensor | _SavedView:
    try:
        state = live_gathers.get(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (subclasses, sparse)
        return tensor
    return _SavedView(state, tensor) if state is not None else tensor


def unpack(saved: torch.Tensor | _SavedView) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    state = saved.state
    if state._regathered is None:
        with torch.no_grad():
            state._regathered = state.gather()
        counters["fsdp_compile"]["eager_regathers"] += 1
    tensor = state._regathered.as_strided(saved.shape, saved.stride, saved.offset)
    if saved.release.detach() is not None:
        state._release_regathered()
    elif state._pending == 0:  # unpacked again (retain_graph): do not keep the unit gathered
        state._regathered = None
    return tensor
