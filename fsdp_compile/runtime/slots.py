"""The memory plan's slots at run time: one allocation (a slab) per process group and device holds the group's
slots, the op ``fsdp_compile::slot`` hands a compiled graph one slot of it, and each all-gather and gradient
exchange writes into its slot (``fsdp_compile::all_gather_into_slot``, ``fsdp_compile::exchange_into_slot``)
instead of a buffer of its own ([Note: memory plan] in docs/architecture.md; how a graph gets them:
``fsdp_compile.passes._write_slots``).

A slab is plain memory, or symmetric memory (``torch.distributed._symmetric_memory``, rendezvoused once) for
the copy-engine routes, which read (all-gather) or write (exchange) the peers' slots. Every graph lays its
slots out from the slab's start: graphs run one after another and no slotted buffer outlives its graph, so
they share the memory. Each slot is handed out as a tensor of its own storage (same memory, through
DLPack): c10d keys in-flight collectives by storage, so the wait for one slot's collective must not wait for
another slot's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile import _internals
from fsdp_compile._internals import cuda_driver, lifetime, step_ops, symm_mem

__all__ = [
    "EXCHANGE_INTO_SLOT", "INTO_SLOT", "SLOT", "Slab", "WAIT_EXCHANGE", "all_gather_into_slot",
    "every_slab", "exchange_into_slot", "fake_slabs", "release_slabs", "reserve_slab", "ring_order", "slab_bytes", "slab_of", "slot",
    "wait_exchange",
]

log = logging.getLogger(__name__)


def ring_order(rank: int, group_size: int) -> list[int]:
    """The peers of ``rank`` in the order its copy-engine collectives copy from or to them: ``rank + 1``, ``rank +
    2``, ... (mod ``group_size``). At each step every rank has a different peer, so no rank is read (or written)
    by two peers at once (rank order has every rank read rank 0 first: docs/measurements.md, "Ring order")."""
    return [(rank + step) % group_size for step in range(1, group_size)]


@dataclass
class Signals:
    """A symmetric slab's barrier counters (after its slots, ``world`` 64-bit counters on every rank: rank ``r``'s
    counter in rank ``p``'s memory is how many barriers ``r`` has reached, written by ``r``) and the driver's batch
    of stream memory operations for one barrier: write this rank's counter in every peer's memory (their
    addresses, ``ops.writes``), then wait on every peer's counter in this rank's (``ops.waits``), the peers in ring
    order."""

    ops: cuda_driver.MemOps
    reached: int = 0
    """Barriers this rank has reached (every rank reaches the same ones: they run the same graphs)."""


@dataclass
class Slab:
    memory: torch.Tensor
    """1-D ``uint8``."""
    handle: Any | None
    """The symmetric-memory handle (peers' buffers, barriers), or None for plain memory."""
    signals: Signals | None = None
    """A symmetric slab's counters for :meth:`barrier`, where the driver has stream memory operations."""
    slots: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """(byte offset, numel, dtype) -> the slot's tensor."""
    _views: dict[tuple[str, int, int, torch.dtype], Any] = field(default_factory=dict)

    def barrier(self, stream: torch.cuda.Stream) -> None:
        """On ``stream``, every rank of the (symmetric) slab's group waits until all have come here. With the
        driver's stream memory operations (``_internals.cuda_driver``), each rank writes the number of barriers it
        has reached into its counter in every peer's memory, then waits until every peer's counter in its own
        memory is as high: the GPU's front end waits, no SM does (symmetric memory's barrier kernel spins on one,
        slowing the matmuls beside it: docs/measurements.md, "Barriers"). The barrier kernel while the current
        stream is being captured (a CUDA graph would replay the same numbers) or without stream memory
        operations."""
        signals = self.signals
        if signals is None or torch.cuda.is_current_stream_capturing():
            with torch.cuda.stream(stream):
                self.handle.barrier()
            return
        signals.reached += 1
        signals.ops.enqueue(stream.cuda_stream, signals.reached)

    def pulls(self, gathered: torch.Tensor, group_size: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """For an all-gather's output ``gathered`` in this (symmetric) slab: this rank's part of it, and for every
        peer, in ring order, the copy that pulls the peer's part from the same place in the peer's slab: (this
        rank's address of it, the peer's, bytes)."""
        return self._made_once("pull", gathered, group_size)  # type: ignore[no-any-return]

    def pushes(self, received: torch.Tensor, group_size: int) -> list[tuple[int, int, int]]:
        """For the peers' parts of an exchange's output, ``received`` in this (symmetric) slab (``group_size - 1``
        parts, the peers' in rank order): for every peer, in ring order, (peer, the address of this rank's part of
        the same place in the peer's slab, its bytes): where this rank's gradient part for that peer goes."""
        return self._made_once("push", received, group_size)  # type: ignore[no-any-return]

    def _made_once(self, way: str, tensor: torch.Tensor, group_size: int) -> Any:
        """What ``pulls`` and ``pushes`` return, made once per place (the slabs have one layout on every rank):
        views cost a few µs of host time at every collective."""
        key = (way, tensor.data_ptr() - self.memory.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in self._views:
            start, rank = key[1] // tensor.element_size(), self.handle.rank
            peers = ring_order(rank, group_size)

            def theirs(peer: int, index: int, part: int) -> int:  # part ``index`` of the peer's place
                return self.handle.get_buffer(peer, (part,), tensor.dtype, start + index * part).data_ptr()

            if way == "pull":
                mine, part = tensor.view(group_size, -1), tensor.numel() // group_size
                nbytes = part * tensor.element_size()
                self._views[key] = (mine[rank], [(mine[peer].data_ptr(), theirs(peer, peer, part), nbytes)
                                                 for peer in peers])
            else:  # this rank's place among each peer's peers
                part = tensor.numel() // (group_size - 1)
                nbytes = part * tensor.element_size()
                self._views[key] = [(peer, theirs(peer, rank - (rank > peer), part), nbytes) for peer in peers]
        return self._views[key]


_slabs: dict[tuple[str, str], Slab] = {}
_retired: list[Slab] = []
"""Slabs a larger one replaced: CUDA graphs captured before still read and write their memory."""
_fake: list[Any] = []
"""The fake mode slabs are made in while ``fake_slabs`` runs (``fsdp_compile.estimate``: nothing allocated)."""


@contextlib.contextmanager
def fake_slabs(mode: Any) -> Iterator[None]:
    """Slabs reserved inside are fake tensors of ``mode`` (``fsdp_compile.estimate``), dropped at the end."""
    _fake.append(mode)
    try:
        yield
    finally:
        _fake.pop()
        _drop_slabs()


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

    def allocate() -> Slab:
        if not symmetric:
            return Slab(torch.empty(nbytes, dtype=torch.uint8, device=device), None)
        if not cuda_driver.has_stream_memops():
            return Slab(*symm_mem.slab(group_name, device, nbytes))
        start = -(-nbytes // 8) * 8  # the counters, after the slots, 8-byte aligned
        memory, handle = symm_mem.slab(group_name, device, start + 8 * _internals.group_named(group_name).size())
        return Slab(memory[:nbytes], handle, _signals(handle, start // 8))

    if _fake:
        with _fake[-1]:
            _slabs[key] = slab = allocate()
    else:
        _slabs[key] = slab = _internals.outside_graph_pools(device, allocate)
    lifetime.before_destroy("slabs", _drop_slabs)
    return slab


def _signals(handle: Any, start: int) -> Signals:
    """The counters at ``start`` (in 8-byte words) of a symmetric slab, zeroed on every rank before any rank
    writes into a peer's (a barrier kernel, with the GPU idle before and after: a slab is made once, when the
    backend compiles or at a graph's first run)."""
    rank, world = handle.rank, handle.world_size
    counters = [handle.get_buffer(peer, (world,), torch.int64, start) for peer in range(world)]
    counters[rank].zero_()
    torch.cuda.synchronize()
    handle.barrier()
    torch.cuda.synchronize()
    peers = ring_order(rank, world)
    return Signals(cuda_driver.MemOps(writes=[counters[peer][rank].data_ptr() for peer in peers],
                                      waits=[counters[rank][peer].data_ptr() for peer in peers]))


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


def every_slab() -> list[Slab]:
    """The slabs in use and those a larger one replaced."""
    return [*_slabs.values(), *_retired]


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
    """The gradient exchange (``all_to_all_single`` with equal splits) of ``gradient``, of which ``out``, a slot,
    receives the peers' parts (``group_size - 1`` parts, in rank order: this rank's own part stays in
    ``gradient``, where the sum reads it). Wait with ``wait_exchange(out, gradient)``. The route any device runs
    (copy engines: ``exchange_into_slot_copy_engine``): a plain all-to-all into a buffer of its own, then a copy
    of the peers' parts, in place of the peers' writes."""
    group = _internals.group_named(group_name)
    received = torch.empty_like(gradient)
    dist.all_to_all_single(received, gradient, group=group)
    parts, rank, peers = received.view(group_size, -1), group.rank(), out.view(group_size - 1, -1)
    peers[:rank].copy_(parts[:rank])
    peers[rank:].copy_(parts[rank + 1 :])


def _wait_exchange_fake(out: torch.Tensor, gradient: torch.Tensor) -> None:
    return None


@step_ops.step_op("fsdp_compile::wait_exchange", "(Tensor(a!) out, Tensor gradient) -> ()", _wait_exchange_fake)
def wait_exchange(out: torch.Tensor, gradient: torch.Tensor) -> None:
    """The graph's wait for an exchange into a slot: nothing to do on this route (``exchange_into_slot`` is done
    when it returns); on copy engines the lowering makes it ``wait_copy_engine``. ``gradient`` is an argument
    only so that the compiled graph keeps it until here (Inductor frees or reuses a buffer after its last
    reader, not knowing that a collective on another stream still reads it); ``out`` is "mutated" so that every
    read of it comes after."""


EXCHANGE_INTO_SLOT = exchange_into_slot
WAIT_EXCHANGE = wait_exchange
