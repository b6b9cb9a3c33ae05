"""Reshard after forward: gathered parameters are recomputed (re-gathered) in backward, never saved.

Precondition: an AOTAutograd joint graph (before partitioning) whose forward holds the units'
``_c10d_functional.all_gather_into_tensor`` -> ``wait_tensor`` chains inserted by ``insert_collectives``.
Postcondition: every node of such a chain, the cast that feeds it (for a float8 gather, everything its op computed
before it: amax, all-reduce, scales, cast) and every view of its result carry
``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``; the partitioner then keeps only the flat shard
for backward and places a fresh all-gather in the backward graph. (Without the tag the partitioner
force-saves collectives: all gathered parameters would live from forward to backward.) Except the units
shard() was told not to reshard (``reshard_after_forward``): their all-gather carries
``meta["custom"][KEEP_GATHERED]`` and is left untagged, so the gathered unit is saved for backward. CPU offload
on one rank: no all-gather; the unit's copy to the device is the gathered unit, tagged alike (copied again in
backward), so the device holds one unit's copy at a time, as on several ranks.

Shared bodies ([Note: shared bodies]): a body's joint graph reads its unit as a placeholder (the gathered unit,
which the call site gathers); every view of it is tagged, so the body's partition saves the placeholder itself.
``unalias_body_outputs`` (before this pass) takes that saved value from the call's operand, the all-gather's
result, which this pass tags: backward gathers the unit again.

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
from fsdp_compile._layout import UNIT
from fsdp_compile.passes._graph import (
    ALL_GATHER,
    CASTS,
    COPY_TO_DEVICE,
    TO_GATHER,
    WAIT,
    GraphPass,
    lint_and_recompile,
    named,
    plan_json,
    producers,
    unit_inputs,
)
from fsdp_compile.runtime.ops import KEEP_GATHERED

__all__ = ["ReshardAfterForward", "ReshardPlan", "apply_reshard", "plan_reshard"]


@dataclass(frozen=True)
class ReshardPlan:
    """Names of the joint-graph nodes to recompute in backward, per all-gather (or per gathered unit a shared body
    reads)."""

    recompute: tuple[tuple[str, ...], ...]

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        return f"{len(self.recompute)} all-gathers recomputed in backward"


def _with_views(nodes: list[fx.Node], start: fx.Node) -> list[fx.Node]:
    """``nodes``, then ``start``'s users that are waits or views, and theirs, breadth first."""
    frontier = list(start.users)
    while frontier:
        user = frontier.pop(0)
        if user.target == WAIT or is_view_op(user.target):
            nodes.append(user)
            frontier.extend(user.users)
    return nodes


def _feeds_all_gather(node: fx.Node) -> bool:
    """Whether ``node`` reaches an all-gather through casts and views (its unit is sharded over several ranks)."""
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        if user.target == ALL_GATHER:
            return True
        if user.target in CASTS or is_view_op(user.target):
            frontier.extend(user.users)
    return False


def _gathered_placeholders(graph: fx.Graph) -> list[fx.Node]:
    """A shared body's placeholders that are gathered units: read by views that ``insert_collectives`` tagged."""
    return [p for p in graph.find_nodes(op="placeholder")
            if any(UNIT in u.meta.get("custom", {}) and is_view_op(u.target) for u in p.users)]


def plan_reshard(graph: fx.Graph) -> ReshardPlan:
    chains = []
    for node in graph.nodes:
        if node.target not in (ALL_GATHER, COPY_TO_DEVICE) or node.meta.get("custom", {}).get(KEEP_GATHERED):
            continue
        if node.target == COPY_TO_DEVICE:  # one rank: the copy is the gathered unit, unless an all-gather follows
            if not _feeds_all_gather(node):
                chains.append(tuple(n.name for n in _with_views([node], node)))
            continue
        chain, _ = producers(node, lambda n: n.target in TO_GATHER or is_view_op(n.target))
        chain.extend(n for n in unit_inputs(node) if n not in chain)
        chain.append(node)
        chains.append(tuple(n.name for n in _with_views(chain, node)))
    chains.extend(tuple(n.name for n in _with_views([], p)) for p in _gathered_placeholders(graph))
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
