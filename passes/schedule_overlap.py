"""Schedule the units' collectives to overlap with compute: prefetch all-gathers, sink waits, overlap
gradient reductions under a bound.

Precondition: a post-grad forward or backward graph (what Inductor lowers) holding the units'
``all_gather_into_tensor`` -> ``wait_tensor`` chains (their input: a flat shard placeholder, possibly
cast) and, in backward, the gradient reductions: ``reduce_scatter_tensor`` (or ``all_to_all_single``, when
gradients travel in ``param_dtype``) -> ``wait_tensor`` chains: the gradient reductions; with HSDP each is
followed by ``all_reduce`` -> ``wait_tensor`` of its result over the replicas (its second stage).
Postcondition: the same nodes in a new, deterministic, topologically valid order:
- all-gathers, ordered by the first use of their result, are issued ``prefetch`` units ahead: unit i's
  all-gather (and its cast) just before unit i-prefetch's wait (the first ``prefetch`` + 1 before the
  first unit's wait); each all-gather's wait sits right before the first use of the gathered buffer;
- each gradient reduction stays where its input is ready; its wait, and what only the graph output needs from
  it (the local sum of an all-to-all, the cast back to the shard's dtype), move down to just before the
  gradient reduction that comes ``max_inflight_grad_reductions`` later, or to the end of the graph. With a
  second stage (an all-reduce of what only the output needs from that wait: HSDP's, over the reduced shard,
  which is small) the wait moves to the next gradient reduction only, the all-reduce is issued right after
  it, and its own wait (and what follows) moves ``max_inflight_grad_reductions`` reductions further down:
  the large unsharded gradients wait for one reduction at a time, the small shards for the bound's worth.
  Any other all-reduce stays where it is.
A collective that does not match these patterns stays where it is, and a graph for which no valid order
exists keeps its order; both are counted and said once (``fsdp_compile.debug.degraded``).
Nothing depends on the rank: every rank computes the same order. Inductor issues collectives and waits in
graph order, so this order is the runtime order (see tests/test_codegen.py).

Memory: at most ``prefetch + 1`` gathered units are alive at once (each is freed after its last use), and
at most ``max_inflight_grad_reductions`` gradient buffers wait for their collective;
``OverlapPlan.extra_bytes`` estimates what the schedule adds over issuing each collective at its use.

Example (forward, prefetch 1)::

    ag0 = all_gather(s0); w0 = wait(ag0); mm(x, w0)...; ag1 = all_gather(s1); w1 = wait(ag1); mm(y, w1)
  becomes
    ag0 = all_gather(s0); ag1 = all_gather(s1); w0 = wait(ag0); mm(x, w0)...; w1 = wait(ag1); mm(y, w1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.fx as fx

from fsdp_compile._layout import UNIT
from fsdp_compile.debug import degraded
from fsdp_compile.passes._graph import (
    ALL_GATHER,
    ALL_REDUCE,
    GRAD_REDUCTIONS,
    TO_GATHER,
    GraphPass,
    lint_and_recompile,
    nbytes,
    plan_json,
    producers,
    unit_inputs,
    wait_of,
)

__all__ = ["OverlapPlan", "ScheduleOverlap", "apply_overlap", "plan_overlap"]


@dataclass(frozen=True)
class OverlapPlan:
    order: tuple[str, ...]
    """Every node of the graph, by name, in the new order."""
    gathers: tuple[str, ...]
    """The all-gathers, in the order their results are first used."""
    grad_reductions: tuple[str, ...]
    """The gradient reductions (reduce-scatters or all-to-alls), in graph order."""
    prefetch: int
    max_inflight_grad_reductions: int
    extra_bytes: int
    """Estimated peak-memory cost of the schedule: ``prefetch`` more gathered units plus the reduce-scatter
    inputs kept in flight."""
    unscheduled: tuple[tuple[str, str], ...] = ()
    """Collectives left where they are, (name, why): the pattern above does not match them."""
    kept_original_order: bool = False
    """No valid order was found: the graph keeps its order (nothing is prefetched or overlapped)."""
    units: Mapping[str, str] = field(default_factory=dict)
    """The unit of each scheduled collective (all-gathers, gradient reductions), by name."""
    replica_all_reduces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """HSDP: each gradient reduction's second stage, its all-reduce over the replicas (issued one reduction
    later, waited for ``max_inflight_grad_reductions`` after that), by name."""

    def to_json(self) -> str:
        return plan_json(self, omit=("order",))

    def summary(self) -> str:
        left = f", {len(self.unscheduled)} collectives unscheduled" if self.unscheduled else ""
        kept = ", original order kept" if self.kept_original_order else ""
        return f"{len(self.gathers)} all-gathers, {len(self.grad_reductions)} gradient reductions{left}{kept}"


def _input_chain(ag: fx.Node) -> list[fx.Node] | None:
    """The casts (and offload's copy) between a placeholder and the all-gather, if that is all it reads; or, for a
    float8 gather, what its op computed from placeholders alone (amax, all-reduce, scales, cast). Else: not movable."""
    chain, source = producers(ag, lambda n: n.target in TO_GATHER and len(n.users) == 1)
    if isinstance(source, fx.Node) and source.op == "placeholder":
        return chain
    ours = unit_inputs(ag)  # what reads nothing (an arange another unit's gather shares): placed first by the plan
    if ours and all(i.op == "placeholder" or i in ours or not i.all_input_nodes
                    for n in [*ours, ag] for i in n.all_input_nodes):
        return ours
    return None


def _tail(wait: fx.Node, output: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node]:
    """``wait`` and the nodes after it that serve only the graph output (the local sum of an exchange, the
    cast to the shard's dtype) or a second stage (an all-reduce, which ends the tail: its wait has a tail of
    its own), in graph order."""
    tail = {wait}
    frontier = list(wait.users)
    while frontier:
        node = frontier.pop()
        if node is not output and node not in tail:
            tail.add(node)
            if node.target != ALL_REDUCE:
                frontier.extend(node.users)
    changed = True
    while changed:  # keep only what nothing outside the tail (but the output) reads
        outside = {
            n for n in tail if n is not wait and n.target != ALL_REDUCE
            and any(u is not output and u not in tail for u in n.users)
        }
        changed = bool(outside)
        tail -= outside
    return sorted(tail, key=position.__getitem__)


def plan_overlap(graph: fx.Graph, *, prefetch: int, max_inflight_grad_reductions: int) -> OverlapPlan:
    if prefetch < 0 or max_inflight_grad_reductions < 1:
        raise ValueError("prefetch must be >= 0 and max_inflight_grad_reductions >= 1")
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    (output,) = [n for n in nodes if n.op == "output"]

    gathers = []  # (anchor: first use of the gathered buffer, ag, wait, moved chain)
    unscheduled = []  # (node name, why)
    for node in nodes:
        if node.target != ALL_GATHER:
            continue
        wait, chain = wait_of(node), _input_chain(node)
        if wait is None:
            unscheduled.append((node.name, "all-gather not followed by exactly one wait_tensor"))
        elif chain is None:
            unscheduled.append((node.name, "all-gather of a tensor computed in the graph, not of a flat shard input"))
        elif not wait.users:
            unscheduled.append((node.name, "all-gather whose result is never read"))
        else:
            gathers.append((min(wait.users, key=position.__getitem__), node, wait, chain))
    gathers.sort(key=lambda g: position[g[0]])
    # What a moved chain reads that reads nothing itself (an arange or a fill that several gathers share): first.
    free = list(dict.fromkeys(i for *_, chain in gathers for n in chain for i in n.all_input_nodes
                              if i.op == "call_function" and not i.all_input_nodes))
    gathers = [(anchor, ag, wait, [n for n in chain if n not in free]) for anchor, ag, wait, chain in gathers]

    scatters = []  # (rs, tail, tails of its second stages)
    for node in nodes:
        if node.target not in GRAD_REDUCTIONS:
            continue
        if (wait := wait_of(node)) is None:
            unscheduled.append((node.name, "gradient reduction not followed by exactly one wait_tensor"))
            continue
        tail, stages = _tail(wait, output, position), []
        for stage in (n for n in tail if n.target == ALL_REDUCE):
            if (stage_wait := wait_of(stage)) is None:
                unscheduled.append((stage.name, "gradient reduction not followed by exactly one wait_tensor"))
            else:
                stages.append(_tail(stage_wait, output, position))
        scatters.append((node, tail, stages))

    moved = {n for _, ag, wait, chain in gathers for n in (*chain, ag, wait)} | set(free)
    moved |= {n for _, tail, stages in scatters for n in (*tail, *(m for s in stages for m in s))}
    before: dict[fx.Node, list[fx.Node]] = {}  # node -> what to place right before it
    for i, (anchor, ag, wait, chain) in enumerate(gathers):
        before.setdefault(anchor, []).append(wait)
        issue_before = gathers[max(i - prefetch, 0)][2]  # the wait of the unit `prefetch` units earlier
        before.setdefault(issue_before, []).extend([*chain, ag])

    def later(k: int) -> fx.Node:
        return scatters[k][0] if k < len(scatters) else output

    for j, (_, tail, stages) in enumerate(scatters):
        first = 1 if stages else max_inflight_grad_reductions  # HSDP: its all-reduce goes out one reduction later
        before.setdefault(later(j + first), []).extend(tail)
        for stage_tail in stages:
            before.setdefault(later(j + 1 + max_inflight_grad_reductions), []).extend(stage_tail)

    order: list[fx.Node] = [n for n in nodes if n.op == "placeholder"] + free

    def place(node: fx.Node) -> None:
        for first in before.get(node, []):
            place(first)
        order.append(node)

    for node in nodes:
        if node not in moved and node.op != "placeholder":
            place(node)
    placed = {n: i for i, n in enumerate(order)}
    valid = len(order) == len(nodes) and all(
        placed[a] < placed[n] for n in order for a in n.all_input_nodes
    )
    if not valid:
        order = nodes
    unit_bytes = max((nbytes(w) for _, _, w, _ in gathers), default=0)
    rs_bytes = max((nbytes(rs.args[0]) for rs, _, _ in scatters if isinstance(rs.args[0], fx.Node)), default=0)
    rs_inflight = 1 if any(stages for _, _, stages in scatters) else max_inflight_grad_reductions
    return OverlapPlan(
        order=tuple(n.name for n in order),
        gathers=tuple(ag.name for _, ag, _, _ in gathers),
        grad_reductions=tuple(rs.name for rs, _, _ in scatters),
        prefetch=prefetch,
        max_inflight_grad_reductions=max_inflight_grad_reductions,
        extra_bytes=prefetch * unit_bytes + (rs_inflight - 1) * rs_bytes if valid else 0,
        unscheduled=tuple(unscheduled),
        kept_original_order=not valid,
        units={n.name: n.meta.get("custom", {}).get(UNIT, "?") for n in (
            *(ag for _, ag, _, _ in gathers), *(rs for rs, _, _ in scatters))},
        replica_all_reduces={rs.name: stages for rs, tail, _ in scatters
                             if (stages := tuple(n.name for n in tail if n.target == ALL_REDUCE))},
    )


def apply_overlap(gm: fx.GraphModule, plan: OverlapPlan) -> None:
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, why in plan.unscheduled:
        kind = "all_gathers" if nodes[name].target == ALL_GATHER else "grad_reductions"
        degraded(f"schedule_overlap_unscheduled_{kind}", f"schedule_overlap left {name} unscheduled (not "
                 f"overlapped with compute): {why}")
    if plan.kept_original_order:
        degraded("schedule_overlap_kept_original_order", "schedule_overlap found no valid order for a graph "
                 "and kept its original order: none of its collectives overlap with compute")
    previous = None
    for name in plan.order:
        node = nodes[name]
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node
    lint_and_recompile(gm)


class ScheduleOverlap(GraphPass):
    """The pass as part of Inductor's ``post_grad_custom_post_pass`` (runs on the forward and backward graphs)."""

    name = "schedule_overlap"
    apply = staticmethod(apply_overlap)

    def __init__(self, *, prefetch: int, max_inflight_grad_reductions: int) -> None:
        self.prefetch = prefetch
        self.max_inflight_grad_reductions = max_inflight_grad_reductions

    def plan(self, graph: fx.Graph) -> OverlapPlan:
        reductions = self.max_inflight_grad_reductions
        return plan_overlap(graph, prefetch=self.prefetch, max_inflight_grad_reductions=reductions)

    def options(self) -> str:
        return f"{self.prefetch},{self.max_inflight_grad_reductions}"
