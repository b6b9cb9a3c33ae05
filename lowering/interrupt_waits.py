"""Waits that a failure on another rank ends, for graphs whose collectives run over gloo.

Gloo cannot abort an operation in flight, and ``wait_tensor`` blocks the calling thread until it completes: a rank
whose peer left the step early would wait in it until the transport's timeout (30 minutes by default). So before
each wait the graph calls ``fsdp_compile::await_collective``, which waits through the group's failure channel and
raises ``RankFailed`` as soon as the group is poisoned ([Note: failures] in docs/architecture.md); the
``wait_tensor`` after it then finds the collective done. NCCL needs none: the channel aborts its communicators.

Precondition: a forward or backward graph after the other passes (the last of the pipeline), run over gloo.
Postcondition: every ``wait_tensor(c)`` of a collective ``c`` has ``await_collective(c, group_name)`` just before it.

Example::

    ag = _c10d_functional.all_gather_into_tensor(convert, 2, "0")
    fsdp_compile.await_collective(ag, "0")                        # new
    w = _c10d_functional.wait_tensor(ag)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fsdp_compile._internals import step_ops
from fsdp_compile.passes._graph import WAIT, GraphPass, lint_and_recompile, named, plan_json
from fsdp_compile.runtime import gloo_wait

__all__ = ["AWAIT_COLLECTIVE", "InterruptWaits", "InterruptWaitsPlan", "apply_interrupt_waits", "plan_interrupt_waits"]


@step_ops.step_op("fsdp_compile::await_collective", "(Tensor(a!) output, str group_name) -> ()", lambda *a: None)
def await_collective(output: torch.Tensor, group_name: str) -> None:
    """Wait for the collective whose result is ``output`` through its group's failure channel (if it has one)."""
    gloo_wait.wait(output, group_name)


AWAIT_COLLECTIVE = await_collective


@dataclass(frozen=True)
class InterruptWaitsPlan:
    waits: tuple[tuple[str, str], ...]
    """(the wait's node, its collective's group name), in graph order."""

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        return f"{len(self.waits)} waits of gloo collectives interruptible"


def plan_interrupt_waits(graph: fx.Graph) -> InterruptWaitsPlan:
    waits = []
    for wait in graph.find_nodes(op="call_function", target=WAIT):
        group_name = _group_name(wait)
        if group_name is not None:
            waits.append((wait.name, group_name))
    return InterruptWaitsPlan(tuple(waits))


def _group_name(wait: fx.Node) -> str | None:
    """The group of the collective ``wait`` waits for: the node that made its input (a functional collective), or
    one that wrote into it (a collective into a memory-plan slot)."""
    source = wait.args[0]
    if not isinstance(source, fx.Node):
        return None
    for node in (source, *source.users):
        if node is wait or node.op != "call_function":
            continue
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if normalized is not None and "group_name" in normalized.kwargs:
            return str(normalized.kwargs["group_name"])
    return None


def apply_interrupt_waits(gm: fx.GraphModule, plan: InterruptWaitsPlan) -> None:
    groups = dict(plan.waits)
    for wait in named(gm.graph, groups):
        with gm.graph.inserting_before(wait):
            gm.graph.call_function(AWAIT_COLLECTIVE, (wait.args[0], groups[wait.name])).meta["val"] = None
    lint_and_recompile(gm)


class InterruptWaits(GraphPass):
    name = "interrupt_waits"

    def plan(self, graph: fx.Graph) -> InterruptWaitsPlan:
        return plan_interrupt_waits(graph)

    def apply(self, gm: fx.GraphModule, plan: InterruptWaitsPlan) -> None:
        apply_interrupt_waits(gm, plan)
