"""``shard()``: turn a module's parameters into one flat shard per FSDP unit, keeping names and ties.

After ``shard(model, units=...)``:

* every unit (each matching submodule, plus the root for the parameters left over) owns ONE flat buffer,
  padded to a multiple of the world size, or one per (dtype, ``requires_grad``) group where its parameters
  differ; this rank keeps its chunk as a plain leaf tensor (``UnitState.flat``, requiring a gradient if the
  group trains), neither parameter nor buffer;
* each original parameter is replaced, under its own name in ``module._parameters``, by a 1-D
  ``nn.Parameter`` *piece*: a view of the part of the flat shard that holds it on this rank (possibly
  empty). ``parameters()`` therefore yields only sharded storage, and optimizers keep sharded state;
* each module class is swapped for a cached subclass whose class-level property per parameter name
  returns the full parameter: under ``torch.compile`` a marker op (``fsdp_compile::unshard``) that the
  backend's passes turn into one all-gather per unit; in eager, a view of the unit's gathered buffer,
  filled by forward pre-hooks on the unit (or gathered on demand);
* gradients reach ``flat.grad`` (averaged over ranks) of the trainable groups; a post-accumulate-grad hook
  hands each piece its part and clears ``flat.grad``; a frozen group has no gradient and no reduction;
* HSDP (a 2-D ``mesh``): the units are sharded over the mesh's second dimension and replicated over its
  first; gradients are averaged over both (a reduce-scatter within the replica, then an all-reduce of the
  shard across the replicas).

``shard()`` is :func:`~fsdp_compile._plan_shard.plan_shard` (pure: every check) followed by
:func:`~fsdp_compile._apply_shard.apply_shard` (the mutation).
"""

from __future__ import annotations

import functools
import json

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from fsdp_compile import debug
from fsdp_compile._agree import agree_on_values, fingerprint
from fsdp_compile._apply_shard import apply_shard
from fsdp_compile._layout import unit_label
from fsdp_compile._plan_shard import ReshardSpec, ShardPlan, UnitSpec, plan_shard
from fsdp_compile._step_in_backward import refuse_inside_step_in_backward
from fsdp_compile._unit import is_sharded, sharded_units
from fsdp_compile.config import MixedPrecision

__all__ = ["set_requires_gradient_sync", "shard"]


def shard(
    module: nn.Module,
    *,
    units: UnitSpec,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    mp: MixedPrecision | None = None,
    reshard_after_forward: ReshardSpec = True,
    sync_module_states: bool = False,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``module`` in place into FSDP units and return it.

    ``units``: module classes (or one), or a predicate ``(fqn, submodule) -> bool``; every matching submodule is a
    unit, the parameters left over form the root unit. Tied parameters must be owned by modules of one
    unit. ``group``: the process group to shard over (default: the default group). ``mesh`` (instead of
    ``group``): a ``DeviceMesh`` of one dimension (shard over it) or two, ``(replicate, shard)`` as FSDP2's
    HSDP: shard over the second dimension, replicate over the first; gradients are averaged over all the
    mesh's ranks. ``mp``: the all-gather and reduce-scatter dtypes; the shards keep the model's dtype.
    ``reshard_after_forward``: ``True`` (default): every unit's gathered parameters are dropped after its
    forward and gathered again in backward. ``False``, or a predicate ``(unit fqn, unit module) -> bool``
    (``""`` and ``module`` for the root unit) that is false for some units: those keep their gathered
    parameters from forward to backward (one all-gather less, one gathered unit more in memory until its
    backward). Worth it for the unit the forward uses last (e.g. the output projection): backward needs it
    first, so it is alive at the forward/backward boundary either way. ``offload_policy``: FSDP2's
    ``torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=True)`` keeps every flat shard and its gradient in host
    memory (``model.parameters()`` are host tensors: the optimizer steps there; use ``fused=True`` AdamW): each
    unit's shard is copied to the device the model was on (or ``to_empty``'s) before its all-gather, its reduced
    gradient copied back (docs/big-models.md, "Offload").

    The ranks must start from the same values: ``shard()`` compares a fingerprint of each unit across the ranks
    and raises naming the first that differs; ``sync_module_states=True`` takes rank 0's parameters and buffers
    instead (a broadcast per unit). A model built on the meta device (parameters on meta, all or some units)
    is sharded as it is: ``module.to_empty(device=...)`` then allocates this rank's shards and the buffers,
    and :func:`fsdp_compile.init_parameters` (or a checkpoint) fills them.

    Every check happens before the module is touched: on an error, the module is left as it was.
    """
    if is_sharded(module):
        raise ValueError(
            f"{type(module).__name__} (or one of its submodules) is already sharded by fsdp_compile.shard(); "
            "shard a model once, from its top-level module"
        )
    if mesh is not None:
        group, replicate_group = _mesh_groups(mesh, group)
    else:
        group, replicate_group = _resolve_group(group), None
    plan = plan_shard(
        module, units=units, world_size=dist.get_world_size(group), mp=mp, reshard_after_forward=reshard_after_forward,
        offload_policy=offload_policy,
    )
    if not sync_module_states:
        fingerprints = functools.cache(lambda: _fingerprints(module, plan))
        for g in (group, replicate_group):
            if g is not None:
                agree_on_values(g, fingerprints)
    apply_shard(module, plan, group, replicate_group, sync_module_states=sync_module_states)
    if plan.float8_not_tensorwise:
        debug.degraded("float8_rowwise_gathered_in_param_dtype", (
            "torchao float8 layers with rowwise scaling: their weights are gathered in param_dtype and cast to float8 "
            "by torchao after the gather (torchao gathers float8, enable_fsdp_float8_all_gather, for tensorwise "
            "scaling only, as with FSDP2)"))
    return module


def _mesh_groups(
    mesh: DeviceMesh, group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(the group to shard over, the group to replicate over or None) of a 1-D or ``(replicate, shard)`` mesh."""
    if group is not None:
        raise ValueError("pass group= or mesh= to fsdp_compile.shard(), not both: the mesh names the groups")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fsdp_compile.shard() takes a mesh of 1 dimension (shard) or 2 (replicate, shard), got {mesh.ndim} "
            f"dimensions {mesh.mesh_dim_names or ''}: slice the mesh, e.g. mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not in the mesh passed as mesh=: {mesh}")
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    return mesh.get_group(1), mesh.get_group(0)


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "fsdp_compile.shard() needs a process group: call torch.distributed.init_process_group() "
                "first (one process per rank) or pass group=..."
            )
        return dist.group.WORLD  # type: ignore[return-value]
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of the process group passed as group=: "
            "call fsdp_compile.shard(..., group=g) only on the ranks in g (dist.new_group(ranks) returns "
            "GroupMember.NON_GROUP_MEMBER on the others)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


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
    units = sharded_units(module)
    if not requires_gradient_sync:
        refuse_inside_step_in_backward(units, "set_requires_gradient_sync(model, False)", (
            "a micro-batch without gradient sync has no optimizer step. Accumulate outside it; wrap only the last "
            "micro-batch's backward"))
    for state in units:
        state.set_requires_gradient_sync(requires_gradient_sync)


def _fingerprints(module: nn.Module, plan: ShardPlan) -> list[tuple[str, str, str]]:
    """(unit, layout, values) of each materialised unit, for comparing the ranks' starting weights."""
    out = []
    for unit in plan.units:
        params = [module.get_parameter(slot.names[0]) for slot in unit.layout.slots]
        if not any(p.is_meta for p in params):
            layout = json.dumps([(slot.names, slot.shape) for slot in unit.layout.slots])
            out.append((unit_label(unit.layout.name), layout, fingerprint(params)))
    return out
