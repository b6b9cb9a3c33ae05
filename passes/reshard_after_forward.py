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

from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._internals import is_view_op
from fsdp_compile.passes._graph import (
    ALL_GATHER,
    CASTS,
    WAIT,
    GraphPass,
    lint_and_recompile,
    named,
    plan_json,
    producers,
)
from fsdp_compile.runtime.ops import KEEP_GATHERED

__all__ = ["ReshardAfterForward", "ReshardPlan", "apply_reshard", "plan_reshard"]


@dataclass(frozen=True)
class ReshardPlan:
    """Names of the joint-graph nodes to recompute in backward, per all-gather."""

    recompute: tuple[tuple[str, ...], ...]

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        return f"{len(self.recompute)} all-gathers recomputed in backward"


def plan_reshard(graph: fx.Graph) -> ReshardPlan:
    chains = []
    for node in graph.nodes:
        if node.target != ALL_GATHER or node.meta.get("custom", {}).get(KEEP_GATHERED):
            continue
        chain, _ = producers(node, lambda n: n.target in CASTS or is_view_op(n.target))
        chain.append(node)
        frontier = list(node.users)
        while frontier:
            user = frontier.pop(0)
            if user.target == WAIT or is_view_op(user.target):
                chain.append(user)
                frontier.extend(user.users)
        chains.append(tuple(n.name for n in chain))
    return ReshardPlan(recompute=tuple(chains))


def apply_reshard(gm: fx.GraphModule, plan: ReshardPlan) -> None:
    for node in named(gm.graph, (name for chain in plan.recompute for name in chain)):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    lint_and_recompile(gm)


class ReshardAfterForward(GraphPass):
    """The pass as an Inductor ``joint_custom_pre_pass`` (and before the partitioner under aot_eager)."""

    name = "reshard_after_forward"
    stage = "joint"
    plan = staticmethod(plan_reshard)
    apply = staticmethod(apply_reshard)
