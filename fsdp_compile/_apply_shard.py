"""Apply a :class:`ShardPlan` to the module: build this rank's flat shard of every unit, then replace the
parameters by pieces of it, swap the owning modules' classes, and install the unit hooks.

Every unit is built before the module is touched, so nothing is half-changed if building fails.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile._agree import EagerFirstForward
from fsdp_compile._optimizer_guard import mark_replaced, watch_optimizers
from fsdp_compile._plan_shard import ShardPlan, UnitPlan
from fsdp_compile._sharded_state_dict import install_state_dict_hooks
from fsdp_compile._unit import SLOTS_ATTR, Piece, UnitState, register_units, weak_method

__all__ = ["apply_shard"]

log = logging.getLogger(__name__)


def apply_shard(
    module: nn.Module, plan: ShardPlan, group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None = None
) -> list[UnitState]:
    """Shard ``module`` in place as ``plan`` says, over ``group`` (and, HSDP, replicated over
    ``replicate_group``); return its units."""
    world_size = dist.get_world_size(group)
    if plan.world_size != world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks, the group has {world_size}")
    rank = dist.get_rank(group)
    built = [_build_unit(module, unit, group, replicate_group, rank) for unit in plan.units]

    watch_optimizers()
    sharded_modules: dict[int, nn.Module] = {id(module): module}  # the root too: it refuses conversions
    for state, originals in built:
        for piece, original in zip(state.pieces, originals):
            mark_replaced(original, piece.slot.names[0])
            for name in piece.slot.names:
                owner_fqn, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_fqn)
                owner._parameters[attr] = piece.param
                owner.__dict__.setdefault(SLOTS_ATTR, {})[attr] = (state, piece.slot)
                sharded_modules[id(owner)] = owner
    for owner in sharded_modules.values():
        owner.__class__ = _sharded_class(type(owner), tuple(sorted(getattr(owner, SLOTS_ATTR, {}))))
    states = [state for state, _ in built]
    register_units(module, states)
    _install_hooks(module, states)
    install_state_dict_hooks(module)
    log.info("fsdp_compile.shard: %d units over %d ranks: %s", len(states), world_size, states)
    return states


def _install_hooks(module: nn.Module, states: list[UnitState]) -> None:
    """Hooks run in the order they are registered here: the checks before the units' own. Never
    ``prepend=True``: torch 2.11's Dynamo guards a traced hook by its position in ``dict.keys(hooks)``, which
    ``OrderedDict.move_to_end`` does not change, so a prepended hook fails every compilation there
    (``'_BeforeGather' object has no attribute '__func__'``, or "Guard failed on the same frame it was
    created")."""
    module.register_forward_pre_hook(_CheckParametersSharded(states).hook)  # before any unit gathers
    EagerFirstForward(module, states)  # its checks run before each unit gathers
    for state in states:
        unit_module = module.get_submodule(state.layout.fqn)
        unit_module.register_forward_pre_hook(state.eager.pre_forward)
        unit_module.register_forward_hook(state.eager.post_forward, always_call=True)  # also when forward raises
        state.flat.register_post_accumulate_grad_hook(weak_method(state.distribute_grad))


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    owner_fqn, _, attr = name.rpartition(".")
    return module.get_submodule(owner_fqn)._parameters[attr]  # type: ignore[return-value]


def _build_unit(
    module: nn.Module, unit: UnitPlan, group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None, rank: int
) -> tuple[UnitState, list[nn.Parameter]]:
    """Copy this rank's chunk of the unit into a new flat shard and cut one piece per parameter; return the
    unit and the parameters it replaces, in slot order."""
    layout = unit.layout
    params = [_parameter(module, slot.names[0]) for slot in layout.slots]
    full = torch.zeros(layout.padded_numel, dtype=unit.dtype, device=params[0].device)
    for slot, param in zip(layout.slots, params):
        full[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
    start = rank * layout.shard_numel
    flat = full[start : start + layout.shard_numel].clone().requires_grad_(any(p.requires_grad for p in params))
    _internals.mark_static(flat)  # a model sharded again (other sizes) compiles with constant sizes: planned
    pieces = []
    for slot, param in zip(layout.slots, params):
        lo, hi = layout.local_range(slot, rank)
        pieces.append(Piece(nn.Parameter(flat.detach()[lo:hi], requires_grad=param.requires_grad), slot, lo, hi))
    state = UnitState(
        layout=layout,
        flat=flat,
        pieces=pieces,
        group=group,
        replicate_group=replicate_group,
        param_dtype=unit.param_dtype,
        reduce_dtype=unit.reduce_dtype,
        grad_reduction=unit.grad_reduction,
        reshard_after_forward=unit.reshard_after_forward,
    )
    return state, params


class _CheckParametersSharded:
    """Forward pre-hook of the sharded root, in eager mode (the backend checks compiled graphs): refuse a
    parameter that belongs to no unit (added after ``shard()``), whose gradient nothing would average."""

    def __init__(self, states: list[UnitState]) -> None:
        self.pieces = {id(piece.param) for state in states for piece in state.pieces}

    def hook(self, module: nn.Module, args: Any) -> None:
        """A bound method, not ``__call__``: see ``EagerFirstForward``."""
        if torch.compiler.is_compiling():
            return
        for name, param in module.named_parameters():
            if id(param) not in self.pieces:
                raise RuntimeError(unsharded_parameter_message(name))


def unsharded_parameter_message(name: str) -> str:
    return (
        f"parameter {name} belongs to no FSDP unit (was it added after fsdp_compile.shard()?): nothing would "
        "average its gradient over the ranks, and they would drift apart. Build the whole model before shard(), "
        "and shard it once, from its top-level module"
    )


def _refuse_conversion(cls: type[nn.Module]) -> Any:
    """The ``_apply`` of a sharded class: ``.to(dtype)``, ``.float()``, ``.cuda()``... would give the flat shards'
    pieces new storage, cut off from the shards the model reads and the optimizer steps. Refused when it
    would convert a shard; other calls (``.to`` the shards' own device and dtype) go through."""

    def _apply(module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        subtree = module.modules() if recurse else [module]
        units = {id(state): state for m in subtree for state, _ in getattr(m, SLOTS_ATTR, {}).values()}
        for state in units.values():
            probe = state.flat.detach()[:0]
            converted = fn(probe)
            if (converted.dtype, converted.device) != (probe.dtype, probe.device):
                raise TypeError(
                    f"{type(module).__name__} was sharded by fsdp_compile.shard(): converting it would move its flat "
                    f"shards from {probe.dtype} on {probe.device} to {converted.dtype} on {converted.device} and cut "
                    "the optimizer's parameters off from them. Convert the model before shard() (e.g. model.float() "
                    "or model.to(device)), then shard it, then build the optimizer"
                )
        return cls._apply(module, fn, recurse)

    return _apply


def _param_property(name: str) -> property:
    def fget(module: nn.Module) -> torch.Tensor:
        state, slot = getattr(module, SLOTS_ATTR)[name]
        return state.unshard_param(slot)

    return property(fget, doc=f"The full parameter {name!r}, gathered from its FSDP unit.")


_SHARDED_CLASSES: dict[tuple[type[nn.Module], tuple[str, ...]], type[nn.Module]] = {}


def _sharded_class(cls: type[nn.Module], names: tuple[str, ...]) -> type[nn.Module]:
    """A cached subclass of ``cls`` whose class-level property per name shadows ``_parameters``."""
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        props: dict[str, Any] = {name: _param_property(name) for name in names}
        props["__module__"] = cls.__module__
        props["_apply"] = _refuse_conversion(cls)
        _SHARDED_CLASSES[key] = type(f"FSDP{cls.__name__}", (cls,), props)
    return _SHARDED_CLASSES[key]
