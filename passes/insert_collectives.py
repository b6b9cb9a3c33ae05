"""Replace the per-parameter ``unshard`` markers of each unit by ONE all-gather and a view per parameter.

Precondition: a Dynamo graph whose reads of sharded parameters are ``fsdp_compile::unshard`` markers on
placeholders that ``map_unit_inputs`` identified as flat shards.
Postcondition: no marker is left; each unit that was read has exactly one ``cast_all_gather_differentiable`` call per
(sub)graph that reads it, placed just before the unit's first read there (a unit read inside a
checkpointed region is gathered inside the region, so its recomputation re-gathers it once), whose
output is narrowed and viewed into the parameters. Its autograd (see ``fsdp_compile.runtime.ops``) makes
AOTAutograd emit one gradient reduction per unit in the backward graph (a reduce-scatter, or an
all-to-all when gradients travel in ``param_dtype``), followed, for a replicated unit (HSDP), by an all-reduce
of the reduced shard over the replicas.

Example (a unit with two parameters)::

    w = fsdp_compile.unshard(flat_1, None, 0, 64, [8, 8], torch.float32)
    b = fsdp_compile.unshard(flat_1, None, 64, 8, [8], torch.float32)
  becomes
    full = cast_all_gather_differentiable(flat_1, None, torch.float32, torch.float32, "reduce_scatter", 2, "0", 1, None)
    w = torch.narrow(full, 0, 0, 64).view([8, 8])
    b = torch.narrow(full, 0, 64, 8).view([8])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fsdp_compile._layout import UNIT, ParamSlot
from fsdp_compile._unit import UnitState
from fsdp_compile.passes._graph import lint_and_recompile, plan_json
from fsdp_compile.passes.map_unit_inputs import UnitInputsPlan, iter_graphs
from fsdp_compile.runtime.ops import (
    KEEP_GATHERED,
    GradReduction,
    cast_all_gather_differentiable,
    unshard,
)

__all__ = ["CollectivesPlan", "UnitGather", "apply_collectives", "is_marker", "plan_collectives"]

log = logging.getLogger(__name__)

_MARKER_OP = torch.ops.fsdp_compile.unshard


class ParamView(NamedTuple):
    """One marker to replace (node name) and the parameter it reads (its place in the gathered buffer)."""

    marker: str
    slot: ParamSlot


@dataclass(frozen=True)
class UnitGather:
    """One all-gather: the unit's flat-shard placeholder, its collective settings and the views it feeds."""

    unit: str
    graph: str
    """Dotted path of the (sub)graph holding the markers: "" for the Dynamo graph itself."""
    shard: str
    accum: str | None
    """Placeholder of the unit's unsharded gradient accumulator (gradient sync off), or None."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_reduction: GradReduction
    reshard_after_forward: bool
    world_size: int
    group_name: str
    replicas: int
    """HSDP: the number of replicas the reduced gradient is then averaged over (1: not replicated)."""
    replicate_group_name: str | None
    views: tuple[ParamView, ...]


@dataclass(frozen=True)
class CollectivesPlan:
    gathers: tuple[UnitGather, ...]

    def to_json(self) -> str:
        return plan_json(self)


def _slot(state: UnitState, offset: int, numel: int, shape: tuple[int, ...]) -> ParamSlot:
    for slot in state.layout.slots:
        if (slot.offset, slot.numel, slot.shape) == (offset, numel, shape):
            return slot
    raise AssertionError(f"unit {state.layout.name!r} has no parameter at offset {offset} of shape {shape}")


def is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_MARKER_OP, _MARKER_OP.default, unshard)


def plan_collectives(gm: fx.GraphModule, unit_inputs: UnitInputsPlan) -> CollectivesPlan:
    """One gather per unit and (sub)graph that reads it, in graph order."""
    views: dict[tuple[str, str], list[ParamView]] = {}
    accums: dict[tuple[str, str], str | None] = {}
    for path, graph_module in iter_graphs(gm):
        for node in graph_module.graph.nodes:
            if not is_marker(node):
                continue
            args = normalize_function(_MARKER_OP.default, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
            assert args is not None
            kwargs = args.kwargs
            shard = kwargs["flat"]
            key = (path, shard.name if isinstance(shard, fx.Node) else "")
            if key not in unit_inputs.units:
                raise RuntimeError(
                    f"{node.format_node()} reads a sharded parameter through {shard}, which is not a unit's "
                    "flat shard lifted as a graph input; compute on the module's parameters, not on copies of "
                    "its internal shard"
                )
            state = unit_inputs.units[key]
            if kwargs["dtype"] != state.param_dtype:
                raise AssertionError(f"{node.name}: marker dtype {kwargs['dtype']} != unit dtype {state.param_dtype}")
            accum = kwargs["accum"].name if isinstance(kwargs["accum"], fx.Node) else None
            if accums.setdefault(key, accum) != accum:
                raise AssertionError(f"{node.name}: unit {state.layout.name!r} read with two gradient accumulators")
            view = ParamView(node.name, _slot(state, kwargs["offset"], kwargs["numel"], tuple(kwargs["shape"])))
            views.setdefault(key, []).append(view)
    gathers = []
    for (path, shard_name), unit_views in views.items():
        state = unit_inputs.units[(path, shard_name)]
        gathers.append(
            UnitGather(
                unit=state.layout.name,
                graph=path,
                shard=shard_name,
                accum=accums[(path, shard_name)],
                param_dtype=state.param_dtype,
                reduce_dtype=state.reduce_dtype,
                grad_reduction=state.grad_reduction,
                reshard_after_forward=state.reshard_after_forward,
                world_size=state.world_size,
                group_name=state.group_name,
                replicas=state.replicas,
                replicate_group_name=state.replicate_group_name,
                views=tuple(unit_views),
            )
        )
    return CollectivesPlan(gathers=tuple(gathers))


def _add(graph: fx.Graph, op: str, target: object, args: tuple[object, ...]) -> fx.Node:
    """Create a node and record its fake value, computed from its inputs' fake values."""
    node = graph.create_node(op, target, args)  # type: ignore[arg-type]
    fake_args = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args]
    fake_mode = next(a.fake_mode for a in fake_args if isinstance(a, torch.Tensor))  # type: ignore[attr-defined]
    with fake_mode:
        value = getattr(fake_args[0], target)(*fake_args[1:]) if op == "call_method" else target(*fake_args)  # type: ignore[operator]
    node.meta["example_value"] = node.meta["val"] = value
    return node


def apply_collectives(gm: fx.GraphModule, plan: CollectivesPlan) -> None:
    touched = {}
    for gather in plan.gathers:
        graph_module = gm.get_submodule(gather.graph) if gather.graph else gm
        touched[gather.graph] = graph_module
        graph = graph_module.graph
        nodes = {n.name: n for n in graph.nodes}
        markers = [nodes[v.marker] for v in gather.views]
        with graph.inserting_before(markers[0]):
            full = _add(
                graph,
                "call_function",
                cast_all_gather_differentiable,
                (
                    nodes[gather.shard],
                    nodes[gather.accum] if gather.accum else None,
                    gather.param_dtype,
                    gather.reduce_dtype,
                    gather.grad_reduction,
                    gather.world_size,
                    gather.group_name,
                    gather.replicas,
                    gather.replicate_group_name,
                ),
            )
            keep = {KEEP_GATHERED: True} if not gather.reshard_after_forward else {}
            full.meta["custom"] = {**full.meta.get("custom", {}), UNIT: gather.unit, **keep}
        for view, marker in zip(gather.views, markers):
            with graph.inserting_before(marker):
                narrowed = _add(graph, "call_function", torch.narrow, (full, 0, view.slot.offset, view.slot.numel))
                param = _add(graph, "call_method", "view", (narrowed, list(view.slot.shape)))
            param.meta["custom"] = {**param.meta.get("custom", {}), UNIT: gather.unit}
            marker.replace_all_uses_with(param)
            graph.erase_node(marker)
    leftover = [n.format_node() for _, g in iter_graphs(gm) for n in g.graph.nodes if is_marker(n)]
    if leftover:
        raise AssertionError(f"insert_collectives left markers behind: {leftover}")
    for graph_module in touched.values():
        lint_and_recompile(graph_module)
    log.debug("insert_collectives: %d all-gathers", len(plan.gathers))
