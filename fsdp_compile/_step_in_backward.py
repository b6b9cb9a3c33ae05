"""Each unit's optimizer step as soon as its gradient lands in backward, on a host thread of its own.

With CPU offload the optimizer steps on the host, several times longer than the GPU's backward (benchmarks/NOTES.md):
stepping each unit while backward goes on hides backward's share of it. The step of a unit is the user's optimizer
stepped on that unit's parameters alone (its param groups narrowed to them for the call): per-parameter optimizers
(SGD, Adam, AdamW, ...: torch's for-loop, foreach and fused) give the same bits as one step after backward. The
gradients are consumed (set to None) as FSDP2's and torch's optimizer-in-backward do.
"""

from __future__ import annotations

import logging
import queue
import threading
from types import TracebackType

import torch
from torch import nn

from fsdp_compile._layout import unit_label
from fsdp_compile._unit import UnitState, sharded_units
from fsdp_compile.runtime import host_copies

__all__ = ["Stepper", "refuse_inside_step_in_backward", "step_in_backward"]

log = logging.getLogger(__name__)

_DONE = None


class Stepper:
    """The context manager :func:`step_in_backward` returns: steps each unit whose gradient lands inside it."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._units = sharded_units(module)
        self._optimizer = optimizer
        self._queue: queue.SimpleQueue[tuple[UnitState, torch.Tensor] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stepped: list[str] = []
        """The units stepped inside the ``with`` block, in order."""

    def __enter__(self) -> Stepper:
        busy = [u for u in self._units if u.on_gradient is not None]
        if busy:
            raise RuntimeError(
                f"step_in_backward is already active on this model (unit {unit_label(busy[0].layout.name)!r}): one "
                "`with` block at a time"
            )
        syncing_off = [u for u in self._units if not u.requires_gradient_sync and u.trainable]
        if syncing_off:
            raise RuntimeError(
                "step_in_backward: gradient sync is off (set_requires_gradient_sync(model, False)): that backward is "
                "a non-final micro-batch of gradient accumulation, which has no optimizer step. Accumulate without "
                "it and wrap only the last micro-batch's backward, after set_requires_gradient_sync(model, True)"
            )
        for unit in self._units:
            unit.on_gradient = self.landed
        self._thread = threading.Thread(target=self._run, name="fsdp_compile step_in_backward", daemon=True)
        self._thread.start()
        return self

    def landed(self, unit: UnitState, grad: torch.Tensor) -> None:
        """A unit's gradient landed (its pieces hold it): step the unit once its copy to the host is done."""
        self._queue.put((unit, grad))

    def _run(self) -> None:
        while (item := self._queue.get()) is not _DONE:
            unit, grad = item
            if self._error is not None:
                continue
            try:
                host_copies.wait_for(grad)
                self._step(unit)
            except BaseException as error:  # re-raised by __exit__, in the caller's thread
                self._error = error

    @torch.no_grad()
    def _step(self, unit: UnitState) -> None:
        mine = {id(p.param) for p in unit.pieces if p.param.grad is not None}
        groups = self._optimizer.param_groups
        everyone = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, everyone):
                group["params"] = [p for p in params if id(p) in mine]
            self._optimizer.step()
        finally:
            for group, params in zip(groups, everyone):
                group["params"] = params
        for piece in unit.pieces:
            piece.param.grad = None
        if unit.offload_to is not None:  # the next step's first copies move the narrower mirror
            host_copies.refresh_mirror(unit.flat, unit.param_dtype)
        self.stepped.append(unit_label(unit.layout.name))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._queue.put(_DONE)
        assert self._thread is not None
        self._thread.join()
        for unit in self._units:
            unit.on_gradient = None
        if kind is not None:
            return
        if self._error is not None:
            raise RuntimeError("step_in_backward: the optimizer step of a unit failed") from self._error
        if not self.stepped:
            raise RuntimeError(
                "step_in_backward: no gradient landed inside the `with` block, so nothing was stepped: wrap "
                "loss.backward() in it"
            )
        log.debug("step_in_backward: stepped %d units: %s", len(self.stepped), self.stepped)


def refuse_inside_step_in_backward(units: list[UnitState], call: str, why: str) -> None:
    """Raise if ``call``, which cannot be done while units are stepped in backward, comes inside step_in_backward."""
    if any(unit.on_gradient is not None for unit in units):
        raise RuntimeError(f"{call} inside fsdp_compile.step_in_backward: {why}")


def step_in_backward(module: nn.Module, optimizer: torch.optim.Optimizer) -> Stepper:
    """Step ``optimizer`` on each unit of ``module`` (sharded by ``fsdp_compile.shard()``) as soon as the unit's
    gradient lands, while backward goes on; use it around the backward pass instead of ``optimizer.step()``:

        with fsdp_compile.step_in_backward(model, optimizer):
            loss.backward()
        optimizer.zero_grad()  # the gradients are consumed already: nothing left to zero

    The same bits as ``loss.backward(); optimizer.step()`` for optimizers that step each parameter on its own (torch's
    SGD, Adam, AdamW, ...). Made for CPU offload, where the optimizer steps on the host. Refused: an optimizer over a
    parameter that is no piece of the model's units, LBFGS (a closure), gradient sync off (a non-final micro-batch:
    wrap only the last one), and ``fsdp_compile.clip_grad_norm_`` inside (it needs every gradient first)."""
    units = sharded_units(module)  # raises for a module shard() has not sharded
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("step_in_backward: LBFGS steps with a closure over the whole model and cannot step per unit")
    pieces = {id(piece.param) for unit in units for piece in unit.pieces}
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in pieces:
                name = names.get(id(param), f"a tensor of shape {tuple(param.shape)}")
                raise ValueError(
                    f"step_in_backward: the optimizer steps {name}, which is no piece of the model's sharded units "
                    "(a parameter added after shard(), or of another model): step_in_backward would never step it. "
                    "Give it an optimizer of its own, stepped after backward"
                )
    return Stepper(module, optimizer)
