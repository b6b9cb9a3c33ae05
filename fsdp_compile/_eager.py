"""Eager mode (no torch.compile): each unit's :class:`EagerUnit` gathers it around its forward and reshards
it after forward through saved-tensor hooks.

The protocol (who may free a gathered buffer, when it is gathered again): [Note: eager gather and reshard]
in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fsdp_compile._internals import counters
from fsdp_compile.debug import degraded

__all__ = ["EagerUnit", "live_gathers"]

live_gathers: dict[int, EagerUnit] = {}
"""Storage address of each unit's gathered buffer while its forward runs -> the unit's eager state."""


class _SavedView:
    """What autograd keeps, in eager mode, instead of a view of a gathered unit: where the view was. The
    unit is gathered again when backward first needs it (reshard after forward)."""

    __slots__ = ("__weakref__", "unit", "offset", "shape", "stride", "release")

    def __init__(self, unit: EagerUnit, tensor: torch.Tensor) -> None:
        self.unit = unit
        self.offset = tensor.storage_offset()
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        with unit._lock:
            unit._pending += 1
        # A view that is never unpacked (no backward) still releases the unit when autograd drops it.
        self.release = weakref.finalize(self, unit._release_regathered)


def _pack(tensor: torch.Tensor) -> torch.Tensor | _SavedView:
    try:
        unit = live_gathers.get(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (subclasses, sparse)
        degraded("eager_saved_whole", f"eager mode saved a {type(tensor).__name__} with layout {tensor.layout} "
                 "for backward as it is (no plain storage to tell whether it views a gathered unit): a unit it "
                 "views stays gathered until backward")
        return tensor
    # Not the tensor itself: a saved output would then hold its own grad_fn through autograd's C++ saved
    # variable, a cycle the garbage collector cannot see, and a graph whose backward never runs (a forward
    # that raised, a loss never backpropagated) would never be freed. Its data, without autograd history,
    # is all backward reads.
    return _SavedView(unit, tensor) if unit is not None else tensor.detach()


def _unpack(saved: torch.Tensor | _SavedView) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    return saved.unit._unpack(saved)


class EagerUnit:
    """The eager-mode state of one unit, held by the unit (``UnitState.eager``).

    ``gather`` all-gathers the unit (differentiable, cast to ``param_dtype``); ``version`` tells whether the
    shard changed since (its tensor version: an optimizer step bumps it); ``backward`` is told when backward
    first needs the unit. All may be weak (return None once the unit's state is gone). ``reshard``: drop the gathered buffer after the unit's forward and gather
    again in backward (off for units kept gathered, and for a group of one rank, whose "gather" is the shard
    itself)."""

    def __init__(
        self,
        gather: Callable[[], torch.Tensor | None],
        version: Callable[[], int | None],
        backward: Callable[[], None],
        *,
        reshard: bool,
    ) -> None:
        self._gather = gather
        self._version = version
        self._backward = backward
        self._reshard = reshard
        self.gathered: torch.Tensor | None = None
        """The gathered unit while the unit's forward runs."""
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._regathered: torch.Tensor | None = None
        self._regathered_version = -1
        self._pending = 0
        # `_pending` and `_regathered` change on the forward thread (packing), autograd's threads (unpacking)
        # and wherever the garbage collector releases a saved view; reentrant: a collection can run a
        # release while this thread unpacks.
        self._lock = threading.RLock()

    @property
    def regathered(self) -> torch.Tensor | None:
        """The unit gathered again in backward, while saved views of it are still to be unpacked."""
        return self._regathered

    @property
    def pending(self) -> int:
        """Saved views of the unit that backward has not unpacked yet."""
        return self._pending

    def _gather_now(self) -> torch.Tensor:
        gathered = self._gather()
        if gathered is None:  # the unit's state is gone: it is held weakly (see UnitState)
            raise RuntimeError(
                "fsdp_compile: backward needs a unit of a sharded model deleted since its forward: keep the model "
                "until its backward has run"
            )
        return gathered

    def param(self, offset: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A parameter of the unit: a view of the buffer its forward gathered, or of one gathered for it."""
        gathered = self.gathered if self.gathered is not None else self._gather_now()
        return gathered[offset : offset + numel].view(shape)

    def pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self._gather_resharded()

    def _gather_resharded(self) -> None:
        """Gather the unit for its forward; saved views of it are gathered again in backward (``_SavedView``)."""
        self.gathered = self._gather_now()
        if self._reshard:
            live_gathers[self.gathered.untyped_storage().data_ptr()] = self
            self._hooks.append(torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))
            self._hooks[-1].__enter__()

    def _drop_gathered(self) -> None:
        """Drop the gathered unit (and the saved-tensor hooks of ``_gather_resharded``, if it installed them)."""
        if self._hooks:
            self._hooks.pop().__exit__(None, None, None)
            del live_gathers[self.gathered.untyped_storage().data_ptr()]  # type: ignore[union-attr]
        self.gathered = None

    @contextlib.contextmanager
    def gathered_for_forward(self, *, resharded: bool = False) -> Iterator[None]:
        """The unit gathered while its ``forward`` runs outside its ``__call__``, whose hooks gather it: Hugging
        Face's gradient checkpointing recomputes ``forward`` in backward. Differentiable (a reentrant checkpoint
        backpropagates through the recompute); no saved-tensor hooks (the checkpoint's own hold what the recompute
        saves, and with them the buffer, until backward has used it). ``resharded``: as the hooks do, saved views
        of the buffer gathered again in backward (a forward compiled in pieces: ``_apply_shard._gathered_forward``)."""
        if self.gathered is not None:
            yield
            return
        counters["fsdp_compile"]["eager_forward_gathers"] += 1
        if resharded:
            self._gather_resharded()
        else:
            self.gathered = self._gather_now()
        try:
            yield
        finally:
            self._drop_gathered()

    def post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and self.gathered is not None:
            self._drop_gathered()

    def _unpack(self, saved: _SavedView) -> torch.Tensor:
        # Gathered again for this backward, unless a gather of the same shard version is still held. Views
        # of a forward that raised are only released when the garbage collector finds them: until then
        # `_pending` stays above zero and the buffer outlives its backward, so it may be stale.
        self._backward()
        with self._lock:
            version = self._version()
            if self._regathered is None or self._regathered_version != version:
                with torch.no_grad():
                    self._regathered = self._gather_now()
                self._regathered_version = version
                counters["fsdp_compile"]["eager_regathers"] += 1
            tensor = self._regathered.as_strided(saved.shape, saved.stride, saved.offset)
            if saved.release.detach() is not None:
                self._release_regathered()
            elif self._pending == 0:  # unpacked again (retain_graph): do not keep the unit gathered
                self._regathered = None
            return tensor

    def _release_regathered(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._regathered = None
