"""``init_parameters``: initialise a sharded model as its unsharded self would be, one submodule at a time, without
communication: every rank runs the same ``init_fn`` calls on full parameters and keeps its own part.

The route for a model too big for one device (FSDP2's): build it on the meta device, ``shard()`` it, then
``model.to_empty(device=...)`` allocates this rank's shards only, and ``init_parameters`` fills them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from fsdp_compile._layout import ParamSlot
from fsdp_compile._unit import SLOTS_ATTR, UnitState, sharded_units

__all__ = ["init_parameters"]

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]


def init_parameters(module: nn.Module, init_fn: InitFn | None = None) -> None:
    """Call ``init_fn(submodule)`` on each submodule of the sharded ``module``, in ``module.modules()`` order, and
    keep what it writes: this rank's part of each parameter, and the buffers.

    During each call the parameters are full (``submodule.weight``, ``submodule.named_parameters()``: the
    shape and values of the unsharded model's; this rank's part holds its current value, the rest zeros); after
    it, this rank's part goes to the shard and the rest is dropped. So the model equals, bitwise, the unsharded
    one given ``init_fn`` the same way under the same seed, on any number of ranks, and the memory beyond the
    shards is one call's parameters. ``init_fn`` must not read, in one call, values another call wrote outside
    this rank's part (e.g. a rescale by a whole weight's norm written earlier): those are zeros here.
    Default ``init_fn``: each submodule's own ``reset_parameters()`` (FSDP1's convention).
    """
    states = sharded_units(module)
    unallocated = [s for s in states if s.flat.is_meta] or [b for b in module.buffers() if b.is_meta]
    if unallocated:
        raise RuntimeError(
            f"{type(module).__name__} is still on the meta device: allocate its shards and buffers first, with "
            "model.to_empty(device=...), then call fsdp_compile.init_parameters(model)"
        )
    submodules = list(module.named_modules())
    if init_fn is None:
        init_fn = _reset_parameters
        for fqn, sub in submodules:
            if _owns_tensors(sub) and not callable(getattr(sub, "reset_parameters", None)):
                raise TypeError(
                    f"{fqn or 'the model itself'} ({type(sub).__name__}) has parameters or buffers of its own and no "
                    "reset_parameters() to initialise them: pass fsdp_compile.init_parameters(model, init_fn=fn), fn "
                    "a function of one submodule that initialises that submodule's own parameters and buffers"
                )
    full: dict[UnitState, dict[int, torch.Tensor]] = {state: {} for state in states}
    for state in states:
        state.outside = functools.partial(_full_for_init, state, full[state])
    try:
        for _, sub in submodules:
            _call(init_fn, sub, full)
    finally:
        for state in states:
            state.outside = None
    log.info("fsdp_compile.init_parameters: %d submodules of %d units initialised", len(submodules), len(states))


def _full_for_init(state: UnitState, full: dict[int, torch.Tensor], slot: ParamSlot) -> torch.Tensor:
    """The full parameter ``slot`` for ``init_parameters`` (kept in ``full`` until written to the shard): zeros, but
    for this rank's part, the shard's value."""
    if slot.offset not in full:
        piece = state.piece(slot).param
        full[slot.offset] = nn.Parameter(state.flat.new_zeros(slot.shape), requires_grad=piece.requires_grad)
        with torch.no_grad():
            state.local_part(slot, full[slot.offset]).copy_(piece)
    return full[slot.offset]


def _call(init_fn: InitFn, sub: nn.Module, full: dict[UnitState, dict[int, torch.Tensor]]) -> None:
    """``init_fn(sub)`` with ``sub``'s own parameters full in its ``_parameters`` (and any read through an
    attribute); then this rank's parts to the shards."""
    states = list(full)
    owned = getattr(sub, SLOTS_ATTR, {})
    pieces = dict(sub._parameters)
    versions = [s.flat._version for s in states]
    for attr, (state, slot) in owned.items():
        sub._parameters[attr] = state.unshard_param(slot)  # type: ignore[assignment]
    try:
        init_fn(sub)
    finally:
        sub._parameters.clear()
        sub._parameters.update(pieces)
    written = [s for s, v in zip(states, versions) if s.flat._version != v]
    if written:
        raise RuntimeError(
            f"init_fn({type(sub).__name__}) wrote this rank's sharded pieces of unit {written[0]!r} directly (1-D "
            "parameters: reached through a module's _parameters, or parameters() of a module other than the one "
            "init_fn was given?). Write the given submodule's own parameters (submodule.weight, "
            "submodule.parameters(recurse=False)): those are full during init_parameters"
        )
    for state, params in full.items():
        state.write_local_parts(params)
        params.clear()


def _owns_tensors(sub: nn.Module) -> bool:
    return any(t is not None for t in (*sub._parameters.values(), *sub._buffers.values()))


def _reset_parameters(sub: nn.Module) -> None:
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()
