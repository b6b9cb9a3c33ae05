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

A shared body (a nested compile region: ``invoke_subgraph(body, identifier, *operands)`` at the top of the graph,
one body for every unit alike, [Note: shared bodies]) holds no collective: each call site gathers its own unit
before the call and passes the gathered unit as the operand, and the body reads its parameters as views of it.

Example (a unit with two parameters)::

    w = fsdp_compile.unshard(flat_1, None, 0, 64, [8, 8], torch.float32)
    b = fsdp_compile.unshard(flat_1, None, 64, 8, [8], torch.float32)
  becomes
    full = cast_all_gather_differentiable(flat_1, None, torch.float32, torch.float32, "reduce_scatter", 2, "0", 1, None)
    w = torch.narrow(full, 0, 0, 64).view([8, 8])
    b = torch.narrow(full, 0, 64, 8).view([8])
  and a shared body's call
    out = invoke_subgraph(body_0, "body_0", x, flat_1)       body_0(x, flat): w = unshard(flat, None, 0, 64, ...)
  becomes
    full = cast_all_gather_differentiable(flat_1, ...)
    out = invoke_subgraph(body_0, "body_0", x, full)         body_0(x, full): w = narrow(full, 0, 0, 64).view([8, 8])
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fsdp_compile._layout import UNIT, ParamSlot
from fsdp_compile._unit import UnitState
from fsdp_compile.passes._graph import lint_and_recompile, plan_json, region_calls
from fsdp_compile.passes.map_unit_inputs import UnitInputsPlan, iter_graphs
from fsdp_compile.runtime.float8 import Float8Weight, cast_all_gather_float8, float8_weight
from fsdp_compile.runtime.ops import (
    KEEP_GATHERED,
    GradReduction,
    cast_all_gather_differentiable,
    unshard,
)

__all__ = ["BodyInput", "CollectivesPlan", "UnitGather", "apply_collectives", "is_marker", "plan_collectives"]

log = logging.getLogger(__name__)

_MARKER_OP = torch.ops.fsdp_compile.unshard


class ParamView(NamedTuple):
    """One marker to replace (node name) and the parameter it reads (its place in the gathered buffer)."""

    marker: str
    slot: ParamSlot


@dataclass(frozen=True)
class UnitGather:
    """One all-gather: the unit's flat-shard placeholder, its collective settings and the views it feeds (or the
    shared body's call it feeds)."""

    unit: str
    graph: str
    """Dotted path of the (sub)graph holding the markers (or the call): "" for the Dynamo graph itself."""
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
    offload_to: str | None
    """CPU offload: the device the shard is copied to before its all-gather (None: not offloaded)."""
    views: tuple[ParamView, ...]
    call: str | None = None
    """A shared body's call that reads the unit (then ``views`` is empty: the body's ``BodyInput`` has them)."""
    float8: tuple[Float8Weight, ...] = ()
    """torchao float8 weights gathered as float8 (``fsdp_compile.runtime.float8``): every parameter of the unit."""
    start: str | None = None
    """For a float8 gather: the placeholder of where this rank's shard begins in the unit."""


@dataclass(frozen=True)
class BodyInput:
    """A shared body's placeholder for a unit's flat shard, which becomes the gathered unit: ``numel`` elements of
    ``dtype``, read by ``views``."""

    body: str
    placeholder: str
    numel: int
    dtype: torch.dtype
    device: str
    """Where the gathered unit is (CPU offload: not where its shard is)."""
    views: tuple[ParamView, ...]
    float8: tuple[Float8Weight, ...] = ()
    """A unit gathered as float8: its weights; the placeholder becomes the float8 bytes, and the scales and the
    carrier (``fsdp_compile.runtime.float8``) come in as two more placeholders after it."""


@dataclass(frozen=True)
class CollectivesPlan:
    gathers: tuple[UnitGather, ...]
    bodies: tuple[BodyInput, ...] = ()

    def to_json(self) -> str:
        return plan_json(self)


def _slot(state: UnitState, offset: int, numel: int, shape: tuple[int, ...]) -> ParamSlot:
    for slot in state.layout.slots:
        if (slot.offset, slot.numel, slot.shape) == (offset, numel, shape):
            return slot
    raise AssertionError(f"unit {state.layout.name!r} has no parameter at offset {offset} of shape {shape}")


def is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_MARKER_OP, _MARKER_OP.default, unshard)


def _gather(state: UnitState, graph: str, shard: str, accum: str | None, views: tuple[ParamView, ...],
            call: str | None = None, start: str | None = None) -> UnitGather:
    return UnitGather(
        unit=state.layout.name,
        graph=graph,
        shard=shard,
        accum=accum,
        param_dtype=state.param_dtype,
        reduce_dtype=state.reduce_dtype,
        grad_reduction=state.grad_reduction,
        reshard_after_forward=state.reshard_after_forward,
        world_size=state.world_size,
        group_name=state.group_name,
        replicas=state.replicas,
        replicate_group_name=state.replicate_group_name,
        offload_to=None if state.offload_to is None else str(state.offload_to),
        views=views,
        call=call,
        float8=state.float8,
        start=start,
    )


def _shape(state: UnitState) -> tuple[object, ...]:
    """What a shared body reads of a unit: its parameters' places in the gathered unit, its size and dtype."""
    slots = tuple((slot.offset, slot.numel, slot.shape) for slot in state.layout.slots)
    return slots, state.layout.padded_numel, state.param_dtype


def _body_calls(gm: fx.GraphModule, body: str, state: UnitState, shard: str, accum: str | None, start: str | None,
                unit_inputs: UnitInputsPlan) -> list[UnitGather]:
    """A gather before each call of the shared body ``body`` (a top-level region) for the unit that the call passes
    as the body's placeholder ``shard`` (and its gradient accumulator as ``accum``, a float8 unit's start as
    ``start``)."""
    placeholders = [n.name for n in getattr(gm, body).graph.find_nodes(op="placeholder")]
    gathers = []
    for call in region_calls(gm):
        if call.args[0].target != body:
            continue
        operands = dict(zip(placeholders, call.args[2:]))
        operand = operands[shard]
        unit = unit_inputs.units.get(("", operand.name)) if isinstance(operand, fx.Node) else None
        if unit is None or _shape(unit) != _shape(state):
            raise AssertionError(f"{call.name} passes {operand} where body {body} reads unit {state.layout.name!r}")
        call_accum, call_start = (operands[name].name if name is not None else None for name in (accum, start))
        gathers.append(_gather(unit, "", operand.name, call_accum, (), call.name, call_start))
    return gathers


def plan_collectives(gm: fx.GraphModule, unit_inputs: UnitInputsPlan) -> CollectivesPlan:
    """One gather per unit and (sub)graph that reads it, in graph order; for a shared body, one per call."""
    views: dict[tuple[str, str], list[ParamView]] = {}
    accums: dict[tuple[str, str], str | None] = {}
    starts: dict[tuple[str, str], str] = {}
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
            if state.float8:
                starts[key] = kwargs["start"].name
            view = ParamView(node.name, _slot(state, kwargs["offset"], kwargs["numel"], tuple(kwargs["shape"])))
            views.setdefault(key, []).append(view)
    shared = {call.args[0].target for call in region_calls(gm)}
    gathers, bodies = [], []
    for key, unit_views in views.items():
        path, shard_name = key
        state = unit_inputs.units[key]
        accum = accums[key]
        if path in shared:
            bodies.append(BodyInput(path, shard_name, state.layout.padded_numel, state.param_dtype,
                                    str(state.compute_device), tuple(unit_views), state.float8))
            gathers.extend(_body_calls(gm, path, state, shard_name, accum, starts.get(key), unit_inputs))
        else:
            gathers.append(_gather(state, path, shard_name, accum, tuple(unit_views), start=starts.get(key)))
    return CollectivesPlan(gathers=tuple(gathers), bodies=tuple(bodies))


def _add(graph: fx.Graph, op: str, target: object, args: tuple[object, ...]) -> fx.Node:
    """Create a node and record its fake value, computed from its inputs' fake values."""
    node = graph.create_node(op, target, args)  # type: ignore[arg-type]
    fake_args = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args]
    fake_mode = next(a.fake_mode for a in fake_args if isinstance(a, torch.Tensor))  # type: ignore[attr-defined]
    with fake_mode:
        value = getattr(fake_args[0], target)(*fake_args[1:]) if op == "call_method" else target(*fake_args)  # type: ignore[operator]
    node.meta["example_value"] = node.meta["val"] = value
    return node


def _tag(nodes: Sequence[fx.Node], unit: str) -> None:
    for node in nodes:
        node.meta["custom"] = {**node.meta.get("custom", {}), UNIT: unit}


def _items(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    """The items of a node whose value is a tuple (a float8 gather's bytes, scales and carrier), as getitem nodes."""
    items = []
    for j, value in enumerate(node.meta["example_value"]):
        items.append(graph.call_function(operator.getitem, (node, j)))
        items[-1].meta["example_value"] = items[-1].meta["val"] = value
    return items


def _replace_markers(graph: fx.Graph, gathered: Sequence[fx.Node], views: tuple[ParamView, ...], unit: str,
                     float8: tuple[Float8Weight, ...] = ()) -> None:
    """Each marker of ``views`` becomes a narrow and view of the gathered unit (``gathered``: its one node); of a
    float8 gather (``gathered``: its bytes, scales and carrier; ``float8``: its weights), its weight's
    ``Float8TrainingTensor`` (``float8_weight``)."""
    nodes = {n.name: n for n in graph.nodes}
    item = {weight.offset: j for j, weight in enumerate(float8)}
    for view, marker in ((v, nodes[v.marker]) for v in views):
        with graph.inserting_before(marker):
            if float8:
                bits, scales, carrier = gathered
                j = item[view.slot.offset]
                added = [_add(graph, "call_function", float8_weight, (carrier, bits, scales, j, tuple(float8[j])))]
            else:
                full = gathered[0]
                narrowed = _add(graph, "call_function", torch.narrow, (full, 0, view.slot.offset, view.slot.numel))
                added = [narrowed, _add(graph, "call_method", "view", (narrowed, list(view.slot.shape)))]
        _tag(added, unit)
        marker.replace_all_uses_with(added[-1])
        graph.erase_node(marker)


def _gathered_input(gm: fx.GraphModule, body: BodyInput) -> None:
    """The shared body's placeholder for a flat shard becomes the gathered unit, which its markers read (a float8
    unit: its bytes, then two placeholders more, its scales and its carrier)."""
    body_gm = gm.get_submodule(body.body)
    placeholder = next(n for n in body_gm.graph.find_nodes(op="placeholder") if n.name == body.placeholder)
    shard = placeholder.meta["example_value"]
    gathered = [placeholder]
    with shard.fake_mode:
        dtype = body.float8[0].float8_dtype if body.float8 else body.dtype
        values = [shard.new_empty(body.numel, dtype=dtype, device=body.device)]
        if body.float8:
            values.append(shard.new_empty(len(body.float8), dtype=torch.float32, device=body.device))
            values.append(shard.new_zeros((), dtype=body.dtype, device=body.device).expand(body.numel))
    with body_gm.graph.inserting_after(placeholder):
        for name in reversed(("scales", "carrier")[: len(values) - 1]):
            gathered.insert(1, body_gm.graph.placeholder(f"{placeholder.name}_{name}"))
    for node, value in zip(gathered, values):
        node.meta["example_value"] = node.meta["val"] = value
    _replace_markers(body_gm.graph, gathered, body.views, f"shared by {body.body}", body.float8)


def apply_collectives(gm: fx.GraphModule, plan: CollectivesPlan) -> None:
    touched = {}
    for body in plan.bodies:
        _gathered_input(gm, body)
        touched[body.body] = gm.get_submodule(body.body)
    for gather in plan.gathers:
        graph_module = gm.get_submodule(gather.graph) if gather.graph else gm
        touched[gather.graph] = graph_module
        graph = graph_module.graph
        nodes = {n.name: n for n in graph.nodes}
        first = nodes[gather.call] if gather.call else nodes[gather.views[0].marker]
        how = (
            gather.param_dtype,
            gather.reduce_dtype,
            gather.grad_reduction,
            gather.world_size,
            gather.group_name,
            gather.replicas,
            gather.replicate_group_name,
            None if gather.offload_to is None else torch.device(gather.offload_to),
        )
        shard, accum = nodes[gather.shard], nodes[gather.accum] if gather.accum else None
        with graph.inserting_before(first):
            if gather.float8:
                weights = tuple(tuple(weight) for weight in gather.float8)
                full = _add(graph, "call_function", cast_all_gather_float8,
                            (shard, accum, nodes[gather.start], *how, weights))  # type: ignore[index]
                gathered = _items(graph, full)
            else:
                full = _add(graph, "call_function", cast_all_gather_differentiable, (shard, accum, *how))
                gathered = [full]
            keep = {KEEP_GATHERED: True} if not gather.reshard_after_forward else {}
            full.meta["custom"] = {**full.meta.get("custom", {}), UNIT: gather.unit, **keep}
            _tag(gathered[1:], gather.unit)
        if gather.call:
            first.args = tuple(x for a in first.args for x in (gathered if a is nodes[gather.shard] else [a]))
        _replace_markers(graph, gathered, gather.views, gather.unit, gather.float8)
    leftover = [n.format_node() for _, g in iter_graphs(gm) for n in g.graph.nodes if is_marker(n)]
    if leftover:
        raise AssertionError(f"insert_collectives left markers behind: {leftover}")
    for graph_module in touched.values():
        lint_and_recompile(graph_module)
    log.debug("insert_collectives: %d all-gathers", len(plan.gathers))
