"""The copy-engine collectives: all-gathers and gradient exchanges whose bytes the GPU's copy engines move
(peer-to-peer memcpy over NVLink or PCIe), with no SM held while they run. ``lowering/lower_to_copy_engines.py`` puts
them into graphs.

NCCL's all-gather kernels hold SMs while they run, and the matmuls that the overlap
schedule puts beside them run slower for it (NCCL's all-to-alls in backward too). A copy-engine collective
moves the bytes with the GPU's copy engines (peer-to-peer memcpy over NVLink), and into a slot uses no SM: its
two barriers are the driver's stream memory operations (``Slab.barrier``: the GPU's front end waits for the
peers), or one-block barrier kernels where the driver lacks them or a CUDA graph is being captured.

How an all-gather into a slot runs (``all_gather_into_slot_copy_engine``), on ``w`` ranks, with no staging:
1. compute stream: copy (and cast) the shard into this rank's part of the slot; peers read it from there.
2. side stream (symmetric memory's backend stream), after the compute stream: a barrier (every rank's part
   is in place), ``w - 1`` memcpys of the peers' parts of the same slot into this rank's slot (the slabs
   have the same layout on every rank), one after another on the side stream, from the peers in ring order
   (``rank + 1``, ``rank + 2``, ...: at each step no two ranks read the same peer), a barrier (no peer reads this
   rank's part any more: the slot's next occupant may be written once this all-gather is waited for), an
   event recorded (made once per slot: ``lowering/_streams.py``); the graph's ``wait_copy_engine`` makes the
   compute stream wait for it: the side stream forks from the compute stream and joins it at the wait (what
   CUDA-graph capture needs).
How a gradient exchange into a slot runs (``exchange_into_slot_copy_engine``; the memory plan put the peers'
parts of the exchange's output, in rank order, in a slot of the symmetric slab, and the local sum reads this
rank's own part from the gradient: ``exchange_into_slot``): on the side stream, after the compute stream, a
barrier (every rank has reached this exchange, so every peer's slot is free of its previous occupant),
``w - 1`` memcpys of each peer's part of this rank's gradient into this rank's place in the same slot of that
peer's slab (pushes, in ring order: the gradient stays where Inductor put it), a barrier (every push into this
rank's slot is done), an event; the graph's ``wait_copy_engine`` joins the side stream back and keeps the
gradient alive until then. An exchange the plan left without a slot (a symbolic size) stays on NCCL, said once.
An all-gather into its own buffer (``all_gather_copy_engine``) also copies its part into this rank's slice of
the group's symmetric workspace first (``get_symm_mem_workspace``), and the peers read it from there. The
workspace is allocated when the backend compiles (``reserve_workspace``), sized to the largest shard, so it
does not grow while all-gathers are in flight, nor inside a CUDA graph's memory pool. Where it must grow (a
later graph with a larger shard), the call first waits for the GPU to finish. Allocation is a collective:
every rank calls the all-gathers in the same order. Needs a CUDA build of torch with symmetric memory and
GPUs that can map each other's memory (NVLink or PCIe peer access); ``plan_copy_engines`` raises for
all-gathers on other devices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from fsdp_compile import _internals
from fsdp_compile._internals import cuda_driver, step_ops, symm_mem
from fsdp_compile.debug import degraded
from fsdp_compile.runtime.slots import INTO_SLOT_SCHEMA, Slab, into_slot_fake, ring_order, slab_of
from fsdp_compile.runtime.streams import copy_in_turn, fork_side, on_side_stream, record_done

__all__ = [
    "all_gather_copy_engine",
    "all_gather_into_slot_copy_engine",
    "copy_between_slabs",
    "exchange_into_slot_copy_engine",
    "reserve_workspace",
    "workspace_nbytes",
]

log = logging.getLogger(__name__)

_workspace_bytes: dict[str, int] = {}
"""Per process group: the size of the symmetric workspace this module has asked for."""


def workspace_nbytes(shards: Iterable[tuple[int, torch.dtype]]) -> int:
    """The workspace the copy-engine all-gathers of these shards (numel, dtype on the wire) need: the
    largest shard, in bytes (each all-gather stages this rank's shard in its slice of the workspace)."""
    return max((numel * dtype.itemsize for numel, dtype in shards), default=0)


def reserve_workspace(group_name: str, nbytes: int) -> Any:
    """Make the group's symmetric workspace at least ``nbytes`` (a collective) and return it (a
    ``_SymmetricMemory``). The backend calls this when it compiles, before the graphs first run: allocated
    inside a graph's first run, under CUDA graphs, the workspace's small device-side tables would land in
    the CUDA graphs' memory pool, which must hold only tensors the graphs own (Inductor checks this).
    Lifetime: [Note: symmetric workspace lifetime] in docs/architecture.md."""
    if nbytes > _workspace_bytes.get(group_name, 0):
        if group_name in _workspace_bytes:
            log.warning(
                "lower_to_copy_engines: the symmetric workspace of group %s grows from %d to %d bytes: waiting for "
                "the GPU first (torch.cuda.synchronize)", group_name, _workspace_bytes[group_name], nbytes
            )
            _internals.counters["fsdp_compile"]["symm_mem_workspace_regrowths"] += 1
        torch.cuda.synchronize()  # growing frees the old workspace: nothing may still read it
        _workspace_bytes[group_name] = nbytes
    return symm_mem.workspace(group_name, _workspace_bytes[group_name])


def _gathered_fake(shard: torch.Tensor, group_size: int, group_name: str, workspace_bytes: int) -> torch.Tensor:
    return shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))


@step_ops.step_op(
    "fsdp_compile::all_gather_copy_engine",
    "(Tensor shard, SymInt group_size, str group_name, SymInt workspace_bytes) -> Tensor",
    _gathered_fake,
    device_type="cuda",
)
def all_gather_copy_engine(
    shard: torch.Tensor, group_size: int, group_name: str, workspace_bytes: int
) -> torch.Tensor:
    """``all_gather_into_tensor(shard, group_size, group_name)`` by copy engines, through a symmetric
    workspace of at least ``workspace_bytes``; wait for the result with ``_c10d_functional.wait_tensor``
    (steps: the module docstring)."""
    nbytes = max(workspace_bytes, shard.nbytes)
    if nbytes > _workspace_bytes.get(group_name, 0):
        degraded("copy_engine_mid_step_syncs", f"all_gather_copy_engine: the symmetric workspace of group "
                 f"{group_name} was not reserved for {nbytes} bytes when the graph compiled; reserving it now "
                 "waits for the GPU (torch.cuda.synchronize) in the middle of a step")
    workspace = reserve_workspace(group_name, nbytes)
    output = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
    parts = output.chunk(group_size)
    parts[workspace.rank].copy_(shard)
    with on_side_stream():
        workspace.get_buffer(workspace.rank, shard.shape, shard.dtype).copy_(parts[workspace.rank])
        workspace.barrier()
        copy_in_turn([(parts[peer], workspace.get_buffer(peer, shard.shape, shard.dtype))
                      for peer in ring_order(workspace.rank, group_size)])
        workspace.barrier()
        symm_mem.register_work(output)  # its event: recorded on `side`
    return output


def copy_between_slabs(slab: Slab, copies: Iterable[tuple[int, int, int]], out: torch.Tensor) -> None:
    """The side-stream part of a copy-engine collective into the slot ``out`` of ``slab``: a barrier (every rank
    is here: its part in place, its slot free), the ``copies`` (destination, source, bytes: to or from the peers'
    slabs, in ring order), a barrier (every copy into or out of this rank's slab is done), the event that
    ``wait_copy_engine(out, ...)`` waits for. The driver's calls on the side stream (``_internals.cuda_driver``),
    not made current: cheaper on the host than torch's stream switch, ``copy_`` and events."""
    side = fork_side(out.device.index)
    slab.barrier(side)
    raw = side.cuda_stream
    for dst, src, nbytes in copies:
        cuda_driver.copy(raw, dst, src, nbytes)
    slab.barrier(side)
    record_done(out, side)


@step_ops.step_op(
    "fsdp_compile::all_gather_into_slot_copy_engine", INTO_SLOT_SCHEMA, into_slot_fake, device_type="cuda"
)
def all_gather_into_slot_copy_engine(shard: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    """``all_gather_into_slot`` by copy engines: ``out`` is (a view of) a slot of the group's symmetric slab;
    wait with ``wait_copy_engine(out, None)`` (steps: the module docstring)."""
    slab = slab_of(group_name, out.device)
    mine, pulls = slab.pulls(out, group_size)
    mine.copy_(shard)
    copy_between_slabs(slab, pulls, out)


@step_ops.step_op(
    "fsdp_compile::exchange_into_slot_copy_engine", INTO_SLOT_SCHEMA, into_slot_fake, device_type="cuda"
)
def exchange_into_slot_copy_engine(gradient: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    """``exchange_into_slot`` by copy engines: ``out`` is (a view of) a slot of the group's symmetric slab, which
    receives the peers' parts; wait with ``wait_copy_engine(out, gradient)`` (steps: the module docstring). The
    parts are copied as bytes: ``gradient`` must be contiguous, of ``out``'s dtype, ``group_size`` parts of
    ``out``'s."""
    slab = slab_of(group_name, out.device)
    pushes = slab.pushes(out, group_size)
    start, part = gradient.data_ptr(), pushes[0][2]
    if gradient.dtype != out.dtype or not gradient.is_contiguous() or gradient.nbytes != part * group_size:
        raise ValueError(
            f"exchange_into_slot_copy_engine: the gradient ({gradient.dtype}, {gradient.numel()} elements, "
            f"contiguous: {gradient.is_contiguous()}) must be contiguous, of the slot's dtype ({out.dtype}) and "
            f"{group_size} parts of {part} bytes each, the slot's {group_size - 1} parts (peers' parts)"
        )
    copy_between_slabs(slab, [(theirs, start + peer * part, part) for peer, theirs, _ in pushes], out)
