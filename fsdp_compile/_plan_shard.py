"""Plan the sharding of a module: which parameters form which FSDP unit (and, where a unit's parameters differ
in dtype or ``requires_grad``, which group of it), where each lies in its group's flat buffer, and the
collective settings. Pure: reads the module, changes nothing, and depends on the
world size but not on the rank, so every rank plans the same. Every check of ``shard()``'s input happens
here, so that a refused call leaves the module untouched.

Example (``units=[Block]`` on a two-block model with a tied embedding, 2 ranks)::

    ShardPlan(world_size=2, units=(
        UnitPlan(layout=UnitLayout(fqn="", slots=(ParamSlot(names=("emb.weight", "out.weight"), ...), ...)), ...),
        UnitPlan(layout=UnitLayout(fqn="layers.0", ...), ...),
        UnitPlan(layout=UnitLayout(fqn="layers.1", ...), ...)))
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from fsdp_compile._internals import OptimizedModule
from fsdp_compile._layout import UnitLayout, plan_layout
from fsdp_compile.config import MixedPrecision
from fsdp_compile.runtime.float8 import Float8Weight
from fsdp_compile.runtime.ops import GradReduction

__all__ = ["ReshardSpec", "ShardPlan", "UnitPlan", "UnitSpec", "plan_shard"]

UnitSpec = Union[type[nn.Module], Iterable[type[nn.Module]], Callable[[str, nn.Module], bool]]
"""Module classes (or one), or a predicate ``(fqn, submodule) -> bool``: the submodules that are units."""
ReshardSpec = Union[bool, Callable[[str, nn.Module], bool]]
"""Whether to reshard every unit after forward, or a predicate ``(unit fqn, unit module) -> bool``."""


@dataclass(frozen=True)
class UnitPlan:
    """One unit (or one parameter group of a unit, ``layout.part``): its flat-buffer layout (parameters by name)
    and its collective settings."""

    layout: UnitLayout
    dtype: torch.dtype
    """The parameters' dtype: the flat shard's (the optimizer's main weights)."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_reduction: GradReduction
    reshard_after_forward: bool
    float8: tuple[Float8Weight, ...] = ()
    """torchao float8 weights gathered as float8 (every slot of the buffer, in order); empty: gathered in
    ``param_dtype``."""


@dataclass(frozen=True)
class ShardPlan:
    units: tuple[UnitPlan, ...]
    """The root unit first (if it has parameters), then the units in module order."""
    world_size: int
    offload_pin_memory: bool | None = None
    """CPU offload (FSDP2's ``CPUOffloadPolicy``): whether the host shards are pinned. None: not offloaded."""
    float8_not_tensorwise: bool = False
    """Whether torchao float8 layers that are not tensorwise (rowwise) compute in float8: their weights travel in
    ``param_dtype`` (torchao gathers float8 for tensorwise scaling only, for FSDP2 too)."""

    def to_json(self) -> str:
        return json.dumps({"world_size": self.world_size, "offload_pin_memory": self.offload_pin_memory,
                           "float8_not_tensorwise": self.float8_not_tensorwise,
                           "units": [_unit_json(u) for u in self.units]})


def _unit_json(unit: UnitPlan) -> dict[str, object]:
    layout = unit.layout
    return {
        "fqn": layout.fqn,
        "part": layout.part,
        "dtype": str(unit.dtype),
        "param_dtype": str(unit.param_dtype),
        "reduce_dtype": str(unit.reduce_dtype),
        "grad_reduction": unit.grad_reduction,
        "reshard_after_forward": unit.reshard_after_forward,
        "float8": str(unit.float8[0].float8_dtype) if unit.float8 else None,
        "padded_numel": layout.padded_numel,
        "shard_numel": layout.shard_numel,
        "params": [{"names": s.names, "offset": s.offset, "numel": s.numel, "shape": s.shape} for s in layout.slots],
    }


class _Owner(NamedTuple):
    """A module that holds a parameter, under ``name``; ``fqn`` is the parameter's full name through it."""

    module: nn.Module
    name: str
    fqn: str


def plan_shard(
    module: nn.Module,
    *,
    units: UnitSpec,
    world_size: int,
    mp: MixedPrecision | None = None,
    reshard_after_forward: ReshardSpec = True,
    offload_policy: OffloadPolicy | None = None,
) -> ShardPlan:
    """The units of ``module`` and their layouts over ``world_size`` ranks (see ``fsdp_compile.shard``)."""
    mp = _check_mixed_precision(mp)
    pin = _check_offload_policy(offload_policy)
    _check_reshard_spec(reshard_after_forward)
    _check_not_compiled(module)
    unit_of = _unit_of_modules(module, units)
    owners = _owners(module)
    _check_parameters(module, owners)
    by_unit: dict[str, list[nn.Parameter]] = {}
    for param, owned in owners.items():
        by_unit.setdefault(_unit_of_parameter(owned, unit_of), []).append(param)

    def reshard(unit_fqn: str) -> bool:
        if isinstance(reshard_after_forward, bool):
            return reshard_after_forward
        return bool(reshard_after_forward(unit_fqn, module.get_submodule(unit_fqn)))

    planned = []
    for unit_fqn in dict.fromkeys(unit_of.values()):  # the root first, then units in module order
        float8 = {p: _float8_cast(owners[p]) for p in by_unit.get(unit_fqn, [])}
        groups = _parameter_groups(by_unit.get(unit_fqn, []), float8)
        resharded = reshard(unit_fqn) if groups else False
        for (dtype, trainable, gathered_float8), params in groups.items():
            part = _part(dtype, trainable, gathered_float8) if len(groups) > 1 else ""
            names = [(tuple(o.fqn for o in owners[p]), tuple(p.shape)) for p in params]
            layout = plan_layout(unit_fqn, names, world_size, part)
            weights = tuple(Float8Weight(slot.offset, slot.numel, slot.shape, *float8[p])  # type: ignore[misc]
                            for slot, p in zip(layout.slots, params)) if gathered_float8 else ()
            planned.append(_unit_plan(layout, dtype, mp, resharded, weights))
    float8_linear = _float8_linear()
    not_tensorwise = float8_linear is not None and any(
        isinstance(m, float8_linear) and m.config.cast_config_weight.scaling_granularity.name != "TENSORWISE"
        for m in module.modules())
    return ShardPlan(units=tuple(planned), world_size=world_size, offload_pin_memory=pin,
                     float8_not_tensorwise=not_tensorwise)


def _check_mixed_precision(mp: MixedPrecision | None) -> MixedPrecision:
    if mp is None:
        return MixedPrecision()
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mp must be a fsdp_compile.MixedPrecision, got {type(mp).__name__}")
    return mp


def _check_offload_policy(policy: object) -> bool | None:
    """FSDP2's offload policies: ``CPUOffloadPolicy`` -> whether to pin; ``OffloadPolicy()`` or None -> None."""
    if policy is None or type(policy) is OffloadPolicy:
        return None
    if not isinstance(policy, CPUOffloadPolicy):
        raise TypeError(
            f"offload_policy must be torch.distributed.fsdp.CPUOffloadPolicy (or OffloadPolicy(): none), as FSDP2's "
            f"fully_shard takes it, got {type(policy).__name__}"
        )
    return bool(policy.pin_memory)


def _check_reshard_spec(reshard_after_forward: object) -> None:
    if not isinstance(reshard_after_forward, bool) and not callable(reshard_after_forward):
        raise TypeError(
            "reshard_after_forward must be a bool or a predicate (unit fqn, unit module) -> bool, "
            f"got {reshard_after_forward!r}"
        )


def _check_not_compiled(module: nn.Module) -> None:
    compiled = [fqn or "<the module itself>" for fqn, sub in module.named_modules() if isinstance(sub, OptimizedModule)]
    if compiled:
        raise TypeError(
            f"{type(module).__name__} holds modules wrapped by torch.compile ({', '.join(compiled[:3])}): shard the "
            "plain model first, then compile it whole: fsdp_compile.shard(model, units=...); "
            "model = torch.compile(model, backend='fsdp_compile')"
        )


def _unit_predicate(units: UnitSpec) -> Callable[[str, nn.Module], bool]:
    if callable(units) and not isinstance(units, type):
        return units  # type: ignore[return-value]
    classes = (units,) if isinstance(units, type) else tuple(units)  # type: ignore[arg-type]  # units=Block too
    if not classes:
        raise ValueError(
            f"units={units!r} names no unit: name at least one nn.Module subclass (e.g. units=[TransformerBlock]) or "
            "pass a predicate (fqn, module) -> bool; the parameters no unit holds form the root unit, so a model with "
            "no units would be gathered whole in one all-gather"
        )
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            "units must be an iterable of nn.Module subclasses (e.g. units=[TransformerBlock]) or a "
            f"predicate (fqn, module) -> bool, got {units!r}"
        )
    return lambda fqn, module: isinstance(module, classes)


def _unit_of_modules(module: nn.Module, units: UnitSpec) -> dict[str, str]:
    """Module fqn -> the fqn of its unit: the nearest enclosing unit root ("" = the root unit)."""
    is_unit = _unit_predicate(units)
    unit_of: dict[str, str] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        parent = fqn.rpartition(".")[0] if fqn else None
        unit_of[fqn] = fqn if (fqn == "" or is_unit(fqn, sub)) else unit_of[parent]  # type: ignore[index]
    if set(unit_of.values()) == {""} and not is_unit("", module):
        raise ValueError(
            f"units={units!r} matched no submodule of {type(module).__name__}: pass the classes of the blocks "
            "to shard one by one (e.g. units=[TransformerBlock]) or a predicate (fqn, module) -> bool"
        )
    return unit_of


def _owners(module: nn.Module) -> dict[nn.Parameter, list[_Owner]]:
    """The owners of every parameter (a tied weight has several), in ``named_parameters`` order."""
    owners: dict[nn.Parameter, list[_Owner]] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is None:
                continue
            known = owners.setdefault(param, [])
            if all(o.module is not sub or o.name != name for o in known):
                known.append(_Owner(sub, name, f"{fqn}.{name}" if fqn else name))
    return owners


def _check_parameters(module: nn.Module, owners: dict[nn.Parameter, list[_Owner]]) -> None:
    if not owners:
        raise ValueError(f"{type(module).__name__} has no parameters to shard")
    devices: dict[torch.device, str] = {}
    for p, owned in owners.items():
        if not p.is_meta:  # parameters on meta are allocated by to_empty(device=) after shard(), on that device
            devices.setdefault(p.device, owned[0].fqn)
    if len(devices) > 1:
        found = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        raise ValueError(f"parameters on several devices ({found}): move the whole model to one device first")


def _unit_of_parameter(owned: list[_Owner], unit_of: dict[str, str]) -> str:
    units = {unit_of[o.fqn.rpartition(".")[0]] for o in owned}
    if len(units) > 1:
        names = [o.fqn for o in owned]
        raise ValueError(
            f"parameter {names[0]!r} is shared by modules of different units {sorted(units)} "
            f"(names {names}); a tied parameter must belong to one unit: leave the modules that share it "
            "out of `units` (the root unit then owns it) or make their common parent the unit"
        )
    return units.pop()


def _parameter_groups(
    params: list[nn.Parameter], float8: dict[nn.Parameter, tuple[object, ...] | None]
) -> dict[tuple[torch.dtype, bool, object], list[nn.Parameter]]:
    """A unit's parameters by (dtype, requires_grad, the float8 dtype they are gathered in or None), in order of first
    appearance: one flat buffer each, so that only trainable parameters take part in the gradient, every parameter is
    a contiguous view of its buffer in its own dtype, and the float8 weights travel in a buffer of their own (see
    [Note: parameter groups] and [Note: float8 all-gather] in docs/architecture.md)."""
    groups: dict[tuple[torch.dtype, bool, object], list[nn.Parameter]] = {}
    for p in params:
        cast = float8[p]
        groups.setdefault((p.dtype, p.requires_grad, None if cast is None else cast[0]), []).append(p)
    return groups


def _float8_linear() -> type[nn.Module] | None:
    """torchao's ``Float8Linear`` if torchao's float8 training is loaded (a model converted to it has loaded it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return None if module is None else module.Float8Linear


def _float8_cast(owned: list[_Owner]) -> tuple[object, ...] | None:
    """How torchao casts a weight that it gathers as float8 for FSDP2 (``Float8LinearConfig(
    enable_fsdp_float8_all_gather=True)``, which torchao allows for tensorwise scaling only): the float8 dtype, the
    module's ``LinearMMConfig`` as nested tuples, the scales' rounding; None for any other parameter (a weight tied to
    a module that is not such a layer too)."""
    float8_linear = _float8_linear()
    if float8_linear is None:
        return None
    casts = set()
    for owner in owned:
        module = owner.module
        if owner.name != "weight" or not isinstance(module, float8_linear):
            return None
        config = module.config
        if not config.enable_fsdp_float8_all_gather:
            return None
        casts.add((config.cast_config_weight.target_dtype, tuple(tuple(gemm) for gemm in module.linear_mm_config),
                   config.round_scales_to_power_of_2))
    return casts.pop() if len(casts) == 1 else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _part(dtype: torch.dtype, trainable: bool, gathered_as: object) -> str:
    """A parameter group's name, e.g. ``"float32 trainable"``, ``"float32 trainable as float8_e4m3fn"``."""
    gathered = f" as {_dtype_name(gathered_as)}" if isinstance(gathered_as, torch.dtype) else ""
    return f"{_dtype_name(dtype)} {'trainable' if trainable else 'frozen'}{gathered}"


def _unit_plan(
    layout: UnitLayout, dtype: torch.dtype, mp: MixedPrecision, reshard: bool, float8: tuple[Float8Weight, ...] = ()
) -> UnitPlan:
    """One buffer's settings: ``mp`` applies to floating dtypes; integer and bool parameters are gathered as they
    are (they have no gradient)."""
    param_dtype = (mp.param_dtype or dtype) if dtype.is_floating_point else dtype
    reduce_dtype = (mp.reduce_dtype or param_dtype) if dtype.is_floating_point else dtype
    exchange = mp.exchange_grads_in_param_dtype and reduce_dtype.itemsize > param_dtype.itemsize
    return UnitPlan(
        layout=layout,
        dtype=dtype,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        grad_reduction="exchange" if exchange else "reduce_scatter",
        reshard_after_forward=reshard,
        float8=float8,
    )
