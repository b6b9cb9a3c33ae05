"""What the passes and lowerings share: the collective ops they look for, small FX helpers, and
:class:`GraphPass`, the frame every pass runs in (plan, apply, artifact, log line, cache key).

When a pass may run: [Note: pass order] in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.fx as fx

from fsdp_compile import _internals, debug
from fsdp_compile._internals import step_ops
from fsdp_compile._layout import UNIT

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "CASTS",
    "COPY_TO_DEVICE",
    "EXCHANGE",
    "GRAD_REDUCTIONS",
    "TO_GATHER",
    "GraphPass",
    "WAIT",
    "call_with_value",
    "graph_module",
    "has_symbolic_size",
    "holds_collectives",
    "inline_region_calls",
    "lint_and_recompile",
    "named",
    "nbytes",
    "plan_json",
    "producers",
    "region_calls",
    "wait_of",
]

log = logging.getLogger(__name__)

_c10d = _internals.c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
WAIT = _c10d.wait_tensor.default
EXCHANGE = _c10d.all_to_all_single.default
"""A unit's gradient exchange (gradients travel in param_dtype; each rank sums its parts in reduce_dtype)."""
GRAD_REDUCTIONS = (_c10d.reduce_scatter_tensor.default, EXCHANGE)
"""A unit's gradient reduction: a reduce-scatter, or an all-to-all (gradients exchanged in param_dtype); with
HSDP, followed by an ``ALL_REDUCE`` of the reduced shard over the replicas."""
ALL_REDUCE = _c10d.all_reduce.default
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
"""The dtype casts AOTAutograd and Inductor's decompositions produce (``tensor.to(dtype)``)."""
COPY_TO_DEVICE = torch.ops.fsdp_compile.copy_to_device.default
"""CPU offload: a unit's flat shard copied to the device (cast there to ``param_dtype``)."""
TO_GATHER = (*CASTS, COPY_TO_DEVICE)
"""What a flat shard passes through on its way to its all-gather: casts and, with CPU offload, its copy to the
device (moved, and done again in backward, with the all-gather)."""


def producers(node: fx.Node, follow: Callable[[fx.Node], bool]) -> tuple[list[fx.Node], object]:
    """Walk ``node``'s first argument back through the producers ``follow`` accepts: those producers,
    earliest first, and the first argument it stopped at (a node ``follow`` refused, or a constant)."""
    chain: list[fx.Node] = []
    source = node.args[0]
    while isinstance(source, fx.Node) and follow(source):
        chain.insert(0, source)
        source = source.args[0]
    return chain, source


def unit_inputs(all_gather: fx.Node) -> list[fx.Node]:
    """What the all-gather's own op computed before it, in graph order: the nodes above it that carry its unit's tag
    (``UNIT``): a cast, or a float8 gather's amax, its all-reduce, the scales and the cast."""
    unit = all_gather.meta.get("custom", {}).get(UNIT)
    found: set[fx.Node] = set()
    frontier = list(all_gather.all_input_nodes) if unit is not None else []
    while frontier:
        node = frontier.pop()
        if node not in found and node.op == "call_function" and node.meta.get("custom", {}).get(UNIT) == unit:
            found.add(node)
            frontier.extend(node.all_input_nodes)
    return [n for n in all_gather.graph.nodes if n in found]


def wait_of(node: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` of a collective, if it has exactly one."""
    waits = [u for u in node.users if u.target == WAIT]
    return waits[0] if len(waits) == 1 else None


def nbytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value (0 if it has none)."""
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def has_symbolic_size(node: fx.Node) -> bool:
    """Whether the node's tensor has a symbolic size (dynamic shapes): the passes leave such a buffer where
    Inductor puts it (not planned into a slot, not written in place)."""
    return not isinstance(nbytes(node), int)


def named(graph: fx.Graph, names: Iterable[str]) -> list[fx.Node]:
    """The nodes of ``graph`` with these names, in graph order."""
    wanted = set(names)
    return [n for n in graph.nodes if n.name in wanted]


def lint_and_recompile(gm: fx.GraphModule) -> None:
    """How every ``apply_*`` ends: check the graph, regenerate the module's code."""
    gm.graph.lint()
    gm.recompile()


def call_with_value(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A node of ``target(*args, **kwargs)`` at the graph's insert point, with its value (``meta["val"]``,
    computed on the arguments' values: the graph's fake tensors)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]), **kwargs)
    return node


def plan_json(plan: Any, *, omit: tuple[str, ...] = ()) -> str:
    """A frozen plan dataclass as JSON (dtypes, and sizes that are symbolic under dynamic shapes, as strings),
    without the fields named in ``omit``."""
    fields = {f.name: _plain(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in omit}
    return json.dumps(fields, default=str)


def _plain(value: Any) -> Any:
    """``value`` with its dataclasses as dicts and its sequences as lists, the rest as is (``dataclasses.asdict``
    deep-copies every value, and a symbolic size cannot be copied)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def holds_collectives(graph: fx.Graph) -> bool:
    """Whether ``graph`` gathers or reduces a unit: a step's graph (over more than one rank), not a shared body."""
    return any(graph.find_nodes(op="call_function", target=t) for t in (ALL_GATHER, *GRAD_REDUCTIONS, ALL_REDUCE))


def region_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The calls of nested compile regions' bodies in ``gm``'s own graph (``invoke_subgraph(body, identifier,
    *operands)``), in graph order."""
    target = _internals.INVOKE_SUBGRAPH
    return [] if target is None else list(gm.graph.find_nodes(op="call_function", target=target))


def inline_region_calls(gm: fx.GraphModule, calls: Iterable[fx.Node]) -> None:
    """Replace each of ``calls`` (region calls of ``gm``) by a copy of its body's nodes, the call's operands in place
    of the body's placeholders: the graph as if the region's code had been traced where it is called. A body's own
    subgraphs (a checkpointed region inside it) become ``gm``'s, under new names."""
    for call in calls:
        attr = call.args[0]
        body = getattr(gm, attr.target)
        env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:]))
        with gm.graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                copy = gm.graph.node_copy(node, lambda n: env[n])
                if node.op == "get_attr":
                    copy.target = _adopt(gm, node.target, getattr(body, node.target))
                env[node] = copy
        outputs = body.graph.output_node().args[0]
        for user in list(call.users):  # getitem(call, i)
            user.replace_all_uses_with(env[outputs[user.args[1]]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(call)
        if not attr.users:
            gm.graph.erase_node(attr)
    lint_and_recompile(gm)


def _adopt(gm: fx.GraphModule, name: str, module: torch.nn.Module) -> str:
    """Register ``module`` on ``gm`` under ``name`` or, where taken, a new name like it; return the name."""
    new, number = name, 0
    while hasattr(gm, new):
        number += 1
        new = f"{name}_{number}"
    gm.register_module(new, module)
    return new


def graph_module(graph: fx.Graph) -> fx.GraphModule:
    """The GraphModule owning ``graph`` (Inductor hands custom passes the graph alone)."""
    gm = graph.owning_module
    if not isinstance(gm, fx.GraphModule):
        raise TypeError("fsdp_compile's passes run on graphs owned by a GraphModule")
    return gm


class _Plan(Protocol):
    def to_json(self) -> str: ...

    def summary(self) -> str:
        """One line for the log."""


class GraphPass(_internals.CustomGraphPass):  # type: ignore[misc, valid-type]
    """One pass as Inductor runs custom passes: ``plan`` (pure), then ``apply`` (mutates), inside Inductor's
    ``GraphTransformObserver``; the graph before and after and the plan as the structured artifacts
    ``fsdp_compile_<name>_before``, ``_after`` and ``_plan`` (the dump folder's files); one log line.
    ``uuid()`` hashes the pass's module, this one, ``_internals`` (and how Inductor lowers the library's ops) and
    ``options()``, so the FX graph cache keeps working and never reuses a graph another version built."""

    name: ClassVar[str]
    stage: ClassVar[debug.Stage | None] = None
    """The stage this pass always runs in, for the dump (None: the stage the backend last recorded)."""

    def plan(self, graph: fx.Graph) -> Any:
        raise NotImplementedError

    def apply(self, gm: fx.GraphModule, plan: Any) -> None:
        raise NotImplementedError

    def options(self) -> str:
        return ""

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph_module(graph)
        if self.stage is not None:
            debug.set_stage(self.stage)
        debug.graph_artifact(f"{self.name}_before", gm)
        plan = _internals.run_observed(gm, f"fsdp_compile.{self.name}", self._plan_and_apply)
        if plan is None:  # switched off by torch._inductor.config.disabled_passes
            return
        debug.artifact(f"{self.name}_plan", plan.to_json)
        debug.graph_artifact(f"{self.name}_after", gm)
        log.info("%s: %s", self.name, plan.summary())

    def _plan_and_apply(self, graph: fx.Graph) -> _Plan:
        plan = self.plan(graph)
        self.apply(graph_module(graph), plan)
        return plan

    def uuid(self) -> bytes:
        return _internals.hash_sources(self.sources(), self.options())

    def sources(self) -> Sequence[str]:
        return (inspect.getfile(type(self)), __file__, _internals.__file__, step_ops.__file__)
