"""Apply a :class:`ShardPlan` to the module: build this rank's flat shard of every unit, then replace the
parameters by pieces of it, swap the owning modules' classes, and install the unit hooks.

Every unit is built before the module is touched, so nothing is half-changed if building fails.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile._agree import EagerFirstForward
from fsdp_compile._optimizer_guard import mark_replaced, watch_optimizers
from fsdp_compile._outside_forward import metadata_reads
from fsdp_compile._plan_shard import ShardPlan, UnitPlan
from fsdp_compile._regions import Regions
from fsdp_compile._sharded_state_dict import install_state_dict_hooks
from fsdp_compile._unit import SLOTS_ATTR, UNITS_ATTR, UnitState, cut_pieces, host_empty, register_units
from fsdp_compile._watch import WATCH_ATTR, ModelWatch, call_watched

__all__ = ["apply_shard"]

GROUPS_ATTR = "_fsdp_compile_groups"
"""On every unit module but the root: its units (one per group of parameters: dtype, ``requires_grad``)."""
FLAGS_ATTR = "_fsdp_compile_flags"
"""On every unit module but the root: (path, the names of its class-level flags) for each of its modules that has some
(paths, not modules: no reference cycle through the module)."""
_FLAG_TYPES = (bool, int, float, str, type(None))


def _class_flags(cls: type[nn.Module]) -> tuple[str, ...]:
    """The plain values (bool, number, str, None) the classes of ``cls``'s MRO up to ``nn.Module`` define: flags a
    forward may read and an instance may shadow (``block.fail = True``)."""
    mro = cls.__mro__[: cls.__mro__.index(nn.Module)]
    names = {name for klass in mro for name, value in vars(klass).items()
             if isinstance(value, _FLAG_TYPES) and not name.startswith("__")}
    return tuple(sorted(names))

log = logging.getLogger(__name__)


def apply_shard(
    module: nn.Module,
    plan: ShardPlan,
    group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup | None = None,
    *,
    sync_module_states: bool = False,
) -> list[UnitState]:
    """Shard ``module`` in place as ``plan`` says, over ``group`` (and, HSDP, replicated over
    ``replicate_group``); return its units. ``sync_module_states``: rank 0's values, for parameters and buffers."""
    world_size = dist.get_world_size(group)
    if plan.world_size != world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks, the group has {world_size}")
    rank = dist.get_rank(group)
    # rank 0's values: across the replicas first, then within the shard group (global rank 0 reaches every rank)
    sync = [g for g in (replicate_group, group) if sync_module_states and g is not None and dist.get_world_size(g) > 1]
    watch = _watch(module, plan, [g for g in (group, replicate_group) if g is not None and dist.get_world_size(g) > 1])
    built = [_build_unit(module, unit, group, replicate_group, rank, sync, watch, plan.offload_pin_memory)
             for unit in plan.units]
    for buffer in module.buffers():
        if not buffer.is_meta:
            _broadcast_from_rank_0(buffer, sync)

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
    states = [state for state, _ in built]
    for state in states:
        if state.layout.fqn:  # a unit module's forward finds its unit gathered, however it is called
            unit_module = module.get_submodule(state.layout.fqn)
            unit_module.__dict__.setdefault(GROUPS_ATTR, []).append(state)
            unit_module.__dict__[FLAGS_ATTR] = tuple(
                (path, flags) for path, sub in unit_module.named_modules() if (flags := _class_flags(type(sub))))
            sharded_modules[id(unit_module)] = unit_module
    for owner in sharded_modules.values():
        names = tuple(sorted(getattr(owner, SLOTS_ATTR, {})))
        owner.__class__ = _sharded_class(type(owner), names, root=owner is module, unit=GROUPS_ATTR in owner.__dict__)
    object.__setattr__(module, WATCH_ATTR, watch)
    register_units(module, states)
    _install_hooks(module, states)
    install_state_dict_hooks(module)
    log.info("fsdp_compile.shard: %d units over %d ranks: %s", len(states), world_size, states)
    return states


def _watch(module: nn.Module, plan: ShardPlan, groups: list[dist.ProcessGroup]) -> ModelWatch:
    """The model's :class:`ModelWatch` on the failure channels of ``groups`` ([Note: failures])."""
    units = {id(module.get_submodule(unit.layout.fqn)): unit.layout.fqn for unit in plan.units if unit.layout.fqn}
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return ModelWatch(groups, device, units)


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


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    owner_fqn, _, attr = name.rpartition(".")
    return module.get_submodule(owner_fqn)._parameters[attr]  # type: ignore[return-value]


def _broadcast_from_rank_0(tensor: torch.Tensor, groups: list[dist.ProcessGroup]) -> None:
    for g in groups:
        dist.broadcast(tensor, src=dist.get_global_rank(g, 0), group=g)


def _build_unit(
    module: nn.Module,
    unit: UnitPlan,
    group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup | None,
    rank: int,
    sync: list[dist.ProcessGroup],
    watch: ModelWatch,
    offload_pin_memory: bool | None,
) -> tuple[UnitState, list[nn.Parameter]]:
    """Copy this rank's chunk of the unit (rank 0's values, broadcast over ``sync``) into a new flat shard (CPU
    offload: in host memory, pinned if ``offload_pin_memory``) and cut one piece per parameter; return the unit and
    the parameters it replaces, in slot order."""
    layout = unit.layout
    params = [_parameter(module, slot.names[0]) for slot in layout.slots]
    on_meta = any(p.is_meta for p in params)  # the whole unit stays on meta (to_empty allocates its shard)
    full = torch.zeros(layout.padded_numel, dtype=unit.dtype, device="meta" if on_meta else params[0].device)
    if not on_meta:
        for slot, param in zip(layout.slots, params):
            full[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
        _broadcast_from_rank_0(full, sync)
    start = rank * layout.shard_numel
    part = full[start : start + layout.shard_numel]
    offload_to = None if offload_pin_memory is None else part.device  # meta: to_empty says where
    host = offload_to is not None and not on_meta
    flat = (host_empty(part, offload_pin_memory).copy_(part) if host else part.clone()).requires_grad_(
        any(p.requires_grad for p in params))
    _internals.mark_static(flat)  # a model sharded again (other sizes) compiles with constant sizes: planned
    pieces = cut_pieces(flat, layout, rank, [p.requires_grad for p in params])
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
        watch=watch,
        offload_to=offload_to,
        pin_memory=bool(offload_pin_memory),
        float8=unit.float8,
    )
    return state, params


class _CheckParametersSharded:
    """Forward pre-hook of the sharded root, in eager mode (the backend checks compiled graphs): refuse a
    parameter that belongs to no unit (added after ``shard()``), whose gradient nothing would average."""

    def __init__(self, states: list[UnitState]) -> None:
        self.states = states

    def hook(self, module: nn.Module, args: Any) -> None:
        """A bound method, not ``__call__``: see ``EagerFirstForward``."""
        if torch.compiler.is_compiling():
            return
        pieces = {id(piece.param) for state in self.states for piece in state.pieces}  # to_empty cuts new ones
        for name, param in module.named_parameters():
            if id(param) not in pieces:
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
    would convert a shard; ``to_empty(device=)`` of the sharded model gives its shards on the meta device storage
    of their own size (the pieces are cut again); other calls (``.to`` the shards' own device and dtype) go
    through. The buffers are converted as ``cls`` does it."""

    def _apply(module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        subtree = list(module.modules() if recurse else [module])
        units = {id(state): state for m in subtree for state, _ in getattr(m, SLOTS_ATTR, {}).values()}
        on_meta = [state for state in units.values() if _allocates(state, fn)]
        if on_meta:
            _materialize(module, on_meta, fn)
        for state in units.values():
            if state in on_meta:  # just allocated (CPU offload: on the host, whatever device to_empty named)
                continue
            probe = state.flat.detach()[:0]
            converted = fn(probe)
            if (converted.dtype, converted.device) != (probe.dtype, probe.device):
                raise TypeError(
                    f"{type(module).__name__} was sharded by fsdp_compile.shard(): converting it would move its flat "
                    f"shards from {probe.dtype} on {probe.device} to {converted.dtype} on {converted.device} and cut "
                    "the optimizer's parameters off from them. Convert the model before shard() (e.g. model.float() "
                    "or model.to(device)), then shard it, then build the optimizer"
                )
        with _pieces_hidden(subtree):  # the pieces view the shards: only the buffers are converted
            return cls._apply(module, fn, recurse)

    return _apply


def _allocates(state: UnitState, fn: Any) -> bool:
    """Whether ``fn`` (a module conversion) gives the unit's meta shard storage of the same dtype: ``to_empty``."""
    if not state.flat.is_meta:
        return False
    converted = fn(state.flat.detach()[:0])
    return not converted.is_meta and converted.dtype == state.flat.dtype


def _materialize(module: nn.Module, states: list[UnitState], fn: Any) -> None:
    """``to_empty`` of a sharded model: each unit of ``states`` gets storage for its shard, and every owner of its
    parameters the new pieces."""
    if getattr(module, UNITS_ATTR, None) is None:
        raise RuntimeError(
            f"to_empty() of {type(module).__name__}, a part of a model sharded on the meta device: call it on the "
            "model shard() was called on (its units' parameters may be owned by modules outside this one)"
        )
    for state in states:
        for old in state.materialize(fn):
            mark_replaced(old.param, old.slot.names[0], by="to_empty()")
    for owner in module.modules():
        for attr, (state, slot) in getattr(owner, SLOTS_ATTR, {}).items():
            owner._parameters[attr] = state.piece(slot).param
    log.info("fsdp_compile: to_empty() allocated the shards of %d units on %s", len(states), states[0].flat.device)


@contextlib.contextmanager
def _pieces_hidden(modules: list[nn.Module]) -> Iterator[None]:
    """The sharded pieces taken out of their owners' ``_parameters`` meanwhile (put back in the same order)."""
    hidden = []
    for m in modules:
        names = list(getattr(m, SLOTS_ATTR, {}))
        if names and all(n in m._parameters for n in names):
            hidden.append((m, dict(m._parameters)))
            for n in names:
                del m._parameters[n]
    try:
        yield
    finally:
        for m, params in hidden:
            m._parameters.clear()
            m._parameters.update(params)


def _own_forward(cls: type[nn.Module]) -> Any:
    """``cls.forward`` (torch.nn's: an ``nn.Sequential``'s), defined here: ``torch.compile`` of a module whose forward
    is torch's starts at a frame of its own that inlines the module's ``__call__``, so the watched ``__call__``
    would be traced, not run."""

    @functools.wraps(cls.forward)
    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return cls.forward(module, *args, **kwargs)

    return forward


def _metadata_repr(cls: type[nn.Module]) -> Any:
    """The ``extra_repr`` of a sharded class: ``cls``'s, whose reads of parameters give their shape and dtype only
    (printing the model needs no values, nor the other ranks)."""

    def extra_repr(module: nn.Module) -> str:
        with metadata_reads():
            return cls.extra_repr(module)

    return extra_repr


def _param_property(name: str) -> property:
    def fget(module: nn.Module) -> torch.Tensor:
        state, slot = getattr(module, SLOTS_ATTR)[name]
        return state.unshard_param(slot)

    return property(fget, doc=f"The full parameter {name!r}, gathered from its FSDP unit.")


def _gathered_forward(cls: type[nn.Module]) -> Any:
    """``cls.forward`` run with the module's unit gathered (``UnitState.gathered_for_forward``): a unit module's
    forward called other than through its ``__call__``, whose hooks gather the unit. Hugging Face's gradient
    checkpointing checkpoints ``forward`` (so that FSDP2's module hooks stay outside the checkpoint), and its
    recompute in backward reads the parameters with no hook around it; FSDP2 gathers for backward from autograd.
    Traced, a nested compile region: the units of a class that agree share one body ([Note: shared bodies]). Dynamo (torch
    2.13) traces a body once and reuses it for the next unit after re-checking its guards, but misses that an attribute
    the body read from the class is still absent from the next unit's instance: a flag set on one unit after the first
    compile went unseen. So the unit's modules' plain class-level attributes (``FLAGS_ATTR``) are read before the region,
    where Dynamo guards them per unit."""
    forward = cls.forward
    region = _internals.compile_region(forward)

    @functools.wraps(forward)
    def gathered_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the graph gathers the unit itself; units alike share one traced body
            if region is not None and not Regions.on:  # units' forwards break the graph: see _forward_in_pieces
                return _forward_in_pieces(module, forward, *args, **kwargs)
            if region is None:
                return forward(module, *args, **kwargs)
            for path, names in module.__dict__[FLAGS_ATTR]:
                sub = module.get_submodule(path)
                for name in names:
                    getattr(sub, name)  # guarded per unit (see the docstring)
            return region(module, *args, **kwargs)
        gathered = _gather_for_forward(module)
        try:
            return forward(module, *args, **kwargs)
        finally:
            _release(gathered)

    return gathered_forward


@functools.partial(torch.compiler.disable, recursive=False)
def _forward_in_pieces(module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """A unit's ``forward`` where units' forwards break the graph (``_regions``): this frame in Python, the unit gathered
    here, once per call, as FSDP2's hooks do, and ``forward`` compiled in pieces (Dynamo compiles its frames) that read
    the gathered unit: no collective inside a piece. A piece may run a number of times that depends on the data (a
    mixture of experts' loop over the experts hit), which differs from rank to rank; a gather per piece would issue
    different collectives on each rank."""
    gathered = _gather_for_forward(module, resharded=True)
    try:
        return forward(module, *args, **kwargs)
    finally:
        _release(gathered)


@torch.compiler.disable  # eager code, also where a compiled model's graph break leaves this frame to Python
def _gather_for_forward(module: nn.Module, *, resharded: bool = False) -> contextlib.ExitStack:
    gathered = contextlib.ExitStack()
    for state in module.__dict__[GROUPS_ATTR]:
        gathered.enter_context(state.gathered_for_forward(resharded=resharded))
    return gathered


@torch.compiler.disable
def _release(gathered: contextlib.ExitStack) -> None:
    gathered.close()


_SHARDED_CLASSES: dict[tuple[type[nn.Module], tuple[str, ...], bool, bool], type[nn.Module]] = {}


def _sharded_class(cls: type[nn.Module], names: tuple[str, ...], *, root: bool, unit: bool) -> type[nn.Module]:
    """A cached subclass of ``cls`` whose class-level property per name shadows ``_parameters``; the model's (the
    ``root``) also has its calls watched (``fsdp_compile._watch``); a ``unit`` module's forward gathers its unit
    when called outside its ``__call__`` (``_gathered_forward``)."""
    key = (cls, names, root, unit)
    if key not in _SHARDED_CLASSES:
        props: dict[str, Any] = {name: _param_property(name) for name in names}
        props["__module__"] = cls.__module__
        props["_apply"] = _refuse_conversion(cls)
        props["extra_repr"] = _metadata_repr(cls)
        if root:
            props["__call__"] = call_watched
            if cls.forward.__module__.startswith("torch."):  # nn.Sequential: see _own_forward
                props["forward"] = _own_forward(cls)
        elif unit:
            props["forward"] = _gathered_forward(cls)
        _SHARDED_CLASSES[key] = type(f"FSDP{cls.__name__}", (cls,), props)
    return _SHARDED_CLASSES[key]
