"""Map the placeholders of a Dynamo graph to the FSDP units whose flat shards they are.

Precondition: ``gm`` is the graph Dynamo hands to a backend, ``example_inputs`` the real tensors in
placeholder order (Dynamo passes the unit's flat shard itself, so identity identifies it).
Postcondition: none (analysis only).

Example::

    def forward(self, L_x_, flat_0, flat_1): ...    ->   UnitInputs(units={"flat_0": "", "flat_1": "layers.0"})
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from fsdp_compile._shard import UnitState, unit_of_shard

__all__ = ["UnitInputs", "plan_unit_inputs"]


@dataclass(frozen=True)
class UnitInputs:
    """The placeholders that are flat shards, by placeholder name, with their units."""

    units: dict[str, UnitState]

    def to_json(self) -> str:
        return json.dumps({name: state.layout.fqn for name, state in self.units.items()})


def plan_unit_inputs(gm: fx.GraphModule, example_inputs: Sequence[object]) -> UnitInputs:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    units = {}
    for node, value in zip(placeholders, example_inputs):
        state = unit_of_shard(value)
        if state is not None:
            units[node.name] = state
    return UnitInputs(units=units)
