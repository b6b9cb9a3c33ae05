"""Map the placeholders of a Dynamo graph, and of the subgraphs it calls, to the FSDP units whose flat
shards they are.

Precondition: ``gm`` is the graph Dynamo hands to a backend, ``example_inputs`` the real tensors in
placeholder order (Dynamo passes the unit's flat shard itself, so identity identifies it). Regions that
Dynamo keeps as subgraphs (``torch.utils.checkpoint`` -> ``tag_activation_checkpoint``, ``wrap``; a unit's shared
body, ``invoke_subgraph``) receive the flat shard as an operand: their placeholder for it maps to the same unit (a
shared body's, to the unit of its first call: every call passes a unit of the same layout).
Postcondition: none (analysis only).

Example::

    def forward(self, L_x_, flat_0, flat_1):               UnitInputsPlan(units={
        ... tag_activation_checkpoint(wrap_body_0, x, flat_1)     ("", "flat_0"): <root>,
    wrap_body_0: def forward(self, x, flat_1): ...              ("", "flat_1"): layers.0,
                                                                ("wrap_body_0", "flat_1"): layers.0})
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from fsdp_compile import _internals
from fsdp_compile._unit import UnitState, unit_of_shard

__all__ = ["UnitInputsPlan", "iter_graphs", "plan_unit_inputs"]

_SUBGRAPH_HOPS = (torch.ops.higher_order.tag_activation_checkpoint, torch.ops.higher_order.wrap)
"""Higher-order ops called as ``hop(body_get_attr, *operands)`` whose body sees the operands in order."""


@dataclass(frozen=True)
class UnitInputsPlan:
    """The placeholders that are flat shards, by (graph path, placeholder name), with their units."""

    units: Mapping[tuple[str, str], UnitState]

    def to_json(self) -> str:
        return json.dumps({f"{graph}/{name}": state.layout.name for (graph, name), state in self.units.items()})


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _subgraph_calls(gm: fx.GraphModule) -> Iterator[tuple[str, fx.GraphModule, list[object]]]:
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node) or (
                node.args[0].op != "get_attr"):
            continue
        if node.target in _SUBGRAPH_HOPS:
            body, *operands = node.args
        elif node.target is _internals.INVOKE_SUBGRAPH and _internals.INVOKE_SUBGRAPH is not None:
            body, _, *operands = node.args
        else:
            continue
        yield body.target, getattr(gm, body.target), operands


def iter_graphs(gm: fx.GraphModule, path: str = "") -> Iterator[tuple[str, fx.GraphModule]]:
    """``gm`` and, depth first, every subgraph its higher-order calls run (once each, however often called), with
    dotted paths from ``gm``."""
    yield path, gm
    seen = set()
    for name, sub, _ in _subgraph_calls(gm):
        if name not in seen:
            seen.add(name)
            yield from iter_graphs(sub, f"{path}.{name}" if path else name)


def _map_subgraphs(gm: fx.GraphModule, path: str, units: dict[tuple[str, str], UnitState]) -> None:
    mapped = set()
    for name, sub, operands in _subgraph_calls(gm):
        sub_path = f"{path}.{name}" if path else name
        for placeholder, operand in zip(_placeholders(sub), operands):
            if isinstance(operand, fx.Node) and (path, operand.name) in units:
                units.setdefault((sub_path, placeholder.name), units[(path, operand.name)])
        if name not in mapped:
            mapped.add(name)
            _map_subgraphs(sub, sub_path, units)


def plan_unit_inputs(gm: fx.GraphModule, example_inputs: Sequence[object]) -> UnitInputsPlan:
    units: dict[tuple[str, str], UnitState] = {}
    for node, value in zip(_placeholders(gm), example_inputs):
        state = unit_of_shard(value)
        if state is not None:
            units[("", node.name)] = state
    _map_subgraphs(gm, "", units)
    return UnitInputsPlan(units=MappingProxyType(units))
