"""``shard()``: turn a module's parameters into one flat shard per FSDP unit, keeping names and ties.

After ``shard(model, units=...)``:

* every unit (each matching submodule, plus the root for the parameters left over) owns ONE flat buffer,
  padded to a multiple of the world size; this rank keeps its chunk as a plain leaf tensor
  (``UnitState.flat``, ``requires_grad=True``), neither parameter nor buffer;
* each original parameter is replaced, under its own name in ``module._parameters``, by a 1-D
  ``nn.Parameter`` *piece*: a view of the part of the flat shard that holds it on this rank (possibly
  empty). ``parameters()`` therefore yields only sharded storage, and optimizers keep sharded state;
* each module class is swapped for a cached subclass whose class-level property per parameter name
  returns the full parameter: under ``torch.compile`` a marker op (``fsdp_compile::unshard``) that the
  backend's passes turn into one all-gather per unit; in eager, a view of the unit's gathered buffer,
  filled by forward pre-hooks on the unit (or gathered on demand);
* gradients reach ``flat.grad`` (averaged over ranks); a post-accumulate-grad hook hands each piece its
  part and clears ``flat.grad``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_compile._eager import live_gathers, pack, unpack
from fsdp_compile._layout import ParamSlot, UnitLayout, plan_layout
from fsdp_compile._ops import all_gather, gather_unit, reduce_scatter_avg, unshard
from fsdp_compile.config import MixedPrecision

__all__ = ["UnitState", "set_requires_gradient_sync", "shard", "sharded_units", "unit_of_shard"]

log = logging.getLogger(__name__)

UnitSpec = Union[Iterable[type[nn.Module]], Callable[[str, nn.Module], bool]]

_STATE_ATTR = "_fsdp_compile_units"
_SLOTS_ATTR = "_fsdp_compile_slots"
_units_by_shard: weakref.WeakValueDictionary[int, UnitState] = weakref.WeakValueDictionary()
"""id(flat shard) -> its unit. Weak, like every reference from a tensor back to its unit: a cycle through a
tensor's hooks is invisible to Python's garbage collector, and would keep a deleted model's shards alive."""
_REPLACED_ATTR = "_fsdp_compile_replaced"  # on an original parameter that shard() replaced: its name

_optimizer_hook: RemovableHandle | None = None
_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: refuse to step an optimizer that holds parameters shard() replaced."""
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, _REPLACED_ATTR, None)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {name!r} as it was before fsdp_compile.shard() "
                    "replaced it with a sharded piece, so this optimizer would train nothing: build the optimizer "
                    "after shard(), from model.parameters() (or model.named_parameters())"
                )
    _checked_optimizers.add(optimizer)


def _watch_optimizers() -> None:
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


class UnitState:
    """One FSDP unit on this rank: its layout, flat shard, parameter pieces and collective settings."""

    def __init__(
        self,
        *,
        layout: UnitLayout,
        flat: torch.Tensor,
        pieces: list[tuple[nn.Parameter, ParamSlot, int, int]],
        group: dist.ProcessGroup,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        exchange: bool,
        reshard_after_forward: bool,
    ) -> None:
        self.layout = layout
        self.flat = flat
        self.pieces = pieces
        self.group = group
        self.group_name: str = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.exchange = exchange
        """Gradients travel in ``param_dtype`` and are averaged in ``reduce_dtype`` (see MixedPrecision)."""
        self.reshard_after_forward = reshard_after_forward
        """False: the gathered unit is kept from forward to backward instead of gathered again."""
        self.requires_gradient_sync = True
        self.accum: torch.Tensor | None = None
        """Gradient sync off: a full-size leaf in reduce_dtype whose .grad accumulates the unreduced gradient."""
        self.gathered: torch.Tensor | None = None
        """Eager mode: the gathered unit while the unit's forward runs."""
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._regathered: torch.Tensor | None = None
        self._pending = 0

    def __repr__(self) -> str:
        return f"UnitState({self.layout.fqn or '<root>'!r}, params={len(self.layout.slots)}, shard={self.layout.shard_numel})"

    def gather(self) -> torch.Tensor:
        """All-gather the whole unit in eager mode (differentiable, like the compiled graphs)."""
        return gather_unit(
            self.flat, self.accum, self.param_dtype, self.reduce_dtype, self.exchange, self.world_size, self.group_name
        )

    def unshard_param(self, slot: ParamSlot) -> torch.Tensor:
        """The full parameter ``slot``: a marker op under compile, a view of the gathered unit in eager."""
        if torch.compiler.is_compiling():
            return unshard(self.flat, self.accum, slot.offset, slot.numel, list(slot.shape), self.param_dtype)
        gathered = self.gathered if self.gathered is not None else self.gather()
        return gathered[slot.offset : slot.offset + slot.numel].view(slot.shape)

    @torch.no_grad()
    def gather_full(self, local: torch.Tensor | None = None) -> list[torch.Tensor]:
        """All-gather a shard-shaped tensor (default: the flat shard itself) without autograd and return the
        full value of every parameter, in slot order. A collective: every rank calls it."""
        local = (self.flat if local is None else local).detach()
        full = local if self.world_size == 1 else all_gather(local, self.world_size, self.group_name)
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def gather_pieces(self, per_piece: Callable[[nn.Parameter], torch.Tensor | None], like: torch.Tensor) -> list[torch.Tensor]:
        """``gather_full`` of a shard assembled from one tensor per piece (its gradient, an optimizer state,
        ...; zeros where ``per_piece`` gives None), in ``like``'s dtype and device."""
        local = like.new_zeros(self.layout.shard_numel)
        for piece, _, lo, hi in self.pieces:
            value = per_piece(piece)
            if value is not None:
                local[lo:hi] = value
        return self.gather_full(local)

    def local_part(self, slot: ParamSlot, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full parameter-shaped tensor ``full`` (a 1-D view)."""
        lo, hi = self.layout.local_range(slot, self.rank)
        start = self.rank * self.layout.shard_numel - slot.offset
        return full.reshape(-1)[start + lo : start + hi]

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.requires_gradient_sync = requires
        if not requires and self.accum is None and self.world_size > 1:
            # A stride-0 view of one element: a leaf of full shape that costs no memory until it has a grad.
            zero = torch.zeros((), dtype=self.reduce_dtype, device=self.flat.device)
            self.accum = zero.expand(self.layout.padded_numel).requires_grad_()
            self.accum.register_post_accumulate_grad_hook(_weak_hook(self._reduce_accumulated))

    def _reduce_accumulated(self, accum: torch.Tensor) -> None:
        """Post-accumulate hook of ``accum``: on the micro-batch that syncs, reduce-scatter once."""
        if not self.requires_gradient_sync or accum.grad is None:
            return
        reduced = reduce_scatter_avg(accum.grad, self.world_size, self.group_name)
        accum.grad = None
        self.accum = None
        counters["fsdp_compile"]["accumulated_reduce_scatters"] += 1
        self._deliver(reduced.to(self.flat.dtype))

    def _distribute_grad(self, flat: torch.Tensor) -> None:
        """Post-accumulate hook of the flat shard: hand each piece its slice, then clear ``flat.grad``."""
        grad = flat.grad
        flat.grad = None
        if grad is not None:
            self._deliver(grad)

    def _deliver(self, grad: torch.Tensor) -> None:
        for piece, _, lo, hi in self.pieces:
            if not piece.requires_grad:
                continue
            if piece.grad is None:
                piece.grad = grad[lo:hi]
            else:
                piece.grad.add_(grad[lo:hi])

    def _release_regathered(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._regathered = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.gathered = self.gather()
        if self.world_size > 1 and self.reshard_after_forward:
            live_gathers[self.gathered.untyped_storage().data_ptr()] = self
            self._hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            self._hooks[-1].__enter__()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or self.gathered is None:
            return
        if self._hooks:
            self._hooks.pop().__exit__(None, None, None)
            del live_gathers[self.gathered.untyped_storage().data_ptr()]
        self.gathered = None


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls ``method`` without keeping its object alive (see ``_units_by_shard``)."""
    ref = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(tensor)

    return hook


def _param_property(name: str) -> property:
    def fget(module: nn.Module) -> torch.Tensor:
        state, slot = getattr(module, _SLOTS_ATTR)[name]
        return state.unshard_param(slot)

    return property(fget, doc=f"The full parameter {name!r}, gathered from its FSDP unit.")


_SHARDED_CLASSES: dict[tuple[type[nn.Module], tuple[str, ...]], type[nn.Module]] = {}


def _sharded_class(cls: type[nn.Module], names: tuple[str, ...]) -> type[nn.Module]:
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        props: dict[str, Any] = {name: _param_property(name) for name in names}
        props["__module__"] = cls.__module__
        _SHARDED_CLASSES[key] = type(f"FSDP{cls.__name__}", (cls,), props)
    return _SHARDED_CLASSES[key]


def _unit_predicate(units: UnitSpec) -> Callable[[str, nn.Module], bool]:
    if callable(units) and not isinstance(units, type):
        return units  # type: ignore[return-value]
    classes = tuple(units)  # type: ignore[arg-type]
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            "units must be an iterable of nn.Module subclasses (e.g. units=[TransformerBlock]) or a "
            f"predicate (fqn, module) -> bool, got {units!r}"
        )
    return lambda fqn, module: isinstance(module, classes)


def shard(
    module: nn.Module,
    *,
    units: UnitSpec,
    group: dist.ProcessGroup | None = None,
    mp: MixedPrecision | None = None,
    reshard_after_forward: bool | Callable[[str, nn.Module], bool] = True,
) -> nn.Module:
    """Shard ``module`` in place into FSDP units and return it.

    ``units``: module classes, or a predicate ``(fqn, submodule) -> bool``; every matching submodule is a
    unit, the parameters left over form the root unit. Tied parameters must be owned by modules of one
    unit. ``group``: the process group to shard over (default: the default group). ``mp``: the
    all-gather and reduce-scatter dtypes; the shards keep the model's dtype.
    ``reshard_after_forward``: ``True`` (default): every unit's gathered parameters are dropped after its
    forward and gathered again in backward. ``False``, or a predicate ``(unit fqn, unit module) -> bool``
    (``""`` and ``module`` for the root unit) that is false for some units: those keep their gathered
    parameters from forward to backward (one all-gather less, one gathered unit more in memory until its
    backward). Worth it for the unit the forward uses last (e.g. the output projection): backward needs it
    first, so it is alive at the forward/backward boundary either way.

    Every check happens before the module is touched: on an error, the module is left as it was.
    """
    if getattr(module, _STATE_ATTR, None) is not None or any(hasattr(m, _SLOTS_ATTR) for m in module.modules()):
        raise ValueError(
            f"{type(module).__name__} (or one of its submodules) is already sharded by fsdp_compile.shard(); "
            "shard a model once, from its top-level module"
        )
    if mp is None:
        mp = MixedPrecision()
    elif not isinstance(mp, MixedPrecision):
        raise TypeError(f"mp must be a fsdp_compile.MixedPrecision, got {type(mp).__name__}")
    if not isinstance(reshard_after_forward, bool) and not callable(reshard_after_forward):
        raise TypeError(
            "reshard_after_forward must be a bool or a predicate (unit fqn, unit module) -> bool, "
            f"got {reshard_after_forward!r}"
        )
    group = _resolve_group(group)
    is_unit = _unit_predicate(units)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)

    # Unit of every module: the nearest enclosing unit root ("" = the root unit).
    unit_of: dict[str, str] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        parent = fqn.rpartition(".")[0] if fqn else None
        unit_of[fqn] = fqn if (fqn == "" or is_unit(fqn, sub)) else unit_of[parent]  # type: ignore[index]
    if set(unit_of.values()) == {""} and not is_unit("", module):
        raise ValueError(
            f"units={units!r} matched no submodule of {type(module).__name__}: pass the classes of the blocks "
            "to shard one by one (e.g. units=[TransformerBlock]) or a predicate (fqn, module) -> bool"
        )

    # Owners of every parameter (a tied weight has several), in named_parameters order.
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is None:
                continue
            entry = (sub, name, f"{fqn}.{name}" if fqn else name)
            if all(o[0] is not sub or o[1] != name for o in owners.get(param, [])):
                owners.setdefault(param, []).append(entry)
    _check_parameters(module, owners)

    by_unit: dict[str, list[nn.Parameter]] = {}
    for param, owned in owners.items():
        param_units = {unit_of[fqn.rpartition(".")[0]] for _, _, fqn in owned}
        if len(param_units) > 1:
            names = [fqn for _, _, fqn in owned]
            raise ValueError(
                f"parameter {names[0]!r} is shared by modules of different units {sorted(param_units)} "
                f"(names {names}); a tied parameter must belong to one unit: leave the modules that share it "
                "out of `units` (the root unit then owns it) or make their common parent the unit"
            )
        by_unit.setdefault(param_units.pop(), []).append(param)

    unit_order = list(dict.fromkeys(unit_of.values()))

    def reshard(unit_fqn: str) -> bool:
        if isinstance(reshard_after_forward, bool):
            return reshard_after_forward
        return bool(reshard_after_forward(unit_fqn, module.get_submodule(unit_fqn)))

    built = [
        _build_unit(unit_fqn, by_unit[unit_fqn], owners, group, world_size, rank, mp, reshard(unit_fqn))
        for unit_fqn in unit_order
        if unit_fqn in by_unit
    ]

    # Mutate the module only once every unit is built.
    _watch_optimizers()
    sharded_modules: dict[int, nn.Module] = {}
    for state, originals in built:
        for (piece, slot, _, _), original in zip(state.pieces, originals):
            setattr(original, _REPLACED_ATTR, slot.names[0])
            for sub, name, _ in owners[original]:
                sub._parameters[name] = piece
                sub.__dict__.setdefault(_SLOTS_ATTR, {})[name] = (state, slot)
                sharded_modules[id(sub)] = sub
        unit_module = module.get_submodule(state.layout.fqn)
        unit_module.register_forward_pre_hook(state._pre_forward)
        unit_module.register_forward_hook(state._post_forward)
        state.flat.register_post_accumulate_grad_hook(_weak_hook(state._distribute_grad))
    for sub in sharded_modules.values():
        sub.__class__ = _sharded_class(type(sub), tuple(sorted(getattr(sub, _SLOTS_ATTR))))
    states = [state for state, _ in built]
    object.__setattr__(module, _STATE_ATTR, states)
    log.info("fsdp_compile.shard: %d units over %d ranks: %s", len(states), world_size, states)
    return module


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "fsdp_compile.shard() needs a process group: call torch.distributed.init_process_group() "
                "first (one process per rank) or pass group=..."
            )
        return dist.group.WORLD  # type: ignore[return-value]
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


def _check_parameters(module: nn.Module, owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]]) -> None:
    if not owners:
        raise ValueError(f"{type(module).__name__} has no parameters to shard")
    devices: dict[torch.device, str] = {}
    for p, owned in owners.items():
        devices.setdefault(p.device, owned[0][2])
    if len(devices) > 1:
        found = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        raise ValueError(f"parameters on several devices ({found}): move the whole model to one device first")
    meta = [owned[0][2] for p, owned in owners.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"parameters on the meta device ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): "
            "materialize them before shard(), e.g. module.to_empty(device=...) and initialize the weights"
        )


def _build_unit(
    unit_fqn: str,
    params: list[nn.Parameter],
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]],
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    mp: MixedPrecision,
    reshard_after_forward: bool,
) -> tuple[UnitState, list[nn.Parameter]]:
    """Copy this rank's chunk of the unit into a new flat shard and cut one piece per parameter."""
    dtypes = {p.dtype: owners[p][0][2] for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"unit {unit_fqn or '<root>'!r} mixes parameter dtypes {dtypes}; a unit's parameters share one flat "
            "buffer of one dtype: convert the model (e.g. model.float()) before shard()"
        )
    layout = plan_layout(
        unit_fqn, [(tuple(fqn for _, _, fqn in owners[p]), tuple(p.shape)) for p in params], world_size
    )
    (dtype,) = dtypes
    device = params[0].device
    full = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for slot, param in zip(layout.slots, params):
        full[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
    start = rank * layout.shard_numel
    flat = full[start : start + layout.shard_numel].clone().requires_grad_(any(p.requires_grad for p in params))
    pieces = []
    for slot, param in zip(layout.slots, params):
        lo, hi = layout.local_range(slot, rank)
        piece = nn.Parameter(flat.detach()[lo:hi], requires_grad=param.requires_grad)
        pieces.append((piece, slot, lo, hi))
    param_dtype = mp.param_dtype or dtype
    reduce_dtype = mp.reduce_dtype or param_dtype
    state = UnitState(
        layout=layout,
        flat=flat,
        pieces=pieces,
        group=group,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        exchange=mp.exchange_grads_in_param_dtype and reduce_dtype.itemsize > param_dtype.itemsize,
        reshard_after_forward=reshard_after_forward,
    )
    _units_by_shard[id(flat)] = state
    return state, params


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Gradient accumulation without a reduce-scatter per micro-batch (trades memory for bandwidth).

    With ``False``, each unit accumulates its full, unreduced gradient (in ``reduce_dtype``: one unit's
    size per unit, on every rank) and backward runs no collective. Set it back to ``True`` before the
    last micro-batch: that backward adds its gradient and reduce-scatters the sum ONCE per unit, then
    the pieces' ``.grad`` hold the averaged gradient as usual. The compiled graphs are specialized on the
    mode (one recompilation the first time it changes).

        fsdp_compile.set_requires_gradient_sync(model, False)
        for micro in batches[:-1]:
            model(micro).backward()
        fsdp_compile.set_requires_gradient_sync(model, True)
        model(batches[-1]).backward()
        optimizer.step()
    """
    for state in sharded_units(module):
        state.set_requires_gradient_sync(requires_gradient_sync)


def sharded_units(module: nn.Module) -> list[UnitState]:
    """The units of a module that ``shard()`` has sharded (root unit first, then in module order)."""
    states = getattr(module, _STATE_ATTR, None)
    if states is None:
        raise ValueError(f"{type(module).__name__} is not sharded: call fsdp_compile.shard(module, units=...) first")
    return list(states)


def unit_of_shard(tensor: object) -> UnitState | None:
    """The unit whose flat shard ``tensor`` is, or None."""
    state = _units_by_shard.get(id(tensor))
    return state if state is not None and state.flat is tensor else None
