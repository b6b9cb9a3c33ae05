"""Reshard after forward: gathered parameters are recomputed (re-gathered) in backward, never saved.

Precondition: an AOTAutograd joint graph (before partitioning) whose forward holds the units'
``_c10d_functional.all_gather_into_tensor`` -> ``wait_tensor`` chains inserted by ``insert_collectives``.
Postcondition: every node of such a chain, the cast that feeds it and every view of its result carry
``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``; the partitioner then keeps only the flat shard
for backward and places a fresh all-gather in the backward graph. (Without the tag the partitioner
force-saves collectives: all gathered parameters would live from forward to backward.) Except the units
shard() was told not to reshard (``reshard_after_forward``): their all-gather carries
``meta["custom"][KEEP_GATHERED]`` and is left untagged, so the gathered unit is saved for backward.

Example (joint graph)::

    convert = prims.convert_element_type(primals_1, bf16)      # tagged
    ag = _c10d_functional.all_gather_into_tensor(convert, 2, "0")  # tagged
    w = _c10d_functional.wait_tensor(ag)                       # tagged
    s = aten.slice(w, 0, 0, 64); v = aten.view(s, [8, 8])      # tagged (views)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._ops import KEEP_GATHERED

__all__ = ["ReshardAfterForward", "ReshardPlan", "apply_reshard", "plan_reshard"]

_c10d = torch.ops._c10d_functional
_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


@dataclass(frozen=True)
class ReshardPlan:
    """Names of the joint-graph nodes to recompute in backward, per all-gather."""

    recompute: tuple[tuple[str, ...], ...]

    def to_json(self) -> str:
        return json.dumps([list(chain) for chain in self.recompute])


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def plan_reshard(graph: fx.Graph) -> ReshardPlan:
    chains = []
    for node in graph.nodes:
        if node.target != _c10d.all_gather_into_tensor.default or node.meta.get("custom", {}).get(KEEP_GATHERED):
            continue
        chain = [node]
        source = node.args[0]
        while isinstance(source, fx.Node) and (source.target in _CASTS or _is_view(source)):
            chain.insert(0, source)
            source = source.args[0]
        frontier = list(node.users)
        while frontier:
            user = frontier.pop(0)
            if user.target == _c10d.wait_tensor.default or _is_view(user):
                chain.append(user)
                frontier.extend(user.users)
        chains.append(tuple(n.name for n in chain))
    return ReshardPlan(recompute=tuple(chains))


def apply_reshard(graph: fx.Graph, plan: ReshardPlan) -> None:
    names = {name for chain in plan.recompute for name in chain}
    for node in graph.nodes:
        if node.name in names:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    graph.lint()


class ReshardAfterForward(CustomGraphPass):
    """The pass as an Inductor ``joint_custom_pre_pass`` (stable uuid: the FX graph cache stays on)."""

    def __call__(self, graph: fx.Graph) -> None:
        apply_reshard(graph, plan_reshard(graph))

    def uuid(self) -> bytes:
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).digest()
