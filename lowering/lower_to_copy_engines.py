"""Lower the units' all-gathers (and, with ``grad_reduce``, their gradient exchanges) to copy engines.

Precondition: a post-grad forward or backward graph (after ``schedule_overlap`` and ``plan_memory``) whose
all-gathers run on CUDA tensors: into a slot of the group's symmetric slab (``fsdp_compile.all_gather_into_slot``,
the memory plan applied) or into a buffer of their own (``_c10d_functional.all_gather_into_tensor`` ->
``wait_tensor``: the plan not applied, or an output kept for backward).
Postcondition: an all-gather into a slot is ``fsdp_compile.all_gather_into_slot_copy_engine``, with the same
arguments, and its ``wait_tensor(out)`` is ``fsdp_compile.wait_copy_engine(out, None)`` (its readers read
``out``). Any other all-gather is ``fsdp_compile.all_gather_copy_engine``, with the graph's largest shard in
bytes (its staging workspace) as one more argument. With ``grad_reduce``, a gradient exchange into a slot
(``fsdp_compile.exchange_into_slot``) is ``fsdp_compile.exchange_into_slot_copy_engine``, with the same
arguments, and its ``wait_exchange(out, gradient)`` is ``wait_copy_engine(out, gradient)``. Nothing moves.

The ops and how they run: ``fsdp_compile/runtime/copy_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile.debug import degraded
from fsdp_compile.passes._graph import ALL_GATHER, EXCHANGE, WAIT, GraphPass, lint_and_recompile, named, plan_json
from fsdp_compile.runtime.copy_engine import reserve_workspace, workspace_nbytes
from fsdp_compile.runtime.slots import EXCHANGE_INTO_SLOT, INTO_SLOT, WAIT_EXCHANGE
from fsdp_compile.runtime.streams import WAIT_COPY_ENGINE

__all__ = ["LowerToCopyEngines", "CopyEnginesPlan", "apply_copy_engines", "plan_copy_engines"]


@dataclass(frozen=True)
class CopyEnginesPlan:
    gathers: tuple[str, ...]
    """The all-gathers into buffers of their own, lowered to copy engines through the workspace, in graph order."""
    workspace_bytes: int
    """Their largest shard: the symmetric workspace each rank needs."""
    into_slots: tuple[str, ...] = ()
    """The all-gathers into slots, lowered to copy engines with no staging, in graph order."""
    exchanges: tuple[str, ...] = ()
    """The gradient exchanges into slots, lowered to copy engines (pushes into the peers' slots), in graph order."""
    left_on_nccl: tuple[str, ...] = ()
    """The gradient exchanges without a slot (a size known only at run time: dynamic shapes): they stay on NCCL."""

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        total = len(self.gathers) + len(self.into_slots)
        return (f"{total} all-gathers on copy engines ({len(self.into_slots)} into slots), "
                f"{len(self.exchanges)} gradient exchanges")


def plan_copy_engines(graph: fx.Graph, all_gather: bool = True, grad_reduce: bool = False) -> CopyEnginesPlan:
    """What to lower: the all-gathers (``all_gather``), the gradient exchanges (``grad_reduce``)."""
    gathers = [n for n in graph.nodes if n.target == ALL_GATHER] if all_gather else []
    into_slots = [n for n in graph.nodes if n.target == INTO_SLOT] if all_gather else []
    exchanges = [n for n in graph.nodes if n.target == EXCHANGE_INTO_SLOT] if grad_reduce else []
    unslotted = [n.name for n in graph.nodes if n.target == EXCHANGE] if grad_reduce else []
    routed = (("all_gather", "all-gathers", gathers + into_slots), ("grad_reduce", "gradient exchanges", exchanges))
    for option, what, nodes in routed:
        elsewhere = sorted({n.args[0].meta["val"].device.type for n in nodes} - {"cuda"})
        if elsewhere:
            raise ValueError(
                f"{option}='copy_engine' needs {what} of CUDA tensors (peer copies between GPUs), but this graph's "
                f"run on {', '.join(elsewhere)}: use {option}='nccl' there"
            )
    own = [n.args[0].meta["val"] for n in gathers]
    return CopyEnginesPlan(
        gathers=tuple(ag.name for ag in gathers),
        workspace_bytes=workspace_nbytes((s.numel(), s.dtype) for s in own),
        into_slots=tuple(ag.name for ag in into_slots),
        exchanges=tuple(n.name for n in exchanges),
        left_on_nccl=tuple(unslotted),
    )


def apply_copy_engines(gm: fx.GraphModule, plan: CopyEnginesPlan) -> None:
    if plan.left_on_nccl:
        degraded("copy_engine_exchanges_left_on_nccl", f"grad_reduce='copy_engine' pushes each gradient exchange "
                 f"into the peers' planned slots, but {', '.join(plan.left_on_nccl)} has none (a size known only at "
                 "run time: dynamic shapes): it stays on NCCL")
    gathers = named(gm.graph, plan.gathers)
    for group_name in sorted({str(n.args[2]) for n in gathers if n.args[0].meta["val"].is_cuda}):
        reserve_workspace(group_name, plan.workspace_bytes)  # done already unless the memory plan is applied
    for node in gathers:
        node.target = torch.ops.fsdp_compile.all_gather_copy_engine.default
        node.args = (*node.args, plan.workspace_bytes)
    for node in named(gm.graph, plan.into_slots):
        node.target = torch.ops.fsdp_compile.all_gather_into_slot_copy_engine.default
        _wait_for_event(gm.graph, node)
    for node in named(gm.graph, plan.exchanges):
        node.target = torch.ops.fsdp_compile.exchange_into_slot_copy_engine.default
        _wait_for_event(gm.graph, node)
    lint_and_recompile(gm)


def _wait_for_event(graph: fx.Graph, collective: fx.Node) -> None:
    """The wait of a collective into a slot (``wait_tensor(out)``, ``wait_exchange(out, gradient)``) becomes
    ``wait_copy_engine(out, gradient or None)``; what read the wait's result reads ``out``."""
    out = collective.kwargs["out"]
    (wait,) = (user for user in out.users if user.target in (WAIT, WAIT_EXCHANGE))
    with graph.inserting_before(wait):
        graph.call_function(WAIT_COPY_ENGINE, (out, wait.args[1] if wait.target == WAIT_EXCHANGE else None))
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)


class LowerToCopyEngines(GraphPass):
    """The lowering as part of Inductor's ``post_grad_custom_post_pass`` (after ``plan_memory``): the
    all-gathers (``all_gather``) and the gradient exchanges (``grad_reduce``) go to copy engines."""

    name = "lower_to_copy_engines"
    apply = staticmethod(apply_copy_engines)

    def __init__(self, *, all_gather: bool = True, grad_reduce: bool = False) -> None:
        self.all_gather = all_gather
        self.grad_reduce = grad_reduce

    def options(self) -> str:
        return f"all_gather={self.all_gather} grad_reduce={self.grad_reduce}"

    def plan(self, graph: fx.Graph) -> CopyEnginesPlan:
        return plan_copy_engines(graph, self.all_gather, self.grad_reduce)
