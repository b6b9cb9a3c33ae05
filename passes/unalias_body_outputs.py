"""Shared bodies never return their own inputs: what a body's output would alias is taken from the call's operand.

Precondition: an AOTAutograd joint graph after the shared bodies' own partitions (Inductor's
``joint_custom_pre_pass``; under aot_eager, the partition function), holding region calls
(``invoke_subgraph(body, identifier, *operands)``: [Note: shared bodies]).
Postcondition: no body returns one of its placeholders, or a view of one; each call's use of such an output reads the
call's operand instead (through a copy of the same views, in the step's graph), and the body returns the rest.

Why: a body's partition saves what its backward reads, and that may be an input as it came in (the block's input
activation, the gathered unit): the forward body then returns it. Neither AOTAutograd nor Inductor knows that a
call's output aliases its operand (Inductor lowers every output as a buffer of its own): Inductor reuses the
operand's storage once the operand is dead, for the next buffer of the same size, while the output still holds the
value to be read in backward; AOTAutograd may mark such a saved value donated, letting the backward overwrite a
parameter or buffer it aliases. Taking the value from the operand makes the alias a plain use that both see. The same
holds for a backward body's gradient that is its input as it came in. [Note: shared bodies] says what else keeps a
body's inputs whole; ``check_bodies`` guards it on the graphs Inductor compiles.

Example (joint graph)::

    before: fw_body returns (add, primals_0, view(primals_1))
            out = invoke_subgraph(fw_body, "fw", x, w); a = out[0]; s0 = out[1]; s1 = out[2]
    after:  fw_body returns (add,)
            out = invoke_subgraph(fw_body, "fw", x, w); a = out[0]; s0 = x; s1 = view(w)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile._internals import is_view_op
from fsdp_compile.passes._graph import (
    GraphPass,
    call_with_value,
    graph_module,
    lint_and_recompile,
    plan_json,
    region_calls,
)

__all__ = ["BodyAlias", "UnaliasBodyOutputs", "UnaliasPlan", "apply_unalias", "body_aliases", "plan_unalias"]


@dataclass(frozen=True)
class BodyAlias:
    """Output ``output`` of the body ``body`` is its placeholder ``placeholder`` (the call's operand ``operand``), as
    it is or through ``views`` (the body's view nodes, first to last)."""

    body: str
    output: int
    placeholder: str
    operand: int
    views: tuple[str, ...] = ()

    def describe(self) -> str:
        through = f" through {', '.join(self.views)}" if self.views else ""
        return f"{self.body} returns its input {self.placeholder} (operand {self.operand}) as output {self.output}{through}"


@dataclass(frozen=True)
class UnaliasPlan:
    aliases: tuple[BodyAlias, ...]

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        return f"{len(self.aliases)} outputs of {len({a.body for a in self.aliases})} shared bodies taken from operands"


def _aliased(node: object, placeholders: Sequence[fx.Node]) -> tuple[fx.Node, list[fx.Node]] | None:
    """(placeholder, views) if ``node`` is one of ``placeholders`` or views of one (a multi-output view op's item
    included), else None."""
    views: list[fx.Node] = []
    while isinstance(node, fx.Node) and node not in placeholders:
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, fx.Node) and is_view_op(source.target):
            views.insert(0, node)
            node = source
        elif node.op == "call_function" and is_view_op(node.target):
            views.insert(0, node)
            node = source
        else:
            return None
    return (node, views) if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor) else None


def body_aliases(gm: fx.GraphModule) -> tuple[BodyAlias, ...]:
    """Every output of a body that ``gm``'s region calls run which aliases one of the body's inputs."""
    found = []
    for target in dict.fromkeys(call.args[0].target for call in region_calls(gm)):
        body = getattr(gm, target).graph
        placeholders = body.find_nodes(op="placeholder")
        outputs = body.output_node().args[0]
        for index, out in enumerate(outputs if isinstance(outputs, (tuple, list)) else ()):
            alias = _aliased(out, placeholders)
            if alias is not None:
                placeholder, views = alias
                found.append(BodyAlias(body=target, output=index, placeholder=placeholder.name,
                                       operand=placeholders.index(placeholder), views=tuple(v.name for v in views)))
    return tuple(found)


def plan_unalias(graph: fx.Graph) -> UnaliasPlan:
    return UnaliasPlan(aliases=body_aliases(graph_module(graph)))


def _from_operand(graph: fx.Graph, body: fx.GraphModule, alias: BodyAlias, operand: fx.Node) -> fx.Node:
    """``alias``'s value for one call, made in ``graph`` from the call's ``operand``: the body's views, copied."""
    nodes = {n.name: n for n in body.graph.nodes}
    value = operand
    for name in alias.views:
        view = nodes[name]
        value = call_with_value(graph, view.target, value, *view.args[1:], **view.kwargs)
    return value


def apply_unalias(gm: fx.GraphModule, plan: UnaliasPlan) -> None:
    by_body: dict[str, list[BodyAlias]] = {}
    for alias in plan.aliases:
        by_body.setdefault(alias.body, []).append(alias)
    for target, aliases in by_body.items():
        body = getattr(gm, target)
        outputs = list(body.graph.output_node().args[0])
        dropped = {alias.output for alias in aliases}
        renumbered = {old: new for new, old in enumerate(i for i in range(len(outputs)) if i not in dropped)}
        for call in region_calls(gm):
            if call.args[0].target != target:
                continue
            values = {}
            with gm.graph.inserting_before(call):  # the operands come before the call
                for alias in aliases:
                    values[alias.output] = _from_operand(gm.graph, body, alias, call.args[2 + alias.operand])
            for user in list(call.users):  # getitem(call, index)
                if user.args[1] in dropped:
                    user.replace_all_uses_with(values[user.args[1]])
                    gm.graph.erase_node(user)
                else:
                    user.args = (call, renumbered[user.args[1]])
            if isinstance(call.meta.get("val"), (tuple, list)):
                call.meta["val"] = tuple(v for i, v in enumerate(call.meta["val"]) if i not in dropped)
        body.graph.output_node().args = (tuple(out for i, out in enumerate(outputs) if i not in dropped),)
        body.graph.eliminate_dead_code()
        lint_and_recompile(body)
    lint_and_recompile(gm)


class UnaliasBodyOutputs(GraphPass):
    """The pass on the joint graph, before ``reshard_after_forward`` (Inductor's ``joint_custom_pre_pass``; under
    aot_eager, in the partition function)."""

    name = "unalias_body_outputs"
    stage = "joint"
    plan = staticmethod(plan_unalias)
    apply = staticmethod(apply_unalias)

    def __call__(self, graph: fx.Graph) -> None:
        if region_calls(graph_module(graph)):  # else nothing to look at, nor to dump
            super().__call__(graph)
