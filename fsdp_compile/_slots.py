"""The memory plan's slots in a graph and at run time: one allocation (a slab) per process group and device
holds the group's slots, the op ``fsdp_compile::slot`` hands a compiled graph one slot of it, and each
all-gather and gradient exchange writes into its slot (``fsdp_compile::all_gather_into_slot``,
``fsdp_compile::exchange_into_slot``) instead of a buffer of its own ([Note: memory plan] in
docs/architecture.md).

A slab is plain memory, or symmetric memory (``torch.distributed._symmetric_memory``, rendezvoused once) for
the copy-engine routes, which read (all-gather) or write (exchange) the peers' slots. Every graph lays its
slots out from the slab's start: graphs run one after another and no slotted buffer outlives its graph, so
they share the memory. Each slot is handed out as a tensor of its own storage (same memory, through
DLPack): c10d keys in-flight collectives by storage, so the wait for one slot's collective must not wait for
another slot's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from fsdp_compile import _internals
from fsdp_compile._graph import ALL_GATHER, CASTS, EXCHANGE, lint_and_recompile
from fsdp_compile._internals import lifetime, step_ops, symm_mem
from fsdp_compile._liveness import last_read

__all__ = [
    "EXCHANGE_INTO_SLOT", "INTO_SLOT", "SLOT", "Slab", "SlotUse", "WAIT_EXCHANGE", "all_gather_into_slot",
    "exchange_into_slot", "release_slabs", "reserve_slab", "slab_bytes", "slab_of", "slot", "slot_hazards",
    "wait_exchange", "write_into_slots",
]

log = logging.getLogger(__name__)


@dataclass
class Slab:
    memory: torch.Tensor
    """1-D ``uint8``."""
    handle: Any | None
    """The symmetric-memory handle (peers' buffers, barriers), or None for plain memory."""
    slots: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """(byte offset, numel, dtype) -> the slot's tensor."""
    _views: dict[tuple[str, int, int, torch.dtype], Any] = field(default_factory=dict)

    def pulls(self, gathered: torch.Tensor, group_size: int) -> tuple[torch.Tensor, list[tuple[Any, torch.Tensor]]]:
        """For an all-gather's output ``gathered`` in this (symmetric) slab: this rank's part of it, and (the peer's
        part of it, the same part in the peer's slab) for every peer: the parts to pull."""
        return self._made_once("pull", gathered, group_size)  # type: ignore[no-any-return]

    def pushes(self, exchanged: torch.Tensor, group_size: int) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """For an exchange's output ``exchanged`` in this (symmetric) slab: this rank's part of it, and (peer, this
        rank's part of the same place in the peer's slab) for every peer: where this rank's gradient parts go."""
        return self._made_once("push", exchanged, group_size)  # type: ignore[no-any-return]

    def _made_once(self, way: str, tensor: torch.Tensor, group_size: int) -> Any:
        """The views of ``pulls`` and ``pushes``, made once per place (the slabs have one layout on every rank):
        a view costs a few µs of host time at every collective."""
        key = (way, tensor.data_ptr() - self.memory.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in self._views:
            start, part = key[1] // tensor.element_size(), tensor.numel() // group_size
            rank, mine = self.handle.rank, tensor.view(group_size, -1)
            at = {peer: start + (peer if way == "pull" else rank) * part for peer in range(group_size) if peer != rank}
            theirs = {peer: self.handle.get_buffer(peer, (part,), tensor.dtype, at[peer]) for peer in at}
            peers = [(mine[peer], buffer) if way == "pull" else (peer, buffer) for peer, buffer in theirs.items()]
            self._views[key] = (mine[rank], peers)
        return self._views[key]


_slabs: dict[tuple[str, str], Slab] = {}
_retired: list[Slab] = []
"""Slabs a larger one replaced: CUDA graphs captured before still read and write their memory."""


def reserve_slab(group_name: str, device: torch.device, nbytes: int, symmetric: bool, keep_old: bool) -> Slab:
    """The group's slab on ``device``, at least ``nbytes`` and symmetric if asked (a collective then: every rank
    reserves in the same order, as every rank compiles and runs the same graphs). The backend reserves when it
    compiles; a graph loaded from a cache reserves at its first run. A slab that grows keeps its old memory
    alive if ``keep_old`` (CUDA graphs captured before hold its addresses)."""
    key = (group_name, str(device))
    slab = _slabs.get(key)
    if slab is not None and slab.memory.numel() >= nbytes and (slab.handle is not None or not symmetric):
        return slab
    if slab is not None:
        log.info("fsdp_compile: the slab of group %s on %s grows from %d to %d bytes", group_name, device,
                 slab.memory.numel(), nbytes)
        _internals.counters["fsdp_compile"]["slab_regrowths"] += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # nothing in flight still uses the old slab
        if keep_old:
            _retired.append(slab)
        nbytes = max(nbytes, slab.memory.numel())

    def allocate() -> tuple[torch.Tensor, Any]:
        if symmetric:
            return symm_mem.slab(group_name, device, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None

    memory, handle = _internals.outside_graph_pools(device, allocate)
    _slabs[key] = slab = Slab(memory, handle)
    lifetime.before_destroy("slabs", _drop_slabs)
    return slab


def release_slabs() -> None:
    """Free the memory plan's slabs, and first Inductor's CUDA graphs (they captured the slabs' addresses): for a
    process done with a compiled model, e.g. before it compiles another. A graph compiled before that reserves
    its slab again at its next run (a collective: call this on every rank, as every rank runs the same graphs)."""
    if _slabs or _retired:
        lifetime.release_cuda_graphs()
    _drop_slabs()


def _drop_slabs() -> None:
    """Forget every slab (freed once no tensor holds it). ``destroy_process_group()`` calls it first: a symmetric
    slab's handle dies with its group, and groups made later reuse the names. CUDA graphs that captured a slab
    exist only with the backend's ``cudagraphs``, whose own hook, registered before any slab, frees them first."""
    _slabs.clear()
    _retired.clear()


def slab_of(group_name: str, device: torch.device) -> Slab:
    return _slabs[(group_name, str(device))]


def slab_bytes(*, symmetric: bool | None = None) -> int:
    """Bytes this process holds in memory-plan slabs (those replaced by larger ones included). ``symmetric=True``:
    only those in symmetric memory (the copy-engine routes'; the driver's memory, which
    ``torch.cuda.memory_allocated`` does not count); ``False``: only the others (the caching allocator's)."""
    return sum(slab.memory.numel() for slab in (*_slabs.values(), *_retired)
               if symmetric is None or (slab.handle is not None) == symmetric)


def _slot_fake(
    group_name: str, device: torch.device, offset: int, numel: int, dtype: torch.dtype, slab_bytes: int,
    symmetric: bool, keep_old: bool,
) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


@step_ops.step_op(
    "fsdp_compile::slot",
    "(str group_name, Device device, SymInt offset, SymInt numel, ScalarType dtype, SymInt slab_bytes, bool symmetric,"
    " bool keep_old) -> Tensor",
    _slot_fake,
)
def slot(
    group_name: str, device: torch.device, offset: int, numel: int, dtype: torch.dtype, slab_bytes: int,
    symmetric: bool, keep_old: bool,
) -> torch.Tensor:
    """The slot of ``numel`` elements of ``dtype`` at byte ``offset`` of the group's slab (of ``slab_bytes`` at
    least; a slab that grows keeps its old memory only if ``keep_old``: CUDA graphs): the same memory at every
    call. Inductor never reuses it for its own buffers (``step_ops.lower_with_persistent_output``); the
    collectives that write it are ordered after the previous occupant's readers by the graph ([Note: memory
    plan])."""
    slab = reserve_slab(group_name, device, slab_bytes, symmetric, keep_old)
    key = (offset, numel, dtype)
    if key not in slab.slots:
        slab.slots[key] = torch.from_dlpack(slab.memory[offset : offset + numel * dtype.itemsize].view(dtype))
    return slab.slots[key]


SLOT = slot
step_ops.lower_with_persistent_output(SLOT)

INTO_SLOT_SCHEMA = "(Tensor input, SymInt group_size, str group_name, Tensor(a!) out) -> ()"
"""A collective into a slot (an all-gather, an exchange, and their routes): ``out`` is written in place."""


def into_slot_fake(input: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    return None


@step_ops.step_op("fsdp_compile::all_gather_into_slot", INTO_SLOT_SCHEMA, into_slot_fake)
def all_gather_into_slot(shard: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    """All-gather ``shard`` (cast to ``out``'s dtype) into ``out``, a slot: the cast writes this rank's part in
    place, then an in-place all-gather (its input is that part: it lives in the slot, so no buffer the
    collective reads can be freed or reused before it is done). Wait with ``wait_tensor(out)``. Host work: one
    copy and the functional collective's C++ op (which registers the work for that wait)."""
    part = out.view(group_size, -1)[_internals.group_named(group_name).rank()]
    part.copy_(shard)
    _internals.c10d_functional.all_gather_into_tensor_out(part, group_size, group_name, out=out)


INTO_SLOT = all_gather_into_slot


@step_ops.step_op("fsdp_compile::exchange_into_slot", INTO_SLOT_SCHEMA, into_slot_fake)
def exchange_into_slot(gradient: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    """The gradient exchange (``all_to_all_single`` with equal splits) of ``gradient`` into ``out``, a slot:
    part ``i`` of ``out`` is rank ``i``'s part for this rank. Wait with ``wait_exchange(out, gradient)``, which
    also keeps ``gradient`` from being freed or reused while the collective may still read it."""
    work = dist.all_to_all_single(out, gradient, group=_internals.group_named(group_name), async_op=True)
    _internals.register_work(out, work)


def _wait_exchange_fake(out: torch.Tensor, gradient: torch.Tensor) -> None:
    return None


@step_ops.step_op("fsdp_compile::wait_exchange", "(Tensor(a!) out, Tensor gradient) -> ()", _wait_exchange_fake)
def wait_exchange(out: torch.Tensor, gradient: torch.Tensor) -> None:
    """``wait_tensor(out)`` for an exchange into a slot. ``gradient`` is an argument only so that the compiled
    graph keeps it until here (Inductor frees or reuses a buffer after its last reader, not knowing that a
    collective on another stream still reads it); ``out`` is "mutated" so that every read of it comes after."""
    _internals.c10d_functional.wait_tensor(out)


EXCHANGE_INTO_SLOT = exchange_into_slot
WAIT_EXCHANGE = wait_exchange


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


def write_into_slots(gm: fx.GraphModule, uses: tuple[SlotUse, ...], symmetric: bool, keep_old: bool) -> None:
    """Each slot becomes one ``slot`` node at the graph's start; each of its collectives writes into a view of
    it (``all_gather_into_slot``, ``exchange_into_slot``), which Inductor lowers as a mutation of the slot: it
    runs after every earlier read of the slot, and no such read moves past it. An all-gather's
    ``wait_tensor`` waits for the view; an exchange's becomes ``wait_exchange``. Where the shard was cast to
    ``param_dtype`` just for the all-gather, the op takes the uncast shard (the cast writes into the slot).
    Reserves the slabs (a collective for symmetric ones: ``symmetric`` puts CUDA slabs in symmetric memory)."""
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
                out = graph.call_function(
                    torch.ops.aten.slice.Tensor, (slot_node, 0, 0, collective.meta["val"].numel())
                )
            out.meta["val"] = slot_node.meta["val"][: collective.meta["val"].numel()]
            (_write_exchange if collective.target == EXCHANGE else _write_gather)(graph, collective, out)
        reserve_slab(use.group, value.device, use.slab_bytes, symmetric_here, keep_old)
    lint_and_recompile(gm)


def _write_gather(graph: fx.Graph, gather: fx.Node, out: fx.Node) -> None:
    shard = gather.args[0]
    gather.target, gather.kwargs, gather.meta["val"] = INTO_SLOT, {"out": out}, None
    if shard.target in CASTS and len(shard.users) == 1:
        gather.args = (shard.args[0], *gather.args[1:])
        graph.erase_node(shard)
    gather.replace_all_uses_with(out)  # its wait_tensor


def _write_exchange(graph: fx.Graph, exchange: fx.Node, out: fx.Node) -> None:
    gradient, splits, _, group_name = exchange.args
    (wait,) = exchange.users
    exchange.target, exchange.meta["val"] = EXCHANGE_INTO_SLOT, None
    exchange.args, exchange.kwargs = (gradient, len(splits), group_name), {"out": out}
    with graph.inserting_before(wait):
        graph.call_function(WAIT_EXCHANGE, (out, gradient))
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)


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
