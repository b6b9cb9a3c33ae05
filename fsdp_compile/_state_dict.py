"""Full (unsharded) state dicts of a sharded module and of its optimizer: save, and load into the shards.

Full state dicts are independent of the world size: save on N ranks, load on M.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile._agree import agree
from fsdp_compile._layout import ParamSlot, unit_label
from fsdp_compile._sharded_state_dict import local_state_dict
from fsdp_compile._unit import UnitState, sharded_units

__all__ = ["full_optimizer_state_dict", "full_state_dict", "load_full_optimizer_state_dict", "load_full_state_dict"]


def _slots_by_param(module: nn.Module) -> dict[int, tuple[UnitState, ParamSlot]]:
    """id(piece parameter) -> its unit and slot."""
    return {id(piece.param): (state, piece.slot) for state in sharded_units(module) for piece in state.pieces}


def is_group_rank0(module: nn.Module) -> bool:
    """Whether this rank is rank 0 of the group the module is sharded over (not necessarily global rank 0) and,
    with HSDP, of the first replica."""
    unit = sharded_units(module)[0]
    return all(dist.get_rank(group) == 0 for group in (unit.group, unit.replicate_group) if group is not None)


def _emit(tensor: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    return tensor.to("cpu", copy=True) if cpu_offload else tensor.clone()


@torch.no_grad()
def full_state_dict(
    module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Original parameter and buffer names -> full tensors. A collective: call it on every rank.

    Keys and order are those of ``module.state_dict()`` before sharding; both names of a tied weight map
    to the same tensor, as ``nn.Module.state_dict`` gives them. ``rank0_only``: only rank 0 of the group the
    module is sharded over (``shard(group=...)``, not necessarily global rank 0; with HSDP, of the first
    replica) returns them; the other
    ranks return ``{}``. ``cpu_offload``: the tensors are copied to CPU memory, one unit at a time. Buffers
    are not sharded: each rank returns its own (with ``rank0_only``, that rank's); call
    ``fsdp_compile.sync_buffers`` first where they can differ across ranks (BatchNorm's running statistics).
    ``trainable_only``: only the parameters that require a gradient, gathered from the units' trainable groups
    alone (no buffers): a LoRA model's adapters, for peft's ``save_pretrained(path, state_dict=...)``.
    """
    keep = not rank0_only or is_group_rank0(module)
    full: dict[int, torch.Tensor] = {}
    for state in sharded_units(module):
        if trainable_only and not state.trainable:
            continue
        values = state.all_gather_params_nograd()
        if keep:
            for piece, value in zip(state.pieces, values):
                if piece.param.requires_grad or not trainable_only:
                    full[id(piece.param)] = _emit(value, cpu_offload)
    if not keep:
        return {}
    with local_state_dict():
        entries = module.state_dict(keep_vars=True)
    if trainable_only:
        return {key: full[id(value)] for key, value in entries.items() if id(value) in full}
    return {key: full[id(value)] if id(value) in full else _emit(value.detach(), cpu_offload) for key, value in entries.items()}


def _check_keys(expected: list[str], given: Mapping[str, Any], what: str) -> None:
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in set(expected)]
    if missing or unexpected:
        raise KeyError(f"{what} does not match the module: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (from ``full_state_dict`` or an unsharded ``state_dict()``, saved on any
    number of ranks) into the shards. Every rank passes the whole state dict. Nothing is loaded unless
    every key and shape matches."""
    with local_state_dict():
        current = module.state_dict(keep_vars=True)
    _check_keys(list(current), state_dict, "state_dict")
    slots = _slots_by_param(module)
    for key, value in current.items():
        want = slots[id(value)][1].shape if id(value) in slots else tuple(value.shape)
        if tuple(state_dict[key].shape) != want:
            raise ValueError(f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)}, the module's is {want}")
    for key, value in current.items():
        if id(value) in slots:
            state, slot = slots[id(value)]
            value.copy_(state.local_part(slot, state_dict[key]))
        else:
            value.copy_(state_dict[key])


def _per_element_states(optimizer: torch.optim.Optimizer, unit: UnitState) -> list[tuple[str, torch.Tensor]]:
    """The unit's state entries shaped like their parameter (exp_avg, momentum_buffer, ...), each with one of
    its tensors on this rank, in a rank-independent order (by key)."""
    found: dict[str, torch.Tensor] = {}
    for piece in unit.pieces:
        for key, value in optimizer.state.get(piece.param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == piece.param.shape:
                found.setdefault(key, value)
    return sorted(found.items())


def _with_params(group: Mapping[str, Any], params: list[Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters with its "params" replaced (names <-> optimizer indices)."""
    return {**{k: v for k, v in group.items() if k != "params"}, "params": params}


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


@torch.no_grad()
def full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, Any]:
    """The optimizer's state with full tensors keyed by parameter name: ``{"state": {name: {key: value}},
    "param_groups": [{..., "params": [names]}]}``. A collective: call it on every rank. ``rank0_only`` and
    ``cpu_offload`` as in :func:`full_state_dict`."""
    keep = not rank0_only or is_group_rank0(module)
    names = _names(module)
    units = sharded_units(module)
    per_unit = [_per_element_states(optimizer, unit) for unit in units]
    agree(
        units[0].group,
        units[0].flat.device,
        "full_optimizer_state_dict",
        [
            f"all-gather of optimizer state {key!r} ({like.dtype}) of unit {unit_label(unit.layout.name)!r}"
            for unit, entries in zip(units, per_unit)
            for key, like in entries
        ],
        hint="The optimizer's state must have the same entries on every rank: build the optimizer the same way "
        "everywhere, step it on every rank, and load a state dict on every rank or on none",
    )
    state_out: dict[str, dict[str, Any]] = {}
    for unit, entries in zip(units, per_unit):
        pieces = [piece.param for piece in unit.pieces]
        for key, like in entries:
            values = unit.all_gather_pieces_nograd(lambda piece: optimizer.state.get(piece, {}).get(key), like)
            for piece, value in zip(pieces, values):
                if keep and piece in optimizer.state:
                    state_out.setdefault(names[id(piece)], {})[key] = _emit(value, cpu_offload)
        for piece in pieces:
            for key, value in optimizer.state.get(piece, {}).items():
                if keep and key not in state_out.get(names[id(piece)], {}):
                    state_out.setdefault(names[id(piece)], {})[key] = (
                        _emit(value, cpu_offload) if isinstance(value, torch.Tensor) else value
                    )
    if not keep:
        return {}
    groups = [_with_params(group, [names[id(p)] for p in group["params"]]) for group in optimizer.param_groups]
    return {"state": state_out, "param_groups": groups}


@torch.no_grad()
def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load what ``full_optimizer_state_dict`` returned (on any number of ranks) into ``optimizer``, which
    must have been built on ``module``'s sharded parameters with the same parameter groups."""
    names = _names(module)
    groups = optimizer.param_groups
    given_groups = state_dict["param_groups"]
    mine = [[names[id(p)] for p in g["params"]] for g in groups]
    if mine != [list(g["params"]) for g in given_groups]:
        raise ValueError("the optimizer's parameter groups (by name) differ from the saved ones; build it the same way")
    slots = _slots_by_param(module)
    index = {names[id(p)]: i for i, p in enumerate(p for g in groups for p in g["params"])}
    by_name = {names[id(p)]: p for g in groups for p in g["params"]}
    local_state: dict[int, dict[str, Any]] = {}
    for name, entries in state_dict["state"].items():
        piece = by_name[name]
        unit, slot = slots[id(piece)]
        local_state[index[name]] = {
            key: unit.local_part(slot, value).clone()
            if isinstance(value, torch.Tensor) and tuple(value.shape) == slot.shape and value.dim() > 0
            else value
            for key, value in entries.items()
        }
    optimizer.load_state_dict(
        {
            "state": local_state,
            "param_groups": [_with_params(g, [index[n] for n in g["params"]]) for g in given_groups],
        }
    )
