"""Live ranges of the collectives' buffers in a compiled step, for ``plan_memory`` (its docstring says what
a buffer is and when it is live).

The step's order is the forward graph's nodes, then the backward's. AOTAutograd names each backward input
after the forward output it saves, which is how a buffer kept gathered from forward to backward is
followed into backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Literal

import torch.fx as fx

from fsdp_compile._internals import is_view_op
from fsdp_compile.passes._graph import ALL_GATHER, EXCHANGE, GRAD_REDUCTIONS, WAIT, has_symbolic_size, nbytes, wait_of

__all__ = ["Buffer", "ForwardBuffers", "Kind", "forward_buffers", "last_read", "slotted_numel", "step_buffers"]

Kind = Literal["gathered", "gradient"]
Saved = tuple[tuple[str, tuple[str, ...]], ...]
"""(buffer name, the graph outputs that alias it)."""


@dataclass(frozen=True)
class Buffer:
    """One collective's buffer and its live range in the step's order."""

    name: str
    """The collective node's name, prefixed by its graph (``forward/all_gather_into_tensor_3``)."""
    group: str
    dtype: str
    kind: Kind
    nbytes: int
    start: int
    end: int
    """Inclusive: the last step position at which the buffer is read."""
    escapes: bool = False
    """An output of its graph aliases it (a unit kept gathered for backward): it is read after its graph ends,
    when another graph (or another run of the same one) may use the slots, so it never takes a slot."""
    in_slab: bool = True
    """Whether applying the plan puts the buffer in its slot: all-gather outputs and gradient exchanges (the
    peers' parts of the all-to-all's output); a reduce-scatter's input is planned but stays where Inductor
    puts it."""

    @property
    def klass(self) -> tuple[str, str, str]:
        return (self.group, self.dtype, self.kind)

    def meets(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class ForwardBuffers:
    """The forward graph's buffers, and what the backward needs to follow those kept for it."""

    buffers: tuple[Buffer, ...]
    length: int
    """The forward's number of nodes: where the backward starts in the step's order."""
    saved: Saved
    """(buffer name, the forward outputs that alias it): the buffer is read in backward through them."""


def forward_buffers(graph: fx.Graph) -> ForwardBuffers:
    """The buffers of a scheduled forward graph; one that a forward output aliases lives to the forward's end
    (``step_buffers`` follows it into the backward)."""
    buffers, saved = _graph_buffers(graph, "forward", 0)
    return ForwardBuffers(buffers=buffers, length=len(graph.nodes), saved=saved)


def step_buffers(forward: ForwardBuffers, backward: fx.Graph | None) -> tuple[Buffer, ...]:
    """The step's buffers: the forward's, with those saved for backward live to their last read there (to the
    step's end for an output the backward does not take), and the backward's."""
    if backward is None:
        return forward.buffers
    offset = forward.length
    end = offset + len(backward.nodes) - 1
    inputs = {n.name: n for n in backward.find_nodes(op="placeholder")}
    index = {n: offset + i for i, n in enumerate(backward.nodes)}
    extended = []
    saved = dict(forward.saved)
    for b in forward.buffers:
        if b.name in saved:
            reads = [last_read(inputs[o], index, end) if o in inputs else end for o in saved[b.name]]
            b = replace(b, end=max([b.end, *reads]))
        extended.append(b)
    backward_buffers, _ = _graph_buffers(backward, "backward", offset)
    return (*extended, *backward_buffers)


def _graph_buffers(graph: fx.Graph, stage: str, offset: int) -> tuple[tuple[Buffer, ...], Saved]:
    index = {n: offset + i for i, n in enumerate(graph.nodes)}
    end = offset + len(graph.nodes) - 1
    outputs = set(graph.output_node().all_input_nodes)
    buffers: list[Buffer] = []
    saved: list[tuple[str, tuple[str, ...]]] = []
    for node in graph.nodes:
        source = node.args[0] if node.target in GRAD_REDUCTIONS else node
        if node.target in (ALL_GATHER, *GRAD_REDUCTIONS) and has_symbolic_size(source):
            continue  # a symbolic size (dynamic shapes, after recompiles): not planned, its own allocation
        if node.target == ALL_GATHER:
            name, dtype = f"{stage}/{node.name}", str(node.meta["val"].dtype)
            aliases = _aliases(node)
            escaping = tuple(sorted(a.name for a in aliases if a in outputs))
            last = last_read(node, index, end, aliases)
            if escaping:
                saved.append((name, escaping))
            buffers.append(
                Buffer(name, str(node.args[2]), dtype, "gathered", nbytes(node), index[node], last, bool(escaping))
            )
        elif node.target in GRAD_REDUCTIONS:
            wait = wait_of(node)
            start = index[source] if source.op != "placeholder" else offset
            last = index[wait] if wait is not None else end
            size = nbytes(source)
            if node.target == EXCHANGE:  # what takes the slot (``slotted_numel``): from the issue to its last read
                # (no peer writes into the slot before this rank issues the exchange: NCCL, or the copy engines'
                # barrier, wait for every rank to reach it)
                start, last = index[node], max(last, last_read(node, index, end))
                size = slotted_numel(node) * source.meta["val"].element_size()
            buffers.append(
                Buffer(f"{stage}/{node.name}", str(node.args[-1]), str(source.meta["val"].dtype), "gradient",
                       size, start, last, in_slab=node.target == EXCHANGE)
            )
    return tuple(buffers), tuple(saved)


def slotted_numel(collective: fx.Node) -> int:
    """The elements of a collective's output that its slot holds: an all-gather's whole output; the peers'
    parts of an exchange's, ``world - 1`` of its ``world`` (the local sum reads this rank's own part from the
    gradient: ``_write_slots``)."""
    numel = collective.meta["val"].numel()
    return numel - numel // len(collective.args[1]) if collective.target == EXCHANGE else numel


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that views its result (``wait_tensor``, views, their ``getitem``s), transitively."""
    found, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            if user not in found and _is_view(user):
                found.append(user)
                todo.append(user)
    return found


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in (WAIT, operator.getitem) or is_view_op(node.target))


def last_read(node: fx.Node, index: dict[fx.Node, int], end: int, aliases: list[fx.Node] | None = None) -> int:
    """The last position at which ``node``'s result is read through any alias (``end`` if a graph output is
    one: read after the graph)."""
    last = index[node]
    for alias in aliases if aliases is not None else _aliases(node):
        for user in alias.users:
            if user.op == "output":
                last = max(last, end)
            elif not _is_view(user):
                last = max(last, index[user])
    return last
