"""The memory plan applied to a graph: each slot a ``fsdp_compile::slot`` node, each all-gather and gradient
exchange written into a view of its slot (``write_into_slots``), and the check that no slot is written while
its previous occupant can still be read (``slot_hazards``). The slabs and the ops: ``fsdp_compile.runtime.slots``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile.passes._graph import ALL_GATHER, CASTS, EXCHANGE, call_with_value, lint_and_recompile
from fsdp_compile.passes._liveness import last_read, slotted_numel
from fsdp_compile.runtime.slots import EXCHANGE_INTO_SLOT, INTO_SLOT, SLOT, WAIT_EXCHANGE, reserve_slab

__all__ = ["SlotUse", "slot_hazards", "write_into_slots"]


@dataclass(frozen=True)
class SlotUse:
    """One slot as one graph uses it."""

    group: str
    offset: int
    """Bytes, in the group's slab."""
    nbytes: int
    slab_bytes: int
    collectives: tuple[str, ...]
    """The graph's collectives whose buffers the slot holds (all-gathers or exchanges), by node name."""


def write_into_slots(
    gm: fx.GraphModule, uses: tuple[SlotUse, ...], symmetric: bool, keep_old: bool, ranks: Mapping[str, int]
) -> None:
    """Each slot becomes one ``slot`` node at the graph's start; each of its collectives writes into a view of
    it (``all_gather_into_slot``, ``exchange_into_slot``), which Inductor lowers as a mutation of the slot: it
    runs after every earlier read of the slot, and no such read moves past it. An all-gather's
    ``wait_tensor`` waits for the view; an exchange's becomes ``wait_exchange``. Where the shard was cast to
    ``param_dtype`` just for the all-gather, the op takes the uncast shard (the cast writes into the slot).
    Reserves the slabs (a collective for symmetric ones: ``symmetric`` puts CUDA slabs in symmetric memory).
    ``ranks``: this process's rank in each group, by name (an exchange's own part stays in the gradient)."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    for use in uses:
        collectives = [nodes[name] for name in use.collectives]
        assert all(
            c.target in (ALL_GATHER, EXCHANGE) and c.meta["val"].dim() == 1 and len(c.users) == 1 for c in collectives
        ), use
        value = collectives[0].meta["val"]
        symmetric_here = symmetric and value.device.type == "cuda"
        args = (use.group, value.device, use.offset, use.nbytes // value.element_size(), value.dtype,
                use.slab_bytes, symmetric_here, keep_old)
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):  # a cast may be gone
            slot_node = graph.call_function(SLOT, args)
        slot_node.meta["val"] = value.new_empty(args[3])
        for collective in collectives:
            with graph.inserting_before(collective):
                out = call_with_value(graph, torch.ops.aten.slice.Tensor, slot_node, 0, 0, slotted_numel(collective))
            if collective.target == EXCHANGE:
                _write_exchange(graph, collective, out, ranks[use.group])
            else:
                _write_gather(graph, collective, out)
        reserve_slab(use.group, value.device, use.slab_bytes, symmetric_here, keep_old)
    lint_and_recompile(gm)


def _write_gather(graph: fx.Graph, gather: fx.Node, out: fx.Node) -> None:
    shard = gather.args[0]
    gather.target, gather.kwargs, gather.meta["val"] = INTO_SLOT, {"out": out}, None
    if shard.target in CASTS and len(shard.users) == 1:
        gather.args = (shard.args[0], *gather.args[1:])
        graph.erase_node(shard)
    gather.replace_all_uses_with(out)  # its wait_tensor


def _write_exchange(graph: fx.Graph, exchange: fx.Node, out: fx.Node, rank: int) -> None:
    """The exchange writes the peers' parts into ``out``; the local sum of the parts (``all_to_all_avg``'s: a
    view as ``[world, part]``, elementwise casts and scalings, a sum over the parts) then reads those from
    ``out`` and this rank's own from the gradient, in rank order as before (the same rounding): the slot holds
    ``world - 1`` parts, and no copy of the own part is made. The rank is a constant of the graph
    (``PlanMemory.options`` keys Inductor's caches by it)."""
    gradient, splits, _, group_name = exchange.args
    world = len(splits)
    (wait,) = exchange.users
    exchange.target, exchange.meta["val"] = EXCHANGE_INTO_SLOT, None
    exchange.args, exchange.kwargs = (gradient, world, group_name), {"out": out}
    (view,) = wait.users
    chain, total = [], view
    while total.target != torch.ops.aten.sum.dim_IntList:
        assert len(total.users) == 1, f"{exchange.name}: its parts are read other than by a sum: {total.format_node()}"
        (total,) = total.users
        chain.append(total)
    *scale, total = chain
    part = gradient.meta["val"].numel() // world
    assert view.args[1:] == ([world, part],) and total.args[1:] == ([0],) and all(
        not n.all_input_nodes[1:] and n.meta["val"].shape == n.args[0].meta["val"].shape for n in scale
    ), f"{exchange.name}: its parts are not summed as all_to_all_avg sums them"
    with graph.inserting_before(wait):
        graph.call_function(WAIT_EXCHANGE, (out, gradient))
    with graph.inserting_before(total):
        summed = None
        for source in range(world):  # part ``source`` came from rank ``source``: the own part, or a peer's
            tensor, at = (gradient, rank) if source == rank else (out, source - (source > rank))
            value = call_with_value(graph, torch.ops.aten.slice.Tensor, tensor, 0, at * part, (at + 1) * part)
            for node in scale:
                value = call_with_value(graph, node.target, value, *node.args[1:], **node.kwargs)
            summed = value if summed is None else call_with_value(graph, torch.ops.aten.add.Tensor, summed, value)
        total.replace_all_uses_with(summed)
    for node in (total, *reversed(scale), view, wait):
        graph.erase_node(node)


def slot_hazards(graph: fx.Graph) -> list[str]:
    """Where a graph lets a collective write a slot while its previous occupant can still be read (empty if
    nowhere): in graph order, every read of an occupant (through any alias) comes before the next write."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    end = len(index) - 1
    found = []
    for slot_node in graph.find_nodes(op="call_function", target=SLOT):
        writes = (w for view in slot_node.users for w in view.users if w.kwargs.get("out") is view)
        writers = sorted(writes, key=index.__getitem__)
        for before, after in zip(writers, writers[1:]):
            if last_read(before.kwargs["out"], index, end) >= index[after]:
                found.append(f"{after.name} writes {slot_node.name} before the last read of {before.name}")
    return found
