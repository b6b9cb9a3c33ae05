"""``summon_full_params``: full parameters outside forward, explicitly and on every rank (FSDP1's API). Outside it, a
read of a sharded parameter outside the model's forward raises: on one rank alone it would be a hidden all-gather
that waits for the others forever."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fsdp_compile._agree import agree
from fsdp_compile._outside_forward import outside_forward
from fsdp_compile._unit import UnitState, sharded_units
from fsdp_compile._watch import watch_of

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(module: nn.Module, *, writeback: bool = False) -> Iterator[None]:
    """Inside the ``with`` block, every parameter of ``module`` (the model ``shard()`` sharded) reads as its full
    value, as the unsharded model's: ``model.lm_head.weight``, ``named_parameters()`` of a submodule's attributes,
    Hugging Face helpers that read weights. A collective: enter it on every rank (it gathers every unit; the ranks
    first check, through the store, that they all entered it: one that waits alone raises, naming the others).

    ``writeback=False``: the parameters are read-only (an in-place write raises). ``writeback=True``: at the end of
    the block each rank writes its own part of every parameter back to its shard, so make the same change on every
    rank (a change made on one rank reaches only that rank's part); if the block raises, nothing is written.
    Memory: the whole model unsharded, in the shards' dtype, for the block's duration. The model cannot be called
    inside the block, nor the block entered inside the model's forward or inside another one.
    """
    if not isinstance(writeback, bool):
        raise TypeError(f"writeback must be a bool, got {writeback!r}")
    states = sharded_units(module)
    watch = watch_of(module)
    assert watch is not None  # every model shard() sharded has one
    if watch.depth or watch.summoned:
        raise RuntimeError(
            "fsdp_compile.summon_full_params() "
            + ("inside the sharded model's forward" if watch.depth else "inside another summon_full_params()")
            + ": inside the forward the units are gathered already; enter it once, outside the model's forward"
        )
    watch.summons += 1
    for group, device in {g: s.flat.device for s in states for g in s.groups}.items():
        agree(group, device, "summon_full_params()", [f"summon_full_params #{watch.summons} (writeback={writeback})"])
    full = {state: _gather(state, writeback) for state in states}
    for state in states:
        state.outside = lambda slot, params=full[state]: params[slot.offset]
    watch.summoned = True
    try:
        yield
    finally:
        watch.summoned = False
        for state in states:
            state.outside = None
        _keep_pieces(module, states)
    if writeback:
        for state in states:
            state.write_local_parts(full[state])


def _keep_pieces(module: nn.Module, states: list[UnitState]) -> None:
    """Put back, and refuse, a parameter replaced inside the block (``module.weight = nn.Parameter(...)``, Hugging
    Face's ``tie_weights``): the replacement would be cut off from the shards the model reads and trains."""
    replaced = []
    for state in states:
        for piece in state.pieces:
            for name in piece.slot.names:
                owner_fqn, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_fqn)
                if owner._parameters.get(attr) is not piece.param:
                    owner._parameters[attr] = piece.param
                    replaced.append(name)
    if replaced:
        raise RuntimeError(
            f"parameters {replaced[:5]} were replaced inside fsdp_compile.summon_full_params(): a sharded model keeps "
            "its parameters (they are views of its shards). Change their values in place (with writeback=True), e.g. "
            "`module.weight.copy_(value)` under torch.no_grad(); nothing was written back"
        )


def _gather(state: UnitState, writeback: bool) -> dict[int, torch.Tensor]:
    """The unit's full parameters by slot offset: parameters (as its pieces require a gradient or not) to change,
    or read-only views."""
    full = {}
    for slot, value in zip(state.layout.slots, state.all_gather_params_nograd()):
        if writeback:
            full[slot.offset] = nn.Parameter(value, requires_grad=state.piece(slot).param.requires_grad)
        else:
            full[slot.offset] = outside_forward(
                value, slot.names[0], "inside fsdp_compile.summon_full_params(writeback=False)",
                "Pass writeback=True to change parameters (and make the same change on every rank)",
            )
    return full
