"""Write each unit's parameter gradients straight into its flat gradient.

Precondition: a scheduled post-grad backward graph (after ``schedule_overlap``, which places each reduction
after its input's producer, and before ``plan_memory``, which then plans the buffer as written), or a shared
backward body ([Note: shared bodies]: it returns its unit's flat gradient, which the step's graph reduces), in which
a unit's flat gradient, the input of its gradient reduction or the body's output, is the sum of ``slice_scatter(zeros, piece, 0,
start, end)`` over its parameters' gradients: how AOTAutograd differentiates the views of the gathered
parameters (``aten.full`` of zeros, each piece a flattened gradient).
Postcondition: that flat gradient is a buffer of its own (``aten.empty``) written in place: the gaps between
the parameters (and the padding) zeroed by ``fsdp_compile::zero_into``, a piece that is a matrix product by
``fsdp_compile::mm_into`` where the product was (the weight gradient's matmul writes its slice), any other
piece by ``fsdp_compile::copy_into``. The reduction reads the buffer where it read the sum.

Why: Inductor computes each weight gradient's matmul (an extern kernel) into a buffer of its own, then one
kernel copies every piece into the flat gradient (it writes only flexible layouts, not an extern matmul's,
straight into a concatenation): a read and a write of the unit's whole gradient, and both copies live at once.
The ops write arguments in place, so Inductor lowers them after every read of the old value and keeps every
later read after them (``_internals.step_ops``; the ops: ``fsdp_compile/runtime/gradient_ops.py``).
What it costs: the flat gradient exists from the unit's first matmul on (before, its pieces piled up one by
one until the pack): where a step's peak memory is the start of backward, up to a unit's gradient more at
peak. The weight gradients' matmuls run as ``torch.mm``, outside Inductor's autotuning (``max-autotune``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile import _internals
from fsdp_compile._internals import is_view_op
from fsdp_compile.passes._graph import (
    GRAD_REDUCTIONS,
    GraphPass,
    call_with_value,
    has_symbolic_size,
    lint_and_recompile,
    plan_json,
)
from fsdp_compile.runtime.gradient_ops import COPY_INTO, MM_INTO, ZERO_INTO

__all__ = [
    "COPY_INTO",
    "MM_INTO",
    "ZERO_INTO",
    "InPlaceGradientsPlan",
    "WriteGradientsInPlace",
    "apply_in_place_gradients",
    "plan_in_place_gradients",
]

MM, ADD = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
SLICE_SCATTER, SLICE_BACKWARD = torch.ops.aten.slice_scatter.default, torch.ops.aten.slice_backward.default


@dataclass(frozen=True)
class InPlaceGradientsPlan:
    units: tuple[tuple[str, tuple[tuple[str, int, int], ...]], ...]
    """(the flat gradient's node, its pieces: (node, start, end) in the flat gradient), per unit."""
    matmuls: int
    """Pieces that are a matrix product's result, written by the product itself."""
    left: tuple[str, ...] = ()
    """The reductions whose input is left as it was (not a concatenation of pieces: e.g. a tied parameter's two
    gradients summed), which Inductor still packs by a copy."""

    def to_json(self) -> str:
        return plan_json(self)

    def summary(self) -> str:
        pieces = sum(len(p) for _, p in self.units)
        return (f"{len(self.units)} flat gradients written in place: {pieces} pieces, {self.matmuls} by their matmul; "
                f"{len(self.left)} left packed")


def _scattered(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(piece, start, end) if ``node`` places a 1-D ``piece`` at ``[start, end)`` of zeros, else None:
    ``slice_scatter(zeros, piece, 0, start, end)`` (Inductor's decomposition) or ``slice_backward(piece, sizes,
    0, start, end, 1)`` (the AOT graph's)."""
    if node.target == SLICE_SCATTER:
        zeros, piece, dim, start, end = node.args[:5]
        if zeros.target != torch.ops.aten.full.default or zeros.args[1] != 0 or node.args[5:] not in ((), (1,)):  # type: ignore[union-attr]
            return None
    elif node.target == SLICE_BACKWARD:
        piece, _, dim, start, end, step = node.args
        if step != 1:
            return None
    else:
        return None
    return (piece, start, end) if dim == 0 and piece.meta["val"].dim() == 1 else None  # type: ignore[union-attr, return-value]


def _sum_of_scatters(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The add nodes (``node`` among them, if it is one) and the scatters of pieces into zeros (``_scattered``)
    of the add-tree ``node``, whose inner nodes have no other user; None if it is not one."""
    if _scattered(node) is not None:
        return [], [node]
    if node.target != ADD:
        return None
    adds, scatters = [node], []
    for arg in node.args:
        found = _sum_of_scatters(arg) if isinstance(arg, fx.Node) and len(arg.users) == 1 else None
        if found is None:
            return None
        adds += found[0]
        scatters += found[1]
    return adds, scatters


def _product(piece: fx.Node) -> fx.Node | None:
    """The matmul whose result ``piece`` flattens, if ``piece`` is only views of it, laid out as it is (a
    transpose of a transpose, a reshape), and the result is used for nothing else."""
    node, laid_out = piece, None
    while is_view_op(node.target) and len(node.users) == 1 and isinstance(node.args[0], fx.Node):
        node, laid_out = node.args[0], laid_out or node.args[0]
    if node.target != MM or len(node.users) != 1 or laid_out is None:
        return None
    result, before = node.meta["val"], laid_out.meta["val"]
    same = before.shape == result.shape and before.is_contiguous() and before.storage_offset() == 0
    return node if same and result.is_contiguous() else None


def _from_body(node: object) -> bool:
    """Whether ``node`` is what a shared body's call returns (the body writes it in place, if it can)."""
    return (isinstance(node, fx.Node) and node.target is operator.getitem
            and getattr(node.args[0], "target", None) is _internals.INVOKE_SUBGRAPH)


def _flat_gradients(graph: fx.Graph) -> list[tuple[str, object]]:
    """(who reads it, the flat gradient): each gradient reduction's input; and each output of the graph that is a
    sum of pieces, as a shared backward body returns its unit's gradient (the step's graph reduces it)."""
    found = [(n.name, n.args[0]) for n in graph.nodes if n.target in GRAD_REDUCTIONS and not _from_body(n.args[0])]
    outputs = graph.output_node().args[0]
    return found + [("output", value) for value in (outputs if isinstance(outputs, (tuple, list)) else ())
                    if isinstance(value, fx.Node) and value.target == ADD and _sum_of_scatters(value) is not None]


def plan_in_place_gradients(graph: fx.Graph) -> InPlaceGradientsPlan:
    units, matmuls, left = [], 0, []
    nodes = {n.name: n for n in graph.nodes}
    for reader, flat in _flat_gradients(graph):
        sized = isinstance(flat, fx.Node) and flat.op == "call_function" and not has_symbolic_size(flat)
        tree = _sum_of_scatters(flat) if sized else None  # a symbolic size (dynamic shapes): left packed
        placed = sorted((_scattered(s) for s in (tree[1] if tree else ())), key=lambda p: p[1])  # type: ignore[index]
        pieces = tuple((piece.name, start, end) for piece, start, end in placed)  # type: ignore[misc]
        ranges = [p[1:] for p in pieces]
        if not pieces or any(end > start_next for (_, end), (start_next, _) in zip(ranges, ranges[1:])):
            left.append(reader)  # not a sum of pieces, or pieces that overlap: a sum, not a concatenation
            continue
        units.append((flat.name, pieces))
        matmuls += sum(_product(nodes[name]) is not None for name, _, _ in pieces)
    return InPlaceGradientsPlan(units=tuple(units), matmuls=matmuls, left=tuple(left))


def apply_in_place_gradients(gm: fx.GraphModule, plan: InPlaceGradientsPlan) -> None:
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    nodes = {n.name: n for n in graph.nodes}
    for flat_name, pieces in plan.units:
        flat = nodes[flat_name]
        value = flat.meta["val"]
        sources = [(nodes[name], start, end) for name, start, end in pieces]
        products = {piece: _product(piece) for piece, _, _ in sources}
        first = min((products[piece] or piece for piece, _, _ in sources), key=position.__getitem__)
        with graph.inserting_before(first):
            buffer = graph.call_function(torch.ops.aten.empty.memory_format, ([value.numel()],),
                                         {"dtype": value.dtype, "device": value.device})
            buffer.meta["val"] = value.new_empty(value.numel())  # the graph's kind of tensor (fake when compiling)
            bounds = [0] + [b for _, start, end in sources for b in (start, end)] + [value.numel()]
            gaps = [(s, e) for s, e in zip(bounds[::2], bounds[1::2]) if e > s]
            if gaps:
                graph.call_function(ZERO_INTO, (buffer, [s for s, _ in gaps], [e for _, e in gaps]))
        for piece, start, end in sources:
            product = products[piece]
            with graph.inserting_before(product if product is not None else piece.next):
                out = call_with_value(graph, torch.ops.aten.slice.Tensor, buffer, 0, start, end)
                if product is not None:
                    out = call_with_value(graph, torch.ops.aten.view.default, out, list(product.meta["val"].shape))
                    graph.call_function(MM_INTO, product.args, {"out": out})
                else:
                    graph.call_function(COPY_INTO, (piece,), {"out": out})
        adds, scatters = _sum_of_scatters(flat)  # type: ignore[misc]  # the plan found it so
        zeros = {s.args[0] for s in scatters if s.target == SLICE_SCATTER}
        flat.replace_all_uses_with(buffer)
        for node in sorted([*adds, *scatters], key=position.__getitem__, reverse=True):  # flat among them
            graph.erase_node(node)
        for piece, _, _ in sources:
            product, node = products[piece], piece
            while product is not None and node is not product:  # the views, then the matmul
                node, view = node.args[0], node
                graph.erase_node(view)
            if product is not None:
                graph.erase_node(product)
        for node in zeros:
            if not node.users:
                graph.erase_node(node)
    lint_and_recompile(gm)


class WriteGradientsInPlace(GraphPass):
    """The pass as part of Inductor's ``post_grad_custom_post_pass``, between ``schedule_overlap`` and
    ``plan_memory`` (only backward graphs hold reductions)."""

    name = "write_gradients_in_place"
    plan = staticmethod(plan_in_place_gradients)
    apply = staticmethod(apply_in_place_gradients)

